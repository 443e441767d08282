"""Block-size sweeps of the kernels (`python -m pallas_emb.kernels.<kernel>`).

Each kernel module's `main()` describes its inputs, its candidate configs and
its twin; this module parses the flags, times every candidate on the default
device, checks its output against the twin, and prints one line per config
(the shape heuristic's pick first). On a machine without a GPU it runs the
interpret backend at a tiny size: a dry run of the sweep itself, not a
measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def pow2_range(lo: int, hi: int) -> list[int]:
  """Powers of two in [lo, hi], smallest first."""
  return [1 << k for k in range(max(hi, 1).bit_length()) if lo <= 1 << k <= hi]


def pow2_down(lo: int, hi: int) -> list[int]:
  """Powers of two in [lo, hi], largest first (whole rows before splits)."""
  return pow2_range(lo, hi)[::-1]


def zipf_ids(num_ids: int, vocab_rows: int, exponent: float,
             seed: int) -> np.ndarray:
  """`num_ids` int32 ids in [0, vocab_rows), Zipf(exponent) over ranks.

  Rank k has probability proportional to (k + 1) ** -exponent (exponent 0:
  uniform); ranks are scattered over the table by a multiplicative hash, so
  the hot rows are not neighbours.
  """
  rng = np.random.default_rng(seed)
  if exponent == 0:
    ranks = rng.integers(0, vocab_rows, num_ids)
  else:
    weights = np.arange(1, vocab_rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    ranks = np.searchsorted(cdf, rng.random(num_ids) * cdf[-1], side="right")
    ranks = np.minimum(ranks, vocab_rows - 1)
  # 2654435761 is prime; coprime to vocab_rows unless it divides it.
  mult = 2654435761 if vocab_rows % 2654435761 else 1
  return ((ranks.astype(np.int64) * mult + 12345) % vocab_rows).astype(
      np.int32)


def on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


def parse_args(kernel: str, argv, *, rows: int, tokens: int):
  parser = argparse.ArgumentParser(
      prog=f"python -m pallas_emb.kernels.{kernel}",
      description=f"Sweeps the {kernel} kernel's block sizes on the default "
      "device (a tiny interpret-mode dry run without a GPU).")
  parser.add_argument("--widths", default="8,16,64,128,512",
                      help="shard widths, comma-separated")
  parser.add_argument("--dtypes", default="bfloat16,float32")
  parser.add_argument("--rows", type=int, default=None,
                      help=f"table rows (default {rows:,}; 2,048 interpreted)")
  parser.add_argument("--tokens", type=int, default=None,
                      help=f"ids per call (default {tokens:,}; 128 "
                      "interpreted)")
  parser.add_argument("--zipf", type=float, default=1.05,
                      help="Zipf exponent of the ids (0 = uniform)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--reps", type=int, default=20,
                      help="timed calls per round (3 rounds, median)")
  parser.add_argument("--max_configs", type=int, default=None,
                      help="candidates per shape (default all; 3 "
                      "interpreted)")
  parser.add_argument("--interpret", action="store_true",
                      help="use the interpret backend (default without GPU)")
  parser.add_argument("--json_out", default=None)
  args = parser.parse_args(argv)
  args.interpret = args.interpret or not on_gpu()
  if args.interpret:
    args.rows = args.rows or 2048
    args.tokens = args.tokens or 128
    args.max_configs = args.max_configs or 3
    args.reps = min(args.reps, 2)
    if args.widths == parser.get_default("widths"):
      args.widths = "8,64"
  args.rows = args.rows or rows
  args.tokens = args.tokens or tokens
  args.widths = [int(w) for w in args.widths.split(",")]
  args.dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
  args.kernel = kernel
  return args


def time_calls(fn, args, reps: int, rounds: int = 3) -> float:
  """Median over rounds of the mean seconds per call (`reps` calls queued)."""
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / reps)
  return float(np.median(times))


def time_donated(fn, state, args, reps: int, rounds: int = 3):
  """Like `time_calls` for `state = fn(state, *args)` with `state` donated."""
  state = fn(state, *args)
  jax.block_until_ready(state)
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(reps):
      state = fn(state, *args)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - start) / reps)
  return float(np.median(times)), state


def _close(got, want, exact: bool) -> bool:
  """Bit-exact, or within f32 summation order (one bf16 ulp for bf16)."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    tol = 2.0**-7 if g.dtype == jnp.bfloat16 else 1e-5
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if exact:
      if not np.array_equal(g, w, equal_nan=True):
        return False
    elif not np.allclose(g, w, rtol=tol,
                         atol=tol * max(1.0, np.abs(w).max(initial=0.0))):
      return False
  return True


def run_sweep(args, *, setup, run, twin, candidates, default, bytes_moved,
              exact: bool, timer=None) -> list[dict]:
  """Times `run(config, *inputs)` per candidate; prints and returns the rows.

  `setup(width, dtype, key)` builds the inputs; `twin(*inputs)` is the
  reference output; `timer(config, inputs)` (optional) returns seconds per
  call for kernels that update their inputs in place.
  """
  results = []
  print(f"# {args.kernel}: rows={args.rows:,} tokens={args.tokens:,} "
        f"zipf={args.zipf} interpret={args.interpret} "
        f"device={jax.devices()[0].device_kind}")
  for width, dtype in itertools.product(args.widths, args.dtypes):
    inputs = setup(width, dtype, jax.random.key(args.seed))
    want = jax.jit(twin)(*inputs)
    twin_s = time_calls(jax.jit(twin), inputs, args.reps)
    print(f"w={width:<4d} {dtype.name:8s} xla twin {twin_s * 1e6:10.1f} us")
    picked = default(width, dtype)
    configs = [picked] + [c for c in candidates(width, dtype) if c != picked]
    if args.max_configs:
      configs = configs[:args.max_configs]
    for i, config in enumerate(configs):
      fn = jax.jit(lambda *a, c=config: run(c, *a))
      try:
        ok = _close(fn(*inputs), want, exact)
        seconds = (timer(config, inputs) if timer
                   else time_calls(fn, inputs, args.reps))
      except Exception as e:  # pylint: disable=broad-except
        print(f"  {config}: FAILED {type(e).__name__}: {str(e)[:200]}")
        continue
      gbps = bytes_moved(width, dtype) / seconds / 1e9
      tag = "heuristic" if i == 0 else ""
      print(f"  {seconds * 1e6:10.1f} us {gbps:8.1f} GB/s "
            f"{'ok ' if ok else 'BAD'} {tag:9s} {config}")
      results.append(dict(width=width, dtype=dtype.name, config=repr(config),
                          heuristic=i == 0, seconds=seconds, gbps=gbps,
                          ok=ok, twin_seconds=twin_s))
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(results, f, indent=1)
  return results
