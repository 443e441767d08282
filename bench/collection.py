"""The collection's step vs one exchange per table, on a Criteo-like model.

    python -m bench.collection                      # 8 simulated CPU devices
    python -m bench.collection --batch_size=8192 --repeats=10

26 one-id features over 26 tables (13 of `--big_rows` rows, 13 of 10-1,000
rows, width 64, row-wise Adagrad), as DLRM reads Criteo. Two ways to run the
same sparse step (lookup -> gradient of a small dense loss -> dedup ->
fused update), each jitted with its state donated, timed interleaved in one
process:

  collection  one `pe.EmbeddingCollection`: all 26 tables share (width,
              dtype, optimizer), so they form one stack: one id all-gather,
              one gather, one all-to-all each way, one dedup and one update;
  per_table   26 one-table collections, i.e. one exchange per table (how
              the Trainer ran a model before the collection).

Prints the median step times, their ratio and the collectives of each
compiled step (count per kind); `--json_out` writes them.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app
from absl import flags

_DEVICES = flags.DEFINE_integer("num_devices", 8, "Simulated CPU devices.")
_BATCH = flags.DEFINE_integer("batch_size", 4096, "Examples per step.")
_BIG_ROWS = flags.DEFINE_integer("big_rows", 1_000_000,
                                 "Rows of each of the 13 big tables.")
_WIDTH = flags.DEFINE_integer("emb_width", 64, "Width of every table.")
_REPEATS = flags.DEFINE_integer("repeats", 8, "Timed rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed rounds first.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

SMALL_ROWS = (10, 20, 35, 50, 80, 100, 150, 200, 300, 400, 600, 800, 1000)


def _specs(pe, big_rows, width):
  opt = pe.RowwiseAdagrad(0.01)
  rows = [big_rows] * 13 + list(SMALL_ROWS)
  tables = [pe.TableSpec(f"t{i}", r, width, optimizer=opt)
            for i, r in enumerate(rows)]
  features = [pe.FeatureSpec(f"f{i}", f"t{i}") for i in range(len(rows))]
  return tables, features


def _step_fn(jax, jnp, colls):
  """One sparse step over every collection in `colls` (their states)."""

  def step(states, batch):
    new_states, norms = [], []
    for coll, state in zip(colls, states):
      ids = {f: batch[f] for f in coll.features}
      emb, routing = coll.lookup_and_route(state, ids)
      grads = jax.grad(lambda e: sum(jnp.mean(jnp.square(v))
                                     for v in e.values()))(emb)
      state, stats = coll.apply_gradients(state, routing, grads)
      new_states.append(state)
      norms.extend(s.norm for s in stats.values())
    return new_states, jnp.stack(norms)

  return jax.jit(step, donate_argnums=0)


def main(argv):
  del argv
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count="
                             f"{_DEVICES.value}").strip()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb import datasets  # pylint: disable=g-import-not-at-top
  from pallas_emb.testing import hlo  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((_DEVICES.value,), ("x",))
  tables, features = _specs(pe, _BIG_ROWS.value, _WIDTH.value)
  together = pe.EmbeddingCollection(tables, features, mesh, "x")
  apart = [pe.EmbeddingCollection([t], [f], mesh, "x")
           for t, f in zip(tables, features)]
  print(together.plan)
  rng = np.random.default_rng(0)
  rounds = 4  # batches cycled through; one Zipf draw per feature
  ids = {f.name: datasets.zipf_ids(rng, t.vocab_rows - 1,
                                   rounds * _BATCH.value, 1.05).reshape(
                                       rounds, -1)
         for f, t in zip(features, tables)}
  batches = [jax.device_put({k: v[i] for k, v in ids.items()},
                            together.token_sharding()) for i in range(rounds)]

  runs, collectives = {}, {}
  for name, colls in (("collection", [together]), ("per_table", apart)):
    states = [c.init(jax.random.key(0)) for c in colls]
    fn = _step_fn(jax, jnp, colls)
    compiled = fn.lower(states, batches[0]).compile().as_text()
    collectives[name] = {
        kind: entry["count"] for kind, entry in hlo.collective_bytes(
            compiled, _DEVICES.value).items()}
    runs[name] = [fn, states, []]
  for round_ in range(_WARMUP.value + _REPEATS.value):
    for name, run in runs.items():
      fn, states, times = run
      batch = batches[round_ % len(batches)]
      t0 = time.perf_counter()
      states, norms = fn(states, batch)
      jax.block_until_ready(norms)
      run[1] = states
      if round_ >= _WARMUP.value:
        times.append(time.perf_counter() - t0)
  medians = {name: statistics.median(run[2]) for name, run in runs.items()}
  result = {
      "devices": _DEVICES.value, "batch_size": _BATCH.value,
      "features": len(features), "stacks": len(together.plan.stacks),
      "big_rows": _BIG_ROWS.value, "emb_width": _WIDTH.value,
      "median_ms": {k: 1e3 * v for k, v in medians.items()},
      "all_ms": {k: [1e3 * t for t in run[2]] for k, run in runs.items()},
      "speedup": medians["per_table"] / medians["collection"],
      "collectives_per_step": collectives,
      "loadavg": os.getloadavg()}
  print(f"collection (1 stack): {1e3 * medians['collection']:.1f} ms   "
        f"per_table (26 exchanges): {1e3 * medians['per_table']:.1f} ms   "
        f"speed-up {result['speedup']:.2f}x\ncollectives per step: "
        f"{collectives}")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
