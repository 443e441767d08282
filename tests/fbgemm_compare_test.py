"""Smoke tests of `python -m bench.fbgemm_compare` at tiny sizes.

The pallas_emb side runs in a fresh process (the script pins its threads
and sets XLA_FLAGS before JAX starts); FBGEMM is never needed: its rows are
skipped with a message, which is checked for a missing python and for a
python that cannot import fbgemm_gpu. With env PALLAS_EMB_FBGEMM_PYTHON
set to a working torch + fbgemm-gpu-cpu venv, one more test compares both
sides' final tables.
"""

import os
import stat
import tempfile

import test_util

from absl.testing import absltest

from bench import fbgemm_compare

TINY = ["--workloads=a:512:32:1,b:512:32:3", "--steps=2", "--warmup=1",
        "--dtypes=float32", "--pin_cpus="]


def run_compare(*args, timeout=600):
  with tempfile.TemporaryDirectory() as tmp:
    doc, stdout = test_util.run_program(
        "bench.fbgemm_compare", [*TINY, *args, f"--tmp_dir={tmp}"], tmp,
        drop_env=("PALLAS_EMB_FBGEMM_PYTHON",), timeout=timeout)
    leftovers = [n for n in os.listdir(tmp) if n != "out.json"]
    return doc, stdout, leftovers


def fake_python(directory: str) -> str:
  """An 'interpreter' whose worker probe fails as a missing fbgemm does."""
  path = os.path.join(directory, "python")
  with open(path, "w") as f:
    f.write("#!/bin/sh\n"
            "echo \"ModuleNotFoundError: No module named 'fbgemm_gpu'\" >&2\n"
            "exit 1\n")
  os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
  return path


class FbgemmCompareTest(absltest.TestCase):

  def test_pallas_side_and_skip_message(self):
    doc, stdout, leftovers = run_compare(
        "--fbgemm_python=/nonexistent/python", "--profile",
        "--profile_steps=1", "--pallas_cases=sequence,pooled,pooled_fit,default")
    self.assertIn(fbgemm_compare.SKIP, stdout)
    self.assertIn("/nonexistent/python is not an executable", stdout)
    self.assertIn("fbgemm-gpu-cpu==1.8.0", doc["meta"]["fbgemm_skipped"])
    self.assertEmpty(leftovers)  # the workload files are removed
    self.assertIn("--xla_cpu_multi_thread_eigen=false",
                  doc["meta"]["pallas_emb_threads"]["xla_flags"])
    results = doc["results"]
    self.assertTrue(all(r["side"] == "pallas_emb" for r in results))
    cases = {(r["workload"], r["case"]) for r in results}
    self.assertEqual(cases, {("a", "sequence"), ("a", "pooled"),
                             ("a", "pooled_fit"), ("a", "default"),
                             ("b", "pooled"), ("b", "pooled_fit"),
                             ("b", "default")})
    for r in results:
      self.assertGreater(r["median_ms"], 0)
      self.assertLen(r["losses"], 3)  # warmup + steps
      unique = r["workload_spec"]["unique_ids"]
      # Exactly the touched rows moved, all of them got an accumulator.
      self.assertEqual(r["rows_moved"], unique)
      self.assertEqual(r["untouched_rows_moved"], 0)
      self.assertEqual(r["momentum_nonzero"], unique)
      self.assertNotIn("speed_vs_fbgemm", r)
      # The loss is linear in the embeddings: still no table-sized op.
      self.assertEqual(r["full_table_ops"], [])
      prof = r["profile"]
      self.assertNotEmpty(prof["top_ops"])
      self.assertGreater(prof["ops_ms_per_step"], 0)
    by_pair = {(c["workload"], c["a"], c["b"]): c for c in doc["comparisons"]}
    # A bag of one pooled by "sum" is the sequence lookup.
    c = by_pair[("a", "pallas_emb sequence float32",
                 "pallas_emb pooled float32")]
    self.assertLess(c["max_abs_diff_rows"], 1e-6)
    # A unique buffer fit to the ids, or the default collection (its
    # platform's dedup), changes no bit of the training.
    for workload in ("a", "b"):
      for other in ("pooled_fit", "default"):
        c = by_pair[(workload, "pallas_emb pooled float32",
                     f"pallas_emb {other} float32")]
        self.assertEqual(c["max_abs_diff_rows"], 0.0, other)
    self.assertIn("workload", doc["table"])
    for workload in ("a", "b"):
      self.assertRegex(doc["table"], f"{workload} float32: default [0-9.]+ "
                       r"ms = [0-9.]+x the best tuned case \(pooled")

  def test_skip_when_fbgemm_does_not_import(self):
    with tempfile.TemporaryDirectory() as tmp:
      python = fake_python(tmp)
      doc, stdout, _ = run_compare(f"--fbgemm_python={python}",
                                   "--workloads=a:256:16:1",
                                   "--pallas_cases=sequence")
    self.assertIn(f"{fbgemm_compare.SKIP} {python} cannot import torch / "
                  "fbgemm_gpu (ModuleNotFoundError: No module named "
                  "'fbgemm_gpu')", stdout)
    self.assertEqual([r["case"] for r in doc["results"]], ["sequence"])

  def test_probe_without_python(self):
    versions, why = fbgemm_compare.probe_fbgemm("", 1)
    self.assertIsNone(versions)
    self.assertStartsWith(why, fbgemm_compare.SKIP)
    self.assertIn("PALLAS_EMB_FBGEMM_PYTHON", why)

  def test_summarize_trace_exclusive_times(self):
    def ev(op, ts, dur):
      return {"ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 1,
              "name": op, "args": {"hlo_op": op}}
    events = [ev("copy.1", 0, 100), ev("while.2", 100, 500),
              ev("fusion.3", 110, 200), ev("fusion.3", 320, 200),
              {"ph": "X", "ts": 0, "dur": 900, "name": "ThunkExecutor"}]
    info = fbgemm_compare.hlo_ops(
        "  %copy.1 = f32[8,4]{1,0} copy(%p), metadata={op_name=\"jit(f)/x\"}")
    summary = fbgemm_compare.summarize_trace(events, steps=2, step_s=1e-3,
                                             ops_info=info)
    ops = {o["op"]: o for o in summary["top_ops"]}
    self.assertAlmostEqual(ops["while.2"]["ms_per_step"], 0.05)
    self.assertAlmostEqual(ops["while.2/fusion.3"]["ms_per_step"], 0.2)
    self.assertEqual(ops["while.2/fusion.3"]["calls_per_step"], 1)
    self.assertAlmostEqual(summary["ops_ms_per_step"], 0.3)
    self.assertEqual(ops["copy.1"]["hlo"], "f32[8,4]{1,0} copy <- jit(f)/x")

  def test_both_sides_agree(self):
    python = os.environ.get("PALLAS_EMB_FBGEMM_PYTHON")
    if not python or fbgemm_compare.probe_fbgemm(python, 1)[0] is None:
      self.skipTest("set PALLAS_EMB_FBGEMM_PYTHON to a torch + "
                    "fbgemm-gpu-cpu venv to compare with FBGEMM")
    doc, stdout, _ = run_compare(f"--fbgemm_python={python}",
                                 "--fbgemm_precisions=fp32")
    self.assertNotIn(fbgemm_compare.SKIP, stdout)
    fbgemm = [r for r in doc["results"] if r["side"] == "fbgemm"]
    self.assertEqual({(r["workload"], r["case"]) for r in fbgemm},
                     {("a", "sum"), ("a", "none"), ("b", "sum")})
    for c in doc["comparisons"]:
      if c["a"].startswith("pallas_emb") and c["b"].startswith("fbgemm"):
        self.assertLess(c["max_abs_diff_rows"], 1e-5, c)
        self.assertLess(c["max_rel_diff_row_state"], 1e-5, c)
        self.assertEqual(c["rows_moved"][0], c["rows_moved"][1])
    for r in doc["results"]:
      if r["side"] == "pallas_emb":
        self.assertIn("speed_vs_fbgemm", r)


if __name__ == "__main__":
  absltest.main()
