"""The dedup with a sort vs the dedup through a slot map, on one CPU core.

    taskset -c 0 python -m bench.dedup                 # 1M rows, 16k/64k/320k
    taskset -c 0 python -m bench.dedup --tokens=16384 --repeats=5

`taskset -c 0` pins the process (XLA:CPU's threads too) to one core, and
XLA_FLAGS gets `--xla_cpu_multi_thread_eigen=false` (`--single_thread`):
one thread on one core, as `bench.fbgemm_compare` measures. The cores the
process may run on are printed and recorded.

Per batch size (`--tokens` Zipf(`--zipf`) ids over `--rows` rows, the
unique buffer as large as the batch or `--unique_fit` times the batches'
distinct rows, so nothing overflows), in one process:

  sort        `dedup.unique_and_segments(on_cpu=True)` (`dedup="sort"`)
  map         `dedup.unique_by_slot_map`, the map donated (first-occurrence
              order)
  map_sorted  the same with `sort_unique=True` (sorted unique rows: the
              sort's results exactly; it sorts the unique buffer, so it
              pays only where that buffer is much smaller than the batch)

Each is jitted and checked against the others once (the same unique rows,
each key mapped to its row); then `--repeats` rounds, the three interleaved
round by round over `--num_batches` batches, each call timed to completion;
the median and the speed-up of each over `sort` are printed. With
`--update_width` > 0 it also times the row update's memory locality: a
donated f32 `[rows, width]` table's `at[unique].add` with the unique rows
sorted vs in first-occurrence order (the same rows). `--json_out` writes
everything.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import statistics
import time

from absl import app
from absl import flags

_ROWS = flags.DEFINE_integer("rows", 1_000_000, "Rows of the table.")
_TOKENS = flags.DEFINE_list("tokens", ["16384", "65536", "327680"],
                            "Keys per batch (one case each).")
_ZIPF = flags.DEFINE_float("zipf", 1.05, "Zipf exponent of the ids.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed rounds first.")
_BATCHES = flags.DEFINE_integer("num_batches", 4,
                                "Distinct batches, cycled over the rounds.")
_WIDTH = flags.DEFINE_integer("update_width", 64,
                              "Width of the locality check's table (0: off).")
_SINGLE = flags.DEFINE_bool("single_thread", True,
                            "XLA:CPU ops on one thread (set before JAX "
                            "starts).")
_FIT = flags.DEFINE_float(
    "unique_fit", 0.0, "0: a unique buffer as large as the batch; else "
    "this times the most distinct rows of the batches (as fit_max_unique).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

METHODS = ("sort", "map", "map_sorted")


def _rounds(fns, args_of, repeats, warmup, num_batches):
  """Median seconds per fn: the fns interleaved round by round."""
  times = {name: [] for name in fns}
  for r in range(warmup + repeats):
    for name, fn in fns.items():
      args = args_of(name, r % num_batches)
      start = time.perf_counter()
      fn(*args)
      if r >= warmup:
        times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv):
  del argv
  if _SINGLE.value:
    os.environ["XLA_FLAGS"] = " ".join(
        os.environ.get("XLA_FLAGS", "").split()
        + ["--xla_cpu_multi_thread_eigen=false"])
  cores = sorted(os.sched_getaffinity(0))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_emb import datasets  # pylint: disable=g-import-not-at-top
  # `pallas_emb.dedup` names the public function; this is the module.
  dedup = importlib.import_module("pallas_emb.dedup")

  rows = _ROWS.value
  rng = np.random.default_rng(0)
  records = []
  slot_map = [dedup.empty_slot_map(rows)]  # donated: replaced by each call
  print(f"rows={rows}  zipf={_ZIPF.value}  slot map {4 * rows / 2**20:.1f} "
        f"MiB  {jax.devices()[0].platform} cores {cores}  XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '')!r}  medians of {_REPEATS.value}")
  print(f"{'tokens':>8} {'distinct':>9} {'buffer':>8} " + " ".join(
      f"{m + ' ms':>14}" for m in METHODS) + "   speed-up map / map_sorted")
  for tokens in map(int, _TOKENS.value):
    batches = [jnp.asarray(
        datasets.zipf_ids(rng, rows, tokens, _ZIPF.value) - 1)
               for _ in range(_BATCHES.value)]
    num_unique = tokens
    if _FIT.value:
      num_unique = min(tokens, int(np.ceil(_FIT.value * max(
          np.unique(np.asarray(b)).size for b in batches))))
    sort = jax.jit(functools.partial(dedup.unique_and_segments,
                                     num_unique=num_unique, on_cpu=True))
    jitted = {m: jax.jit(functools.partial(
        dedup.unique_by_slot_map, num_unique=num_unique,
        sort_unique=m == "map_sorted"), donate_argnames="slot_map")
              for m in METHODS[1:]}

    def run_map(method, keys):
      *out, slot_map[0] = jitted[method](keys, slot_map=slot_map[0])
      return jax.block_until_ready(out)

    fns = {"sort": lambda k: jax.block_until_ready(sort(k)),
           "map": functools.partial(run_map, "map"),
           "map_sorted": functools.partial(run_map, "map_sorted")}
    outs = {m: fns[m](batches[0]) for m in METHODS}
    keys = np.asarray(batches[0])
    for m, (unique, segs, distinct, overflow) in outs.items():
      unique, segs = np.asarray(unique), np.asarray(segs)
      if not (int(overflow) == 0 and np.array_equal(unique[segs], keys)
              and np.array_equal(np.sort(unique), outs["sort"][0])):
        raise AssertionError(f"bench.dedup: {m} disagrees with sort at "
                             f"{tokens} tokens.")
    for a, b in zip(outs["map_sorted"], outs["sort"]):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(slot_map[0], dedup.MAP_SENTINEL)
    temp = {"sort": sort.lower(batches[0]).compile()}
    temp.update({m: jitted[m].lower(batches[0], slot_map=slot_map[0])
                 .compile() for m in METHODS[1:]})
    temp = {m: c.memory_analysis().temp_size_in_bytes
            for m, c in temp.items()}
    medians = _rounds(fns, lambda m, b: (batches[b],), _REPEATS.value,
                      _WARMUP.value, _BATCHES.value)
    distinct = int(outs["sort"][2])
    print(f"{tokens:>8} {distinct:>9} {num_unique:>8} " + " ".join(
        f"{1e3 * medians[m]:>14.2f}" for m in METHODS) +
          f"   {medians['sort'] / medians['map']:.2f}x / "
          f"{medians['sort'] / medians['map_sorted']:.2f}x")
    record = {"tokens": tokens, "rows": rows, "distinct": distinct,
              "num_unique": num_unique,
              "median_s": medians, "temp_bytes": temp,
              "slot_map_bytes": 4 * rows, "cores": cores,
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if _WIDTH.value:
      record["update_median_s"] = _locality(
          jax, jnp, rows, _WIDTH.value, outs["sort"][0],
          outs["map"][0], _REPEATS.value, _WARMUP.value)
      u = record["update_median_s"]
      print(f"{'':>8} row update [{rows}, {_WIDTH.value}] f32 at.add of "
            f"{distinct} rows: sorted {1e3 * u['sorted']:.2f} ms, "
            f"first-occurrence {1e3 * u['first_occurrence']:.2f} ms")
    print(f"{'':>8} temp bytes: " + ", ".join(
        f"{m} {temp[m]}" for m in METHODS))
    records.append(record)
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump(records, f, indent=1)


def _locality(jax, jnp, rows, width, sorted_unique, first_unique, repeats,
              warmup):
  """Median seconds of a donated table's `at[unique].add` per order."""
  table = [jnp.zeros((rows, width), jnp.float32)]
  grads = jnp.ones((sorted_unique.shape[0], width), jnp.float32)
  add = jax.jit(lambda t, u, g: t.at[u].add(g, mode="drop"),
                donate_argnums=0)

  def run(unique):
    table[0] = jax.block_until_ready(add(table[0], unique, grads))

  fns = {"sorted": run, "first_occurrence": run}
  uniques = {"sorted": sorted_unique, "first_occurrence": first_unique}
  return _rounds(fns, lambda m, _: (uniques[m],), repeats, warmup, 1)


if __name__ == "__main__":
  app.run(main)
