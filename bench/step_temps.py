"""Temporary bytes and step time of bench.fbgemm_compare's pallas_emb steps.

    taskset -c 0 python -m bench.step_temps
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000 \
        taskset -c 0 python -m bench.step_temps

Per case (`workload/case`, the workloads and cases of
`bench.fbgemm_compare`) and dtype (its `--dtypes`: f32, bf16), one thread:
the compiled step's `memory_analysis().temp_size_in_bytes` (what XLA:CPU
allocates as one block per run; glibc serves a block over 32 MB from fresh
pages unless malloc keeps its memory), the median of `--steps` step times
after `--warmup` and a digest of the trained table. Prints one JSON line
per case and the `MALLOC_*` environment it ran under.
`--chunk_slots=1000000000,32768` runs each case with the update over the
whole unique buffer, then in chunks of 32768 slots up to its last used slot
(the default); `--chunk_rows=1000000000,8192` likewise makes bf16 rows f32
for the scatter-add all at once, then 8192 at a time (the default).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time

from absl import app
from absl import flags

# Its --steps, --warmup and --dtypes flags run these steps too.
from bench.fbgemm_compare import (_DTYPES, _STEPS, _WARMUP, base_case,
                                  pallas_step)

_CASES = flags.DEFINE_list(
    "cases", ["a:1000000:16384:1:pooled_map", "a:1000000:16384:1:pooled_fit_map",
              "b:1000000:16384:20:pooled_map",
              "b:1000000:16384:20:pooled_fit_map",
              "b:1000000:16384:20:pooled_fit",
              "c:10000000:65536:1:sequence_map",
              "c:10000000:65536:1:pooled_map",
              "c:10000000:65536:1:pooled_fit_map"],
    "name:rows:batch:bag:case (case as in bench.fbgemm_compare).")
_CHUNK_SLOTS = flags.DEFINE_list(
    "chunk_slots", [],
    "Run each case once per value of the xla backend's CHUNK_SLOTS (slots "
    "per iteration of its loops over the unique buffer's used slots), in "
    "this order; default: once, as the library sets it.")
_CHUNK_ROWS = flags.DEFINE_list(
    "chunk_rows", [],
    "The same for its CHUNK_ROWS (rows per scatter-add when bf16 or "
    "weighted rows are made f32), for each --chunk_slots value.")


def run_case(spec: str, dtype: str, jax, jnp, np, pe) -> dict:
  # pylint: disable=g-import-not-at-top
  from pallas_emb.datasets import zipf_ids
  name, rows, batch, bag, kind = spec.split(":")
  rows, batch, bag = int(rows), int(batch), int(bag)
  width = 64
  rng = np.random.default_rng(0)
  table_spec = pe.TableSpec("t", rows, width, dtype=jnp.dtype(dtype),
                            optimizer=pe.RowwiseAdagrad(0.01, eps=1e-8))
  sequence = base_case(kind) == "sequence"
  coll = pe.EmbeddingCollection(
      [table_spec], [pe.FeatureSpec("f", "t",
                                    combiner=None if sequence else "sum")],
      jax.make_mesh((1,), ("x",)), "x", backend="xla",
      dedup="slot_map" if kind.endswith("_map") else "sort")
  table = (jax.random.normal(jax.random.key(0), (rows, width))
           * width**-0.5).astype(dtype)
  state = coll.state_from_arrays({"t": table})
  del table
  ids = zipf_ids(rng, rows - 1, batch * bag, 1.05).astype(np.int32)
  ids = jax.device_put(ids.reshape(batch) if sequence else
                       ids.reshape(batch, bag))
  if base_case(kind, fit=False).endswith("_fit"):
    coll = coll.fit_max_unique([{"f": ids}], headroom=1.25)
  cotangent = jax.device_put(
      rng.standard_normal((batch, width), np.float32))
  compiled = pallas_step(coll, jax, jnp).lower(state, ids,
                                                    cotangent).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  times = []
  for i in range(_WARMUP.value + _STEPS.value):
    t0 = time.perf_counter()
    state, loss = compiled(state, ids, cotangent)
    jax.block_until_ready(loss)
    if i >= _WARMUP.value:
      times.append(time.perf_counter() - t0)
  table = np.asarray(jax.device_get(coll.table_arrays(state)["t"]))
  return {"case": f"{name}/{kind}", "dtype": dtype, "temp_mb": temp / 2**20,
          "median_ms": 1e3 * float(np.median(times)),
          "min_ms": 1e3 * min(times),
          # The same digest: the same trained bits.
          "table_sha256": hashlib.sha256(table.tobytes()).hexdigest()[:16]}


def main(argv):
  del argv
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = " ".join(
      os.environ.get("XLA_FLAGS", "").split()
      + ["--xla_cpu_multi_thread_eigen=false"])
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  import pallas_emb as pe
  from pallas_emb.kernels import xla  # pylint: disable=g-import-not-at-top
  malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
  chunks = [int(c) for c in _CHUNK_SLOTS.value] or [xla.CHUNK_SLOTS]
  chunk_rows = [int(c) for c in _CHUNK_ROWS.value] or [xla.CHUNK_ROWS]
  for spec in _CASES.value:
    for dtype in _DTYPES.value:
      for chunk, rows in itertools.product(chunks, chunk_rows):
        xla.CHUNK_SLOTS, xla.CHUNK_ROWS = chunk, rows
        jax.clear_caches()  # The layouts' jitted functions trace afresh.
        print(json.dumps({**run_case(spec, dtype, jax, jnp, np, pe),
                          "chunk_slots": chunk, "chunk_rows": rows,
                          "malloc_env": malloc}), flush=True)


if __name__ == "__main__":
  app.run(main)
