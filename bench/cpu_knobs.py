"""What each of the xla backend's CPU choices buys: one step, A/B in one process.

    taskset -c 0 python -m bench.cpu_knobs
    taskset -c 0 python -m bench.cpu_knobs --workload=c:10000000:65536:1 \
        --dtype=bfloat16 --variants=default,uint16_gather

The default collection's step (`bench.fbgemm_compare`'s `default` case:
one table, row-wise Adagrad, Zipf ids, forward + backward + update) is
compiled once per variant, each variant undoing one choice of the library
while it is traced:

- `default`: the library as it is.
- `whole_buffer`: the update runs over the whole unique buffer (a slot per
  id), not at the smallest size that holds the batch's rows
  (`stack.slot_tiers`).
- `uint16_gather`: the update gathers a bf16 table's rows as uint16, not
  as uint32 words (`kernels.common.take_rows`).

The variants' steps then run in `--rounds` interleaved rounds of `--steps`
timed steps (after 2 untimed) on one thread, so that a noisy machine slows
them alike. Prints each variant's median step time, its ratio to the first
variant's, and a digest of its trained table: the variants train the same
bits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from unittest import mock

from absl import app
from absl import flags

_WORKLOAD = flags.DEFINE_string(
    "workload", "b:1000000:16384:20", "name:rows:batch:bag, as in "
    "bench.fbgemm_compare.")
_FEATURE = flags.DEFINE_enum("feature", "pooled", ["pooled", "sequence"],
                             "A pooled (sum) or a sequence feature.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Table dtype.")
_VARIANTS = flags.DEFINE_list(
    "variants", ["default", "whole_buffer", "uint16_gather"],
    "Variants to compare, the first the baseline.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps per variant a round.")
_MIN_TIER_SLOTS = flags.DEFINE_integer(
    "min_tier_slots", None, "The library's stack.MIN_TIER_SLOTS (the "
    "smallest size the update runs at) for every variant; default: its own.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results "
                                "here as JSON.")


def variant(name: str):
  """A context in which the library is traced with one choice undone."""
  # pylint: disable=g-import-not-at-top
  from pallas_emb import stack
  from pallas_emb.kernels import common
  if name == "default":
    return contextlib.nullcontext()
  if name == "whole_buffer":
    return mock.patch.object(stack, "MIN_TIER_SLOTS", 2**62)
  if name == "uint16_gather":
    return mock.patch.object(common, "take_rows", lambda table, rows:
                             table[rows])
  raise app.UsageError(f"unknown variant {name!r}; expected default, "
                       "whole_buffer or uint16_gather.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  os.environ["XLA_FLAGS"] = " ".join(
      os.environ.get("XLA_FLAGS", "").split()
      + ["--xla_cpu_multi_thread_eigen=false"])
  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # Before JAX starts (pallas_emb.cpu_malloc).
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_emb.datasets import zipf_ids

  name, rows, batch, bag = _WORKLOAD.value.split(":")
  rows, batch, bag = int(float(rows)), int(batch), int(bag)
  width, sequence = 64, _FEATURE.value == "sequence"
  rng = np.random.default_rng(0)
  ids = jnp.asarray(zipf_ids(rng, rows - 1, batch * bag, 1.05).reshape(
      batch, bag))
  cotangent = jnp.asarray(rng.standard_normal(
      (batch, bag, width) if sequence else (batch, width)), jnp.float32)
  coll = pe.EmbeddingCollection(
      [pe.TableSpec("t", rows, width, dtype=_DTYPE.value,
                    optimizer=pe.RowwiseAdagrad(0.01))],
      [pe.FeatureSpec("f", "t", combiner=None if sequence else "sum")],
      jax.make_mesh((1,), ("x",)), "x")

  def step(state, ids, cotangent):
    emb, routing = coll.lookup_and_route(state, {"f": ids})
    loss, grads = jax.value_and_grad(lambda e: jnp.sum(
        e["f"].astype(jnp.float32) * cotangent))(emb)
    state, _ = coll.apply_gradients(state, routing, grads)
    return state, loss

  from pallas_emb import stack
  if _MIN_TIER_SLOTS.value:
    stack.MIN_TIER_SLOTS = _MIN_TIER_SLOTS.value
  compiled = {}
  for v in _VARIANTS.value:
    jax.clear_caches()
    with variant(v):
      state = coll.init(jax.random.key(0))
      compiled[v] = [jax.jit(step, donate_argnums=0).lower(
          state, ids, cotangent).compile(), state]
  times = {v: [] for v in compiled}
  for _ in range(_ROUNDS.value):
    for v, entry in compiled.items():
      fn, state = entry
      for i in range(2 + _STEPS.value):
        start = time.perf_counter()
        state, loss = fn(state, ids, cotangent)
        loss.block_until_ready()
        if i >= 2:
          times[v].append(time.perf_counter() - start)
      entry[1] = state
  print(f"# {name}: {rows} rows x {width} {_DTYPE.value}, {batch} x {bag} "
        f"{_FEATURE.value} ids, {_ROUNDS.value} rounds of {_STEPS.value} "
        "steps")
  base, results = None, []
  for v, (_, state) in compiled.items():
    ms = 1e3 * float(np.median(times[v]))
    base = base or ms
    table = np.asarray(coll.table_arrays(state)["t"].astype(jnp.float32))
    digest = hashlib.sha256(table.tobytes()).hexdigest()[:12]
    print(f"{v:>14s}  {ms:8.2f} ms  {ms / base:6.3f}x  table {digest}")
    results.append({"variant": v, "median_ms": ms, "ratio": ms / base,
                    "table_digest": digest})
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"workload": _WORKLOAD.value, "feature": _FEATURE.value,
                 "dtype": _DTYPE.value, "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
