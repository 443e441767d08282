"""Column vs row placement at a fixed per-rank batch (weak scaling).

    python -m bench.placements                        # 1M x 64, 2,048 ids/rank
    python -m bench.placements --ranks=1,2,4 --rows=100000 --repeats=5

One table (`--rows` x `--emb_width`, f32, row-wise Adagrad), one sequence
feature of `--ids_per_rank` Zipf ids per rank, W = 1, 2, 4, 8 simulated
ranks. The sparse step (lookup -> gradient of a small loss -> dedup -> fused
update, jitted, state donated) under three placements:

  column     every rank all-gathers the W x E ids and sorts them all;
  row        rows mod W, the default bucket capacity C = E (never overflows:
             each owner receives W x E ids, column's work);
  row_fit    row with C fitted to two sample batches
             (`fit_max_ids_per_partition`, headroom 1.25).

Per case: the median step time, the process CPU time per step (simulated
ranks share this machine's cores, so CPU time / W is the per-rank work),
the keys each rank sorts, the bytes each rank sends per step (read from the
compiled HLO), and the overflowed rows of a batch the fit did not see.
`--criteo` also times the 26-table Criteo-like collection (13 big tables, 13
of 10-1,000 rows) with every table column-sharded vs the 13 small ones
replicated. `--json_out` writes everything.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app
from absl import flags

_RANKS = flags.DEFINE_list("ranks", ["1", "2", "4", "8"], "Rank counts.")
_ROWS = flags.DEFINE_integer("rows", 1_000_000, "Rows of the table.")
_WIDTH = flags.DEFINE_integer("emb_width", 64, "Width of the table.")
_IDS = flags.DEFINE_integer("ids_per_rank", 2048, "Ids per rank and step.")
_ZIPF = flags.DEFINE_float("zipf", 1.05, "Zipf exponent of the ids.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed rounds first.")
_CRITEO = flags.DEFINE_bool("criteo", False,
                            "Also the Criteo-like collection at the most ranks.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

PLACEMENTS = ("column", "row", "row_fit")
# The small tables of bench/collection.py's Criteo-like model.
SMALL_ROWS = (10, 20, 35, 50, 80, 100, 150, 200, 300, 400, 600, 800, 1000)


def _step(jax, jnp, coll):
  def step(state, batch):
    emb, routing = coll.lookup_and_route(state, batch)
    grads = jax.grad(lambda e: sum(jnp.mean(jnp.square(v))
                                   for v in e.values()))(emb)
    return coll.apply_gradients(state, routing, grads)
  return jax.jit(step, donate_argnums=0)


def _time(jax, cases, batch_of, repeats, warmup):
  """Median wall and mean CPU seconds per step of each case, interleaved."""
  wall = {name: [] for name in cases}
  cpu = {name: 0.0 for name in cases}
  for i in range(warmup + repeats):
    for name, case in cases.items():
      batch = batch_of(name, i)
      start, start_cpu = time.perf_counter(), time.process_time()
      case["state"], stats = case["step"](case["state"], batch)
      jax.block_until_ready(stats)
      if i >= warmup:
        wall[name].append(time.perf_counter() - start)
        cpu[name] += time.process_time() - start_cpu
  return ({n: statistics.median(t) for n, t in wall.items()},
          {n: c / repeats for n, c in cpu.items()})


def _wire_bytes(hlo, compiled_text, ranks):
  return sum(v["wire_bytes"]
             for v in hlo.collective_bytes(compiled_text, ranks).values())


def main(argv):
  del argv
  ranks_list = [int(r) for r in _RANKS.value]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count="
                             f"{max(ranks_list)}").strip()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb import datasets  # pylint: disable=g-import-not-at-top
  from pallas_emb.testing import hlo  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  records = []
  print(f"{_ROWS.value:,} x {_WIDTH.value} f32 table, {_IDS.value:,} "
        f"Zipf({_ZIPF.value}) ids per rank, {jax.device_count()} simulated "
        "CPU devices")
  print(f"{'W':>2} {'placement':9} {'C':>6} {'step ms':>8} {'CPU ms':>8} "
        f"{'CPU/W ms':>8} {'sort/rank':>9} {'sent/rank':>10} {'overflow':>8}")
  for ranks in ranks_list:
    mesh = jax.make_mesh((ranks,), ("x",),
                         devices=jax.devices()[:ranks])
    batches = [{"f": datasets.zipf_ids(rng, _ROWS.value - 1,
                                       _IDS.value * ranks, _ZIPF.value)}
               for _ in range(8)]
    cases = {}
    for name in PLACEMENTS:
      spec = pe.TableSpec("t", _ROWS.value, _WIDTH.value,
                          optimizer=pe.RowwiseAdagrad(0.01),
                          placement=name.split("_")[0])
      coll = pe.EmbeddingCollection([spec], [pe.FeatureSpec("f", "t")], mesh,
                                    "x", backend="xla")
      if name == "row_fit":
        coll = coll.fit_max_ids_per_partition(batches[:2], headroom=1.25)
      step = _step(jax, jnp, coll)
      state = coll.init(jax.random.key(0))
      text = step.lower(state, batches[2]).compile().as_text()
      capacity = (coll.layouts(batches[2])[0].capacity
                  if name != "column" else None)
      cases[name] = {"coll": coll, "step": step, "state": state,
                     "sent": _wire_bytes(hlo, text, ranks),
                     "capacity": capacity}
    walls, cpus = _time(jax, cases, lambda _, i: batches[2 + i % 6],
                        _REPEATS.value, _WARMUP.value)
    for name, case in cases.items():
      _, stats = case["step"](case["state"], batches[-1])
      overflow = int(sum(int(s.num_overflow) for s in stats.values()))
      sort = (ranks * _IDS.value if name == "column"
              else _IDS.value + ranks * case["capacity"])
      record = {"ranks": ranks, "placement": name,
                "capacity": case["capacity"], "step_ms": walls[name] * 1e3,
                "cpu_ms": cpus[name] * 1e3,
                "cpu_per_rank_ms": cpus[name] * 1e3 / ranks,
                "sorted_keys_per_rank": sort,
                "sent_bytes_per_rank": case["sent"], "overflow": overflow}
      records.append(record)
      print(f"{ranks:>2} {name:9} {case['capacity'] or '-':>6} "
            f"{record['step_ms']:8.2f} {record['cpu_ms']:8.2f} "
            f"{record['cpu_per_rank_ms']:8.2f} {sort:>9,} "
            f"{case['sent'] / 1024:9.0f}K {overflow:>8}", flush=True)
      del case["state"]

  if _CRITEO.value:
    records += _criteo(jax, jnp, np, pe, hlo, max(ranks_list), rng)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"records": records}, f, indent=1)


def _criteo(jax, jnp, np, pe, hlo, ranks, rng):
  """The 26-table collection, all column vs its 13 small tables replicated."""
  mesh = jax.make_mesh((ranks,), ("x",), devices=jax.devices()[:ranks])
  rows = [_ROWS.value] * 13 + list(SMALL_ROWS)
  batches = [{f"f{i}": (rng.integers(0, r, _IDS.value * ranks)
                        .astype(np.int32)) for i, r in enumerate(rows)}
             for _ in range(4)]
  cases = {}
  for name in ("all_column", "small_replicated"):
    tables = [pe.TableSpec(f"t{i}", r, _WIDTH.value,
                           optimizer=pe.RowwiseAdagrad(0.01),
                           placement=("replicated" if name ==
                                      "small_replicated" and i >= 13
                                      else "column"))
              for i, r in enumerate(rows)]
    features = [pe.FeatureSpec(f"f{i}", f"t{i}") for i in range(len(rows))]
    coll = pe.EmbeddingCollection(tables, features, mesh, "x", backend="xla")
    step = _step(jax, jnp, coll)
    state = coll.init(jax.random.key(0))
    text = step.lower(state, batches[0]).compile().as_text()
    cases[name] = {"step": step, "state": state,
                   "sent": _wire_bytes(hlo, text, ranks)}
  walls, cpus = _time(jax, cases, lambda _, i: batches[i % 4],
                      _REPEATS.value, _WARMUP.value)
  print(f"\nCriteo-like, 26 tables (13 of {_ROWS.value:,} rows, 13 of 10-1,000),"
        f" {_IDS.value:,} examples per rank, W={ranks}:")
  records = []
  for name, case in cases.items():
    record = {"ranks": ranks, "placement": f"criteo_{name}",
              "step_ms": walls[name] * 1e3, "cpu_ms": cpus[name] * 1e3,
              "sent_bytes_per_rank": case["sent"]}
    records.append(record)
    print(f"  {name:16} step {record['step_ms']:8.2f} ms  CPU "
          f"{record['cpu_ms']:8.2f} ms  sent/rank {case['sent'] / 1024:8.0f}K")
  return records


if __name__ == "__main__":
  app.run(main)
