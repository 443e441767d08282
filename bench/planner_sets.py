"""The table sets of `bench/planner_compare.py` and TorchRec's plans in our
placements, scored by pe.plan's model (see that program's doc).

No flags and no torch here: the tests import it.
"""

from __future__ import annotations

import dataclasses
import math
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe

SETS = ("a", "b", "c", "t")
# MLPerf DLRM's Criteo-1TB vocabularies (TorchRec's dlrm example defaults).
CRITEO_1TB_ROWS = (
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261,
    1572176, 345138, 10, 2209, 11267, 128, 4, 974, 14, 48937457, 11316796,
    40094537, 452104, 12606, 104, 35)
CRITEO_CAP = 40_000_000
# TorchRec sharding type -> our placement where one is exact.
EXACT = {"data_parallel": "replicated", "table_wise": "table",
         "row_wise": "row", "column_wise": "column",
         "table_column_wise": "column"}
SHORT = {"data_parallel": "DP", "table_wise": "TW", "row_wise": "RW",
         "column_wise": "CW", "table_column_wise": "TWCW",
         "table_row_wise": "TWRW", "grid_shard": "GS"}


def _table(name, rows, width, dtype, ids, pooled):
  return {"name": name, "rows": int(rows), "width": int(width),
          "dtype": dtype, "features": [name], "ids_per_example": [ids],
          "pooled": pooled}


def table_set(name: str, mix_tables: int = 100, mix_seed: int = 0
              ) -> tuple[list[dict], int]:
  """(tables, examples per rank) of set `name`."""
  if name == "a":
    return [_table(f"cat{i}", min(r, CRITEO_CAP), 128, "float32", 1, True)
            for i, r in enumerate(CRITEO_1TB_ROWS)], 8192
  if name == "b":
    # (Singular names: TorchRec's ModuleDict has an attribute "items".)
    rows = {"user": 100e6, "item": 100e6, "author": 30e6, "ip": 10e6}
    ids = {"user": 2, "item": 600, "author": 600, "ip": 2}
    return [_table(n, r, 1024, "bfloat16", ids[n], False)
            for n, r in rows.items()], 64
  if name == "c":
    rng = np.random.default_rng(mix_seed)
    rows = np.exp(rng.uniform(math.log(10), math.log(50e6), mix_tables))
    widths = 2 ** rng.integers(4, 9, mix_tables)
    ids = rng.integers(1, 21, mix_tables)
    return [_table(f"m{i}", round(r), w, "float32", int(k), True)
            for i, (r, w, k) in enumerate(zip(rows, widths, ids))], 4096
  if name == "t":
    spec = ((50_000, 32, 1), (20_000, 16, 4), (5_000, 32, 2), (100, 16, 1),
            (10, 8, 1), (200_000, 64, 1))
    return [_table(f"s{i}", r, w, "float32", k, True)
            for i, (r, w, k) in enumerate(spec)], 256
  raise ValueError(f"table set {name!r}; expected one of {SETS}.")


def specs(tables: list[dict], placements=None):
  """Our TableSpecs / FeatureSpecs / stats of `tables` (placements: name ->
  (placement, rank), default column)."""
  opt = pe.RowwiseAdagrad(0.01)
  out_t, out_f, stats = [], [], {}
  for t in tables:
    placement, rank = (placements or {}).get(t["name"], ("column", None))
    out_t.append(pe.TableSpec(
        t["name"], t["rows"], t["width"], optimizer=opt,
        dtype=jnp.dtype(t["dtype"]), placement=placement, rank=rank))
    for f, k in zip(t["features"], t["ids_per_example"]):
      out_f.append(pe.FeatureSpec(f, t["name"],
                                  combiner="sum" if t["pooled"] else None))
      stats[f] = pe.FeatureStats(float(k))
  return out_t, out_f, stats


def translate(tables: list[dict], plan: dict, ranks: int
              ) -> tuple[list[dict], dict, list[str]]:
  """TorchRec's plan as our tables: (tables, name -> (placement, rank),
  notes). A table whose shards have no placement of ours becomes one
  table-placed table per shard (see the module doc)."""
  out, where, notes = [], {}, []
  for t in tables:
    p = plan[t["name"]]
    kind, shards = p["sharding_type"], p["shards"]
    on = sorted(s[4] for s in shards)
    exact = EXACT.get(kind)
    if exact in ("row", "column") and on != list(range(ranks)):
      exact = None  # not one equal shard on every rank
    if exact == "column" and {s[3] for s in shards} != {t["width"] // ranks}:
      exact = None
    if exact:
      out.append(t)
      rank = p["ranks"][0] if exact == "table" else None
      where[t["name"]] = (exact, rank)
      continue
    row_split = any(s[2] != t["rows"] for s in shards)
    col_split = any(s[3] != t["width"] for s in shards)
    sliced = " x ".join(["row"] * row_split + ["column"] * col_split)
    notes.append(f"{t['name']}: {SHORT.get(kind, kind)} in {len(shards)} "
                 f"shards -> table-placed {sliced} slices"
                 + (" (~)" if row_split else ""))
    for row0, col0, rows, cols, rank in shards:
      if not rows * cols:
        continue  # TorchRec gives empty shards to spare ranks
      name = f"{t['name']}@r{row0}c{col0}"
      share = rows / t["rows"]  # a row slice reads its share of the ids
      out.append({**t, "name": name, "rows": rows, "width": cols,
                  "features": [f"{f}@r{row0}c{col0}" for f in t["features"]],
                  "ids_per_example": [k * share
                                      for k in t["ids_per_example"]]})
      where[name] = ("table", rank)
  return out, where, notes


def score(tables: list[dict], placements: dict, ranks: int,
          batch_size: int, fit_headroom: float = 1.25) -> dict:
  """Our model's cost of these placements (pe.plan_cost); `sent_fitted`:
  the bytes sent once every row table's bucket is fit to uniform ids
  (`max_ids_per_partition` = headroom x its ids per rank / W, what
  `coll.fit_max_ids_per_partition` finds for well-spread ids)."""
  t, f, stats = specs(tables, placements)
  cost = pe.plan_cost(t, f, ranks, batch_size=batch_size, stats=stats)
  ids = {d["name"]: batch_size * sum(d["ids_per_example"]) for d in tables}
  fitted = [dataclasses.replace(s, max_ids_per_partition=math.ceil(
      fit_headroom * ids[s.name] / ranks)) if s.placement == "row" else s
            for s in t]
  sent_fitted = pe.plan_cost(fitted, f, ranks, batch_size=batch_size,
                             stats=stats).sent_per_rank
  shards = cost.shard_bytes_per_rank
  return {"memory_per_rank": cost.memory_per_rank,
          "shard_bytes_max": max(shards),
          "shard_bytes_mean": sum(shards) / len(shards),
          "sent_per_rank": cost.sent_per_rank, "sent_fitted": sent_fitted,
          "addressable": cost.addressable}


def run_ours(tables: list[dict], ranks: int, batch_size: int,
             device_memory: int, reserve: int) -> dict:
  """pe.plan on an AbstractMesh: its placements, time and allocations."""
  t, f, stats = specs(tables)
  mesh = jax.sharding.AbstractMesh((ranks,), ("x",))
  live = len(jax.live_arrays())
  tracemalloc.start()
  start = time.perf_counter()
  try:
    planned, _ = pe.plan(t, f, mesh, table_axis="x", batch_size=batch_size,
                         device_memory=device_memory, reserve=reserve,
                         stats=stats)
  except pe.PlanInfeasibleError as e:
    tracemalloc.stop()
    return {"infeasible": str(e)}
  seconds = time.perf_counter() - start
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return {"placements": {s.name: (s.placement, s.rank) for s in planned},
          "plan_seconds": seconds, "heap_peak_bytes": peak,
          "new_jax_arrays": len(jax.live_arrays()) - live}
