"""The host tier's cache directory alone: `RowCache.admit` per batch.

    python -m bench.row_cache                          # 50M rows, 8M slots
    python -m bench.row_cache --baseline=OLD.py        # beside another one
    python -m bench.row_cache --rows=100000 --slots=16384 --ids=4096 \\
        --batches=40                                   # quickly

Zipf(`--zipf`) batches of `--ids` ids over `--rows` rows (their distinct
rows and counts, as a prefetch hands them over), admitted one after the
other into a directory of `--slots` slots, the rows of the two batches
before each pinned (the pipelined Trainer's). Prints the median time of
an admission that evicts (a group, `row_cache.EVICT_FRACTION`) and of one
that does not, after the cache first fills, and the hit rates since the
first eviction (the cache full: a steady state). `--baseline` loads another
`row_cache.py` (say `git show COMMIT:pallas_emb/row_cache.py > OLD.py`)
and runs it on the same batches in the same process. docs/host_tier.md
quotes it.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time

from absl import app
from absl import flags
import numpy as np

from pallas_emb import row_cache
from pallas_emb.datasets import zipf_ids

_ROWS = flags.DEFINE_integer("rows", 50_000_000, "Rows of the table.")
_SLOTS = flags.DEFINE_integer("slots", 8 * 2**20, "Slots of the cache.")
_IDS = flags.DEFINE_integer("ids", 327_680, "Ids per batch (16,384 bags "
                            "of 20 by default).")
_BATCHES = flags.DEFINE_integer("batches", 120, "Batches admitted.")
_ZIPF = flags.DEFINE_float("zipf", 1.05, "Zipf exponent of the ids.")
_POLICY = flags.DEFINE_enum("policy", "lru", list(row_cache.POLICIES),
                            "Eviction policy.")
_BASELINE = flags.DEFINE_string(
    "baseline", None, "Another row_cache.py to run on the same batches.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")


def _load(path: str):
  spec = importlib.util.spec_from_file_location("baseline_row_cache", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _admit_times(module, batches) -> dict:
  cache = module.RowCache(_SLOTS.value, _ROWS.value, _POLICY.value)
  pinned = [np.zeros(0, np.int32)] * 2
  evicting, other, full, every = [], [], [], []
  hits = []  # since the first eviction: (distinct rows, rows hit, ids, hit)
  for rows, counts in batches:
    start = time.perf_counter()
    got = cache.admit(rows, counts, np.ones(rows.size, bool),
                      np.concatenate(pinned))
    seconds = time.perf_counter() - start
    pinned = [pinned[1], got.slots]
    if got.evict_slots.size:
      evicting.append(seconds)
    elif cache.cached + rows.size > _SLOTS.value:  # full, or nearly
      other.append(seconds)
    every.append(seconds)
    if evicting:  # since the first eviction: every admission
      full.append(seconds)
      hits.append((rows.size, got.hit.sum(), counts.sum(),
                   counts[got.hit].sum()))
  median = lambda x: statistics.median(x) if x else float("nan")
  hit = np.sum(hits, axis=0) if hits else None
  return {"evicting_s": median(evicting), "evicting": len(evicting),
          "other_s": median(other), "other": len(other),
          "mean_s": statistics.mean(full) if full else float("nan"),
          "all_s": statistics.mean(every), "max_s": max(every),
          "cached": int(cache.cached),
          "hit_rate": float(hit[1] / hit[0]) if hits else float("nan"),
          "id_hit_rate": float(hit[3] / hit[2]) if hits else float("nan")}


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  # One draw for every batch: one set of hot rows (`zipf_ids` permutes
  # the ranks afresh per call).
  drawn = zipf_ids(rng, _ROWS.value - 1, _IDS.value * _BATCHES.value,
                   _ZIPF.value, permute=True).reshape(_BATCHES.value, -1)
  batches = []
  for ids in drawn:
    rows, counts = np.unique(ids, return_counts=True)
    batches.append((rows.astype(np.int64), counts.astype(np.int64)))
  distinct = statistics.mean(r.size for r, _ in batches)
  doc = {"rows": _ROWS.value, "slots": _SLOTS.value, "ids": _IDS.value,
         "distinct_rows": distinct, "policy": _POLICY.value, "results": {}}
  print(f"{_BATCHES.value} batches of {_IDS.value} Zipf({_ZIPF.value}) ids "
        f"({distinct:.0f} distinct rows) over {_ROWS.value} rows, "
        f"{_SLOTS.value} slots, {_POLICY.value}:")
  modules = {"row_cache": row_cache}
  if _BASELINE.value:
    modules["baseline"] = _load(_BASELINE.value)
  for name, module in modules.items():
    got = doc["results"][name] = _admit_times(module, batches)
    print(f"  {name}: {1e3 * got['evicting_s']:.1f} ms an admission that "
          f"evicts (median of {got['evicting']}), "
          f"{1e3 * got['other_s']:.1f} ms one that does not (median of "
          f"{got['other']}); since the first eviction {1e3 * got['mean_s']:.1f}"
          f" ms an admission on average; over all {len(batches)} "
          f"{1e3 * got['all_s']:.1f} ms on average, the longest "
          f"{1e3 * got['max_s']:.0f} ms; since the first eviction "
          f"{got['hit_rate']:.3f} of the distinct rows hit, "
          f"{got['id_hit_rate']:.3f} of the ids")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  app.run(main)
