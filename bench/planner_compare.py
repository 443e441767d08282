"""pe.plan vs TorchRec's EmbeddingShardingPlanner, scored by one cost model.

    python -m bench.planner_compare --torchrec_python=/work/peer_venv/bin/python
    python -m bench.planner_compare --cases=a:8,b:512 --json_out=plans.json

Each case `SET:W` plans a table set for W ranks of `--device_memory_gib`
(80 GiB) with both planners, with the same budget: `--reserve_fraction`
(a fifth) of every device kept back (pe.plan's `reserve`, TorchRec's
`FixedPercentageStorageReservation`). Sets (every table row-wise Adagrad,
every feature one per table):

  a  the 26 Criteo-1TB tables of MLPerf DLRM (vocabularies capped at 40M,
     width 128, f32), one id per example, pooled; 8,192 examples per rank
     (65,536 over 8 ranks).
  b  the reference's table set: users 100M, items 100M, authors 30M, ips 10M
     rows (240M), width 1024, bf16; sequence features of 2 / 600 / 600 / 2
     ids per example (300 history + candidate positions of an item and its
     author, every entity hashed twice); 64 examples per rank.
  c  `--mix_tables` (100) tables, rows log-uniform in [10, 50M], widths
     16-256 (powers of two), f32, 1-20 ids per example, pooled; 4,096
     examples per rank; seeded by `--mix_seed`.
  t  a tiny set of 6 tables (the tests' fast mode).

Both plans are scored by pe.plan's own model (`pe.plan_cost`,
docs/planner.md): bytes of tables + optimizer state per rank as the
collection stacks them (every rank equal), the shard bytes per rank without
the stacks' padding (max and mean), and the bytes a rank sends per step:
at the default row buckets (never overflowing: an owner's bucket holds
every id a rank has), and ("row caps fit") with every row table's
bucket fit to uniform ids, `--fit_headroom` x its ids per rank / W.
These are what the placements cost in pallas_emb's dataflows, not in
TorchRec's (docs/planner.md).
TorchRec's plan is translated into our placements first (docs/planner.md,
"Against TorchRec's planner"): data_parallel -> replicated, table_wise ->
table on its rank, row_wise over all W ranks -> row, column_wise /
table_column_wise in W equal shards on W ranks -> column; any other shards
(column_wise in k < W shards, table_row_wise, grid_shard) become one
table-placed table per shard, each read by the table's features (a
column slice: the same ids; a row slice: ids in proportion to its rows,
uniform ids assumed, marked "~").

pe.plan runs on an `AbstractMesh` and allocates no arrays (checked: the
live jax arrays before and after, and the Python heap's peak during it).
TorchRec runs in its own venv (`bench/torchrec_planner_worker.py`, with
`--torchrec_python`, default env PALLAS_EMB_TORCHREC_PYTHON, then
PALLAS_EMB_FBGEMM_PYTHON); without it this prints one line saying why and
exits 0.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

from bench import peer
from bench import planner_sets as sets

_CASES = flags.DEFINE_list(
    "cases", ["a:8", "a:64", "b:64", "b:512", "c:8", "c:64"],
    "SET:RANKS cases; sets a, b, c, t (see the module doc).")
_MEMORY = flags.DEFINE_float("device_memory_gib", 80.0,
                             "Memory per device, GiB (2**30 bytes).")
_RESERVE = flags.DEFINE_float(
    "reserve_fraction", 0.2,
    "Fraction of every device kept for the dense model (both planners).")
_LOCAL = flags.DEFINE_integer(
    "local_world_size", 8, "Ranks per host (TorchRec's topology; pe.plan's "
    "model has no hosts).")
_HEADROOM = flags.DEFINE_float(
    "fit_headroom", 1.25, "Row buckets' headroom over uniform ids in the "
    "'row caps fit' column.")
_MIX_TABLES = flags.DEFINE_integer("mix_tables", 100, "Tables of set c.")
_MIX_SEED = flags.DEFINE_integer("mix_seed", 0, "Seed of set c.")
TORCHREC_ENV = "PALLAS_EMB_TORCHREC_PYTHON"
_PYTHON = flags.DEFINE_string(
    "torchrec_python",
    peer.default_python(TORCHREC_ENV, "PALLAS_EMB_FBGEMM_PYTHON"),
    f"Python of a venv with torch, fbgemm-gpu-cpu and torchrec (default: env"
    f" {TORCHREC_ENV}, then PALLAS_EMB_FBGEMM_PYTHON).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "torchrec_planner_worker.py")
SKIP = "planner comparison skipped:"
BUILD_HINT = ("build a venv with torch==2.13.0, fbgemm-gpu-cpu==1.8.0 and "
              "torchrec==1.8.0 outside the repository (docs/planner.md, "
              "\"Against TorchRec's planner\")")
def run_torchrec(python: str, tables: list[dict], ranks: int,
                 batch_size: int, device_memory: int) -> dict:
  problem = {"world_size": ranks, "local_world_size": min(_LOCAL.value, ranks),
             "hbm_cap": device_memory, "reserve_fraction": _RESERVE.value,
             "batch_size": batch_size, "tables": tables}
  proc = subprocess.run([python, WORKER], input=json.dumps(problem),
                        capture_output=True, text=True, check=False,
                        env=peer.worker_env())
  if proc.returncode:
    raise RuntimeError(f"TorchRec planner worker failed on {ranks} ranks:\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _kinds(counter) -> str:
  return ", ".join(f"{n} {k}" for k, n in sorted(counter.items(),
                                                  key=lambda kv: -kv[1]))


def format_table(rows: list[dict], budget: int) -> str:
  head = ("| set | W | planner | placements | GB/rank (stacked) | shard GB "
          "max / mean | MB sent/rank/step | row caps fit | plan s |")
  lines = [head, "|" + "---|" * 9]
  for r in rows:
    s = r.get("score")
    if s is None:
      lines.append(f"| {r['set']} | {r['ranks']} | {r['planner']} | "
                   f"infeasible | | | | | |")
      continue
    mem = f"{s['memory_per_rank'] / 1e9:.2f}" + (
        " (over budget)" if s["memory_per_rank"] > budget else "") + (
        "" if s["addressable"] else " (no int32 stack)")
    lines.append(
        f"| {r['set']} | {r['ranks']} | {r['planner']} | {r['summary']} "
        f"| {mem} | {s['shard_bytes_max'] / 1e9:.2f} / "
        f"{s['shard_bytes_mean'] / 1e9:.2f} | {s['sent_per_rank'] / 1e6:,.1f}"
        f" | {s['sent_fitted'] / 1e6:,.1f} | {r['plan_seconds']:.2f} |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cases = []
  for case in _CASES.value:
    name, _, ranks = case.partition(":")
    if not ranks.isdigit() or int(ranks) < 1:
      raise app.UsageError(f"--cases has {case!r}; expected SET:RANKS, e.g. "
                           "a:8.")
    if name not in sets.SETS:
      raise app.UsageError(f"--cases has set {name!r}; expected one of "
                           f"{sets.SETS}.")
    cases.append((name, int(ranks)))
  versions, skipped = peer.probe(
      _PYTHON.value, WORKER, ["--probe"], skip=SKIP, what="TorchRec",
      flag="--torchrec_python",
      env_names=(TORCHREC_ENV, "PALLAS_EMB_FBGEMM_PYTHON"),
      imports="torch / torchrec's planner", hint=BUILD_HINT)
  if skipped:
    print(skipped)
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump({"meta": {"skipped": skipped}, "results": []}, f)
    return 0
  device_memory = int(_MEMORY.value * 2**30)
  reserve = int(device_memory * _RESERVE.value)
  meta = {"commit": peer.git_head(), "versions": versions,
          "device_memory": device_memory, "reserve": reserve,
          "local_world_size": _LOCAL.value, "argv": sys.argv,
          "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  print(f"# torch {versions['torch']}, torchrec {versions['torchrec']}; "
        f"{_MEMORY.value:g} GiB per rank, {_RESERVE.value:g} of it reserved "
        f"(budget {(device_memory - reserve) / 1e9:.1f} GB); TorchRec: "
        f"compute_device cuda, {_LOCAL.value} ranks per host", flush=True)
  results = []
  for name, ranks in cases:
    tables, batch = sets.table_set(name, _MIX_TABLES.value, _MIX_SEED.value)
    ids = sum(sum(t["ids_per_example"]) for t in tables)
    print(f"# set {name}, {ranks} ranks: {len(tables)} tables, "
          f"{sum(t['rows'] for t in tables):,} rows, {batch} examples per "
          f"rank x {ids:g} ids each", flush=True)
    ours = sets.run_ours(tables, ranks, batch, device_memory, reserve)
    record = {"set": name, "ranks": ranks, "planner": "pe.plan",
              "batch_per_rank": batch, "ids_per_example": ids, **ours}
    if "placements" in ours:
      record["summary"] = _kinds(collections.Counter(
          p for p, _ in ours["placements"].values()))
      record["score"] = sets.score(tables, ours["placements"], ranks, batch,
                                   _HEADROOM.value)
    results.append(record)
    theirs = run_torchrec(_PYTHON.value, tables, ranks, batch, device_memory)
    pieces, where, notes = sets.translate(tables, theirs["tables"], ranks)
    kinds = collections.Counter(sets.SHORT.get(p["sharding_type"],
                                          p["sharding_type"])
                                for p in theirs["tables"].values())
    results.append({
        "set": name, "ranks": ranks, "planner": "TorchRec",
        "batch_per_rank": batch, "ids_per_example": ids,
        "summary": _kinds(kinds), "translation_notes": notes,
        "torchrec_plan": theirs["tables"],
        "torchrec_hbm_estimate_max": max(theirs["hbm_estimate_per_rank"]),
        "plan_seconds": theirs["plan_seconds"],
        "translated": {n: list(w) for n, w in where.items()},
        "score": sets.score(pieces, where, ranks, batch, _HEADROOM.value)})
    for note in notes[:4] + ([f"... {len(notes) - 4} more"]
                             if len(notes) > 4 else []):
      print(f"#   TorchRec {note}")
  table = format_table(results, device_memory - reserve)
  print(table)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"meta": meta, "results": results, "table": table}, f,
                indent=1, default=str)
  return 0


if __name__ == "__main__":
  app.run(main)
