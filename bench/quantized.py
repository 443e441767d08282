"""Serving gather: an f32 table vs its int8 row-wise copy, one process.

    python -m bench.quantized                    # 1M x 64, 16k Zipf ids, xla
    python -m bench.quantized --backend triton   # the Triton kernels (GPU)

Times `kernels.gather_rows` on the f32 table (and its bf16 cast) and
`kernels.gather_dequantized` on `quantize_rows(table, "int8")` for the same
ids (median over `--rounds` of the mean of `--reps` queued calls, the cases
taking turns), after checking that the int8 gather equals
`dequantize_rows` of the table at those ids bit for bit. Prints one line
per table kind and the int8 / f32 time ratio; `--json_out` gets the same
as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import kernels
from pallas_emb import quantize
from pallas_emb.datasets import zipf_ids


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--tokens", type=int, default=16_384)
  p.add_argument("--zipf", type=float, default=1.05)
  p.add_argument("--backend", default="xla")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json_out", default=None)
  return p.parse_args(argv)


def time_cases(cases, reps: int, rounds: int) -> dict[str, float]:
  """Per case, the median over rounds of the mean time of `reps` queued
  calls (s). The cases take turns within each round, so that a busy spell
  of the machine does not land on one case only."""
  for fn, args, _ in cases.values():
    jax.block_until_ready(fn(*args))  # compile
  times = {name: [] for name in cases}
  for _ in range(rounds):
    for name, (fn, args, _) in cases.items():
      start = time.perf_counter()
      out = None
      for _ in range(reps):
        out = fn(*args)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - start) / reps)
  return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None) -> dict:
  args = parse_args(argv)
  key = jax.random.key(args.seed)
  table = jax.random.normal(key, (args.rows, args.width), jnp.float32)
  rows = quantize.quantize_rows(table, "int8")
  ids = jnp.asarray(zipf_ids(np.random.default_rng(args.seed), args.rows,
                             args.tokens, args.zipf))
  gather = jax.jit(functools.partial(kernels.gather_rows,
                                     backend=args.backend))
  gather_int8 = jax.jit(functools.partial(kernels.gather_dequantized,
                                          backend=args.backend))
  want = np.asarray(quantize.dequantize_rows(rows))[np.asarray(ids)]
  got = np.asarray(gather_int8(*rows, ids))
  if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
    raise AssertionError("int8 gather differs from dequantize_rows")
  cases = {
      "float32": (gather, (table, ids), 4 * args.width),
      "bfloat16": (gather, (table.astype(jnp.bfloat16), ids),
                   2 * args.width),
      "int8": (gather_int8, (*rows, ids), args.width + 8),
  }
  out = {"rows": args.rows, "width": args.width, "tokens": args.tokens,
         "zipf": args.zipf, "backend": args.backend,
         "device": jax.devices()[0].device_kind, "cases": {}}
  medians = time_cases(cases, args.reps, args.rounds)
  for name, (_, _, row_bytes) in cases.items():
    seconds = medians[name]
    out["cases"][name] = {"median_s": seconds,
                          "table_bytes_per_row": row_bytes}
    print(f"{name:9s} {seconds * 1e6:10.1f} us  "
          f"({row_bytes} table bytes per row)")
  out["int8_over_f32"] = (out["cases"]["int8"]["median_s"]
                          / out["cases"]["float32"]["median_s"])
  print(f"int8 / f32 time: {out['int8_over_f32']:.3f}")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
