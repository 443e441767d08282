"""`python -m bench.planner_compare` (pe.plan vs TorchRec's planner).

TorchRec is never needed: without its venv the program prints one skip
line and exits 0 (checked); the translation of TorchRec's sharding types
into our placements is checked on hand-written TorchRec plans. With env
PALLAS_EMB_TORCHREC_PYTHON (or PALLAS_EMB_FBGEMM_PYTHON) naming a torch +
fbgemm-gpu-cpu + torchrec venv, the tiny set is planned by both.
"""

import tempfile

import test_util

from absl.testing import absltest

from bench import peer
from bench import planner_sets as sets

ENVS = ("PALLAS_EMB_TORCHREC_PYTHON", "PALLAS_EMB_FBGEMM_PYTHON")


def run_compare(*args):
  with tempfile.TemporaryDirectory() as tmp:
    return test_util.run_program("bench.planner_compare", ["--cases=t:4",
                                                           *args],
                                 tmp, drop_env=ENVS, timeout=300)


def table(name, rows, width, ids=2.0):
  return {"name": name, "rows": rows, "width": width, "dtype": "float32",
          "features": [name], "ids_per_example": [ids], "pooled": True}


def shards(*specs):
  """TorchRec's shards [row offset, col offset, rows, cols, rank]."""
  return [list(s) for s in specs]


class PlannerCompareTest(absltest.TestCase):

  def test_skip_without_torchrec(self):
    doc, stdout = run_compare("--torchrec_python=/nonexistent/python")
    self.assertEqual(stdout.strip().splitlines(), [doc["meta"]["skipped"]])
    self.assertStartsWith(stdout, "planner comparison skipped: "
                          "--torchrec_python=/nonexistent/python is not an "
                          "executable file")
    self.assertIn("torchrec==1.8.0", stdout)

  def test_translation(self):
    """Four ranks: the exact mappings, then shards with no placement of
    ours become table-placed slices (a row slice reads its share of ids)."""
    tables = [table("dp", 10, 8), table("tw", 100, 8), table("rw", 1000, 8),
              table("cw", 50, 8), table("cw2", 60, 8), table("twrw", 400, 8)]
    plan = {
        "dp": {"sharding_type": "data_parallel", "ranks": [0, 1, 2, 3],
               "shards": []},
        "tw": {"sharding_type": "table_wise", "ranks": [2],
               "shards": shards((0, 0, 100, 8, 2))},
        "rw": {"sharding_type": "row_wise", "ranks": [0, 1, 2, 3],
               "shards": shards(*[(250 * r, 0, 250, 8, r) for r in range(4)])},
        "cw": {"sharding_type": "column_wise", "ranks": [3, 2, 1, 0],
               "shards": shards(*[(0, 2 * c, 50, 2, 3 - c)
                                  for c in range(4)])},
        "cw2": {"sharding_type": "column_wise", "ranks": [1, 1],
                "shards": shards((0, 0, 60, 4, 1), (0, 4, 60, 4, 1))},
        "twrw": {"sharding_type": "table_row_wise", "ranks": [0, 1, 2, 3],
                 "shards": shards((0, 0, 300, 8, 0), (300, 0, 100, 8, 1),
                                  (400, 0, 0, 8, 2), (400, 0, 0, 8, 3))},
    }
    pieces, where, notes = sets.translate(tables, plan, 4)
    self.assertEqual(where, {
        "dp": ("replicated", None), "tw": ("table", 2), "rw": ("row", None),
        "cw": ("column", None), "cw2@r0c0": ("table", 1),
        "cw2@r0c4": ("table", 1), "twrw@r0c0": ("table", 0),
        "twrw@r300c0": ("table", 1)})
    by_name = {p["name"]: p for p in pieces}
    self.assertEqual((by_name["cw2@r0c4"]["rows"], by_name["cw2@r0c4"]["width"],
                      by_name["cw2@r0c4"]["ids_per_example"]), (60, 4, [2.0]))
    self.assertEqual(by_name["twrw@r0c0"]["ids_per_example"], [1.5])
    self.assertEqual(by_name["twrw@r300c0"]["ids_per_example"], [0.5])
    self.assertEqual(notes, [
        "cw2: CW in 2 shards -> table-placed column slices",
        "twrw: TWRW in 4 shards -> table-placed row slices (~)"])
    # Scored by pe.plan's model: a column slice pair on rank 1 stores both.
    cost = sets.score(pieces, where, 4, batch_size=8)
    self.assertTrue(cost["addressable"])
    self.assertGreater(cost["shard_bytes_max"], cost["shard_bytes_mean"])
    # The row table's bucket fit to 1.25 x 16 / 4 ids, not all 16.
    self.assertLess(cost["sent_fitted"], cost["sent_per_rank"])

  def test_row_or_column_on_fewer_ranks_is_not_exact(self):
    plan = {"r": {"sharding_type": "row_wise", "ranks": [0, 1],
                  "shards": shards((0, 0, 50, 8, 0), (50, 0, 50, 8, 1))}}
    _, where, _ = sets.translate([table("r", 100, 8)], plan, 4)
    self.assertEqual(where, {"r@r0c0": ("table", 0), "r@r50c0": ("table", 1)})

  def test_both_planners(self):
    python = peer.default_python(*ENVS)
    if not python:
      self.skipTest("set PALLAS_EMB_TORCHREC_PYTHON to a torch + torchrec "
                    "venv to plan with TorchRec")
    doc, stdout = run_compare(f"--torchrec_python={python}")
    self.assertNotIn("skipped", stdout)
    ours, theirs = doc["results"]
    self.assertEqual((ours["planner"], theirs["planner"]),
                     ("pe.plan", "TorchRec"))
    self.assertEqual(ours["new_jax_arrays"], 0)
    names = {t["name"] for t in sets.table_set("t")[0]}
    self.assertEqual(set(theirs["torchrec_plan"]), names)
    for name, p in theirs["torchrec_plan"].items():
      placed = [n for n in theirs["translated"] if n.split("@")[0] == name]
      self.assertNotEmpty(placed)
      if p["sharding_type"] in sets.EXACT:
        self.assertEqual(placed, [name])
    for r in doc["results"]:
      self.assertGreater(r["score"]["sent_per_rank"], 0)
    self.assertIn("| t | 4 | TorchRec |", stdout)


if __name__ == "__main__":
  absltest.main()
