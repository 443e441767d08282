"""Kernel benchmark of the GPU check: Pallas vs the XLA twins vs a device copy.

    python -m bench.kernels                  # a GPU: 10M-row tables
    python -m bench.kernels --dry_run        # CPU: interpret backend, tiny

For each case -- gather, segment sum, lazy row-wise Adagrad (in place,
donated) and a full sparse step through the public API (lookup -> gradients
-> dedup -> apply_gradients, donated) -- on Zipf and uniform ids, bf16 first:

* the output of every backend is checked against the `xla` twin at the
  benchmark size, on the device (gather bit for bit; sums and updates within
  f32 summation order / the GPU's division, sqrt and exp ulps);
* each backend is timed (median over rounds of the mean of `--reps` queued
  calls) and its minimal traffic (rows read + written) is reported in GB/s,
  next to a device copy (`-x`) moving the same number of bytes.

Results go to stdout and, one record per backend and case, to `--json_out`
(rewritten after every case, so a time-boxed run keeps what it measured).
`--budget_s` stops starting new cases after that many seconds.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb import kernels
from pallas_emb.kernels import sweep
from pallas_emb.kernels.hparams import AdagradHParams

HPARAMS = AdagradHParams(eps=1e-10, inv_width=1 / 128, lazy=True,
                         accum_decay_rate=float(np.log(2) / 2500),
                         weight_decay_rate=1.4e-4)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--what", default="gather,segment_sum,adagrad,step")
  p.add_argument("--rows", type=int, default=10_000_000)
  p.add_argument("--widths", default="8,128")
  p.add_argument("--tokens", type=int, default=262_144)
  p.add_argument("--step_tokens", type=int, default=65_536)
  p.add_argument("--step_widths", default="8,64")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--ids", default="zipf,uniform")
  p.add_argument("--zipf", type=float, default=1.05)
  p.add_argument("--backends", default=None,
                 help="default pallas,xla on a GPU, interpret,xla elsewhere")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--budget_s", type=float, default=None)
  p.add_argument("--json_out", default=None)
  p.add_argument("--dry_run", action="store_true",
                 help="tiny sizes, interpret backend (CPU check of this "
                 "program, not a measurement)")
  args = p.parse_args(argv)
  if args.dry_run:
    args.rows, args.tokens, args.step_tokens = 4096, 256, 256
    args.widths, args.step_widths = "8", "8"
    args.reps, args.rounds = 2, 1
  if args.backends is None:
    args.backends = ("pallas,xla" if sweep.on_gpu() and not args.dry_run
                     else "interpret,xla")
  for name in ("what", "widths", "step_widths", "dtypes", "ids", "backends"):
    setattr(args, name, getattr(args, name).split(","))
  args.widths = [int(w) for w in args.widths]
  args.step_widths = [int(w) for w in args.step_widths]
  return args


def make_ids(args, kind: str, num_ids: int, seed: int = 0) -> np.ndarray:
  exponent = args.zipf if kind == "zipf" else 0.0
  return sweep.zipf_ids(num_ids, args.rows, exponent, seed)


def _normal(key, shape, dtype):
  return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(
      dtype))(key)


# --------------------------------------------------------------------------
# Device-side checks: a few scalars come back, not the arrays.
# --------------------------------------------------------------------------


@jax.jit
def _mismatched_bits(a, b):
  bits = jnp.uint16 if a.dtype.itemsize == 2 else jnp.uint32
  return jnp.sum(jax.lax.bitcast_convert_type(a, bits)
                 != jax.lax.bitcast_convert_type(b, bits))


@jax.jit
def _max_rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  scale = jnp.maximum(jnp.max(jnp.abs(b)), 1e-30)
  return jnp.max(jnp.abs(a - b)) / scale


def _close(got, want, tol):
  err = float(_max_rel_err(got, want))
  return err <= tol, err


# --------------------------------------------------------------------------
# Cases: (inputs, {backend: fn}, bytes moved, check(got, want), donated)
# --------------------------------------------------------------------------


def gather_case(args, width, dtype, ids):
  table = _normal(jax.random.key(1), (args.rows, width), dtype)
  fns = {b: jax.jit(functools.partial(kernels.gather_rows, backend=b))
         for b in args.backends}
  moved = ids.size * (2 * width * jnp.dtype(dtype).itemsize + 4)

  def check(got, want):
    bad = int(_mismatched_bits(got, want))
    return bad == 0, bad

  return (table, jnp.asarray(ids)), fns, moved, check, False


def segment_sum_case(args, width, dtype, ids):
  _, segments = np.unique(ids, return_inverse=True)
  num_segments = int(segments.max()) + 2  # an empty slot, as dedup pads
  grads = _normal(jax.random.key(2), (ids.size, width), dtype)
  fns = {b: jax.jit(functools.partial(
      kernels.segment_sum_rows, num_segments=num_segments, round_dtype=dtype,
      backend=b)) for b in args.backends}
  moved = ids.size * (width * jnp.dtype(dtype).itemsize + 4) + (
      num_segments * (width + 1) * 4)

  def check(got, want):
    ok_a, err_a = _close(got[0], want[0], 1e-5)
    ok_s, err_s = _close(got[1], want[1], 1e-5)
    return ok_a and ok_s, max(err_a, err_s)

  return ((grads, jnp.asarray(segments.astype(np.int32))), fns, moved, check,
          False)


def adagrad_case(args, width, dtype, ids):
  unique = np.unique(ids).astype(np.int32)
  table = _normal(jax.random.key(3), (args.rows, width), dtype)
  grad = _normal(jax.random.key(4), (unique.size, width), jnp.float32)
  row_sq = jnp.sum(jnp.square(grad), axis=1)
  state = (table, jnp.zeros((args.rows,), jnp.float32),
           jnp.zeros((args.rows,), jnp.int32))

  def update(backend, st, tokens, grad, row_sq):
    return kernels.adagrad_apply(*st, tokens, grad, row_sq, True, 7, 0.05,
                                 hparams=HPARAMS, backend=backend)

  fns = {b: jax.jit(functools.partial(update, b), donate_argnums=0)
         for b in args.backends}
  moved = unique.size * (width * (2 * jnp.dtype(dtype).itemsize + 4) + 20)

  def check(got, want):
    # The GPU's division / sqrt / exp may move an update by an ulp: one
    # bf16 step, or 1e-5 of the largest f32 value.
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    ok_t, err_t = _close(got[0], want[0], tol)
    ok_s, err_s = _close(got[1], want[1], 1e-5)
    same_last = int(_mismatched_bits(got[2], want[2])) == 0
    return ok_t and ok_s and same_last, max(err_t, err_s)

  return ((state, jnp.asarray(unique), grad, row_sq), fns, moved, check,
          True)


def step_case(args, width, dtype, ids):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  ctx = pe.make_context(mesh, "x", tokens_per_batch=ids.size, emb_width=width,
                        num_unique=ids.size + 1)
  opt = pe.RowwiseAdagrad(0.05, half_life_steps=2500.0, weight_decay=1.4e-4,
                          lazy=True)
  table = jax.device_put(_normal(jax.random.key(5), (args.rows, width),
                                 dtype), pe.table_sharding(ctx))
  state = (table, opt.init(ctx, table))

  def step(backend, st, ids):
    table, opt_state = st
    emb = pe.lookup(ctx, table, ids, backend=backend)
    grads = (emb.astype(jnp.float32) * 0.01).astype(emb.dtype)
    result = pe.dedup(ctx, ids, vocab_rows=args.rows)
    table, opt_state, _ = pe.apply_gradients(ctx, opt, table, opt_state,
                                             grads, result, backend=backend)
    return table, opt_state

  fns = {b: jax.jit(functools.partial(step, b), donate_argnums=0)
         for b in args.backends}
  unique = np.unique(ids).size
  itemsize = jnp.dtype(dtype).itemsize
  moved = (3 * ids.size * width * itemsize
           + unique * width * (2 * itemsize + 8) + unique * 12)

  def check(got, want):
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    ok_t, err_t = _close(got[0], want[0], tol)
    ok_s, err_s = _close(got[1].row_state, want[1].row_state, 1e-5)
    return ok_t and ok_s, max(err_t, err_s)

  ids = jax.device_put(jnp.asarray(ids), pe.token_sharding(ctx))
  return (state, ids), fns, moved, check, True


CASES = {"gather": gather_case, "segment_sum": segment_sum_case,
         "adagrad": adagrad_case, "step": step_case}


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def _copy_seconds(num_bytes: int, args) -> float:
  """A device copy (`-x`) reading and writing `num_bytes` in total."""
  x = jnp.zeros((max(1, num_bytes // 8),), jnp.float32)
  return sweep.time_calls(jax.jit(lambda v: -v), (x,), args.reps,
                          args.rounds)


def _copy_state(state):
  return jax.tree.map(jnp.copy, state)


def run_case(args, what, width, dtype, kind, ids):
  inputs, fns, moved, check, donated = CASES[what](args, width, dtype, ids)
  records = []
  copy_s = _copy_seconds(moved, args)
  want = None
  if donated:
    want = fns["xla"](_copy_state(inputs[0]), *inputs[1:])
  else:
    want = fns["xla"](*inputs)
  for backend, fn in fns.items():
    record = dict(what=what, backend=backend, dtype=jnp.dtype(dtype).name,
                  width=width, ids=kind, tokens=int(ids.size), rows=args.rows,
                  bytes=int(moved), copy_us=copy_s * 1e6,
                  copy_gbps=moved / copy_s / 1e9)
    try:
      if donated:
        got = fn(_copy_state(inputs[0]), *inputs[1:])
        ok, err = check(got, want)
        del got
        seconds, _ = sweep.time_donated(fn, _copy_state(inputs[0]),
                                        inputs[1:], args.reps, args.rounds)
      else:
        ok, err = check(fn(*inputs), want)
        seconds = sweep.time_calls(fn, inputs, args.reps, args.rounds)
    except Exception as e:  # pylint: disable=broad-except
      record.update(error=f"{type(e).__name__}: {str(e)[:300]}")
      print(f"{what:12s} {record['dtype']:8s} w={width:<4d} {kind:7s} "
            f"{backend:9s} FAILED {record['error']}")
      records.append(record)
      continue
    record.update(us=seconds * 1e6, gbps=moved / seconds / 1e9,
                  of_copy=copy_s / seconds, check="ok" if ok else "FAIL",
                  max_err=float(err))
    print(f"{what:12s} {record['dtype']:8s} w={width:<4d} {kind:7s} "
          f"{backend:9s} {record['us']:10.1f} us {record['gbps']:8.1f} GB/s "
          f"({record['of_copy']:5.0%} of copy {record['copy_gbps']:.0f} GB/s)"
          f"  check {record['check']} (err {err:.2g})", flush=True)
    records.append(record)
  return records


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  start = time.perf_counter()
  print(f"# bench.kernels: rows={args.rows:,} tokens={args.tokens:,} "
        f"step_tokens={args.step_tokens:,} backends={args.backends} "
        f"device={jax.devices()[0].device_kind}", flush=True)
  ids = {kind: make_ids(args, kind, args.tokens) for kind in args.ids}
  step_ids = {kind: make_ids(args, kind, args.step_tokens, seed=1)
              for kind in args.ids}
  for kind, values in ids.items():
    top = np.bincount(values).max()
    print(f"# {kind} ids: {np.unique(values).size:,} distinct, top id "
          f"{top:,} times ({top / values.size:.1%})")
  # bf16 Zipf for every kernel first, so a time-boxed run covers them all.
  cases = [(dtype, kind, what, width)
           for dtype, kind, what in itertools.product(args.dtypes, args.ids,
                                                      args.what)
           for width in (args.step_widths if what == "step" else args.widths)]
  records = []
  for i, (dtype, kind, what, width) in enumerate(cases):
    if args.budget_s and time.perf_counter() - start > args.budget_s:
      print(f"# budget of {args.budget_s:.0f} s spent: {len(cases) - i} "
            "cases not run")
      break
    pool = step_ids if what == "step" else ids
    records += run_case(args, what, width, jnp.dtype(dtype), kind,
                        pool[kind])
    if args.json_out:
      with open(args.json_out, "w") as f:
        json.dump(records, f, indent=1)
  failed = [r for r in records if r.get("check") != "ok"]
  print(f"# {len(records)} results, {len(failed)} failed checks or errors, "
        f"{time.perf_counter() - start:.0f} s")
  return records


if __name__ == "__main__":
  main()
