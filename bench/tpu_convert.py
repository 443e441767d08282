"""A bf16 table's conversion to the stored layout and back, by each pairing.

    python -m bench.tpu_convert --rows=10000000            # on a TPU
    python -m bench.tpu_convert --rows=2000 --repeats=1    # CPU smoke

`stored.to_stored` and `stored.from_stored` of one `[--rows, --width]`
bf16 table (what `coll.init`, `table_arrays` and checkpoints run once per
table), jitted, with `stored.BF16_CONVERT` set to each of `--converts`:
the first call (compiling and running it: on a v5e XLA took 106 s to
compile "pairs" at 10M rows) and the median of `--repeats` calls after
it. Both pairings must give the same words; the program says so.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

_ROWS = flags.DEFINE_integer("rows", 10_000_000, "Table rows.")
_WIDTH = flags.DEFINE_integer("width", 64, "Table columns (bf16).")
_CONVERTS = flags.DEFINE_list("converts", ["matmul", "pairs"],
                              "`stored.BF16_CONVERT` values, in order.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls after the first.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")


def _timed(fn, x, repeats):
  """(first call s, median of the next `repeats` s, the result)."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn(x))
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - start)
  return first, statistics.median(times) if times else float("nan"), out


def main(argv):
  del argv
  from pallas_emb.kernels.mosaic_tpu import stored  # pylint: disable=g-import-not-at-top
  rows, width = _ROWS.value, _WIDTH.value
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"[{rows:,}, {width}] bf16", flush=True)
  table = jax.jit(lambda k: jax.random.normal(k, (rows, width),
                                              jnp.bfloat16))(
                                                  jax.random.key(0))
  digests, records = {}, []
  print("| pairing | to_stored first (s) | then (ms) | from_stored first (s) "
        "| then (ms) | round trip |\n|---|---|---|---|---|---|", flush=True)
  for convert in _CONVERTS.value:
    stored.BF16_CONVERT = convert  # read when the functions are traced
    # New functions each time: jit caches a trace by its function.
    first, then, words = _timed(jax.jit(lambda x: stored.to_stored(x)),  # pylint: disable=unnecessary-lambda
                                table, _REPEATS.value)
    back_first, back_then, back = _timed(
        jax.jit(lambda w: stored.from_stored(w, width, jnp.bfloat16)),
        words, _REPEATS.value)
    same = bool(jnp.array_equal(jax.lax.bitcast_convert_type(back, jnp.uint16),
                                jax.lax.bitcast_convert_type(table,
                                                             jnp.uint16)))
    digests[convert] = int(jnp.sum(words[::997].astype(jnp.uint32)
                                   % np.uint32(65521)))
    print(f"| {convert} | {first:.2f} | {then * 1e3:.2f} | {back_first:.2f} "
          f"| {back_then * 1e3:.2f} | {'bit for bit' if same else 'DIFFERS'} |",
          flush=True)
    records.append(dict(convert=convert, to_first_s=first, to_s=then,
                        from_first_s=back_first, from_s=back_then,
                        round_trip=same))
    del words, back
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(records, f, indent=1)
  if len(set(digests.values())) > 1:
    raise SystemExit(f"tpu_convert: the pairings' words differ: {digests}")
  if not all(r["round_trip"] for r in records):
    raise SystemExit("tpu_convert: a pairing did not give the table back.")


if __name__ == "__main__":
  app.run(main)
