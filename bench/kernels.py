"""The kernel benchmark: Pallas vs the XLA twins vs a device copy, and sweeps.

    python -m bench.kernels                  # a GPU: 10M-row tables
    python -m bench.kernels --dry_run        # CPU: interpret backend, tiny
    python -m bench.kernels --sweep --what=gather,update   # block sizes

Timing (the default). For each case -- gather, segment sum, a sparse
optimizer update (`--optimizer`, row-wise Adagrad by default: in place,
donated) and a full sparse step through the public API (lookup ->
gradients -> dedup -> apply_gradients, donated) -- on Zipf and uniform ids,
bf16 first:

* the output of every backend is checked against the `xla` twin at the
  benchmark size, on the device (gather bit for bit; sums and updates within
  f32 summation order / the GPU's division, sqrt and exp ulps);
* each backend is timed: `--rounds` rounds, the backends interleaved round
  by round (machine noise hits them alike), each round the mean of `--reps`
  queued calls; the median and the spread (p25-p75) are reported, with the
  minimal traffic (rows read + written) in GB/s, as a fraction of a device
  copy (`-x`) moving the same bytes and of a `--copy_mb` copy (the device's
  copy bandwidth), and the speed-up over the `xla` twin. `--inner` runs that
  many ops per executable (a fori_loop over shifted ids) so that host
  dispatch does not hide microsecond kernels.

Sweep (`--sweep`): for gather, segment_sum and update, every candidate block
configuration of the Pallas kernel (the shape heuristic's pick first) is
timed and checked against the twin, one line per config. Without a GPU both
modes run the interpret backend at tiny sizes: a check of this program, not
a measurement.

Results go to stdout and, one record per backend (or config) and case, to
`--json_out` (rewritten after every case, so a time-boxed run keeps what it
measured). `--budget_s` stops starting new cases after that many seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
from pallas_emb import kernels
from pallas_emb.datasets import zipf_ids
from pallas_emb.kernels import common
from pallas_emb.kernels.triton import gather as gather_kernel
from pallas_emb.kernels.triton import segment_sum as segment_sum_kernel
from pallas_emb.kernels.triton import sparse_update as update_kernel

WHATS = ("gather", "segment_sum", "update", "step")
SWEPT = ("gather", "segment_sum", "update")
OPTIMIZERS = {"rowwise_adagrad": lambda: pe.RowwiseAdagrad(
    0.05, half_life_steps=2500.0, weight_decay=1.4e-4, lazy=True),
              # No decay: no last_step state, no exp per row.
              "rowwise_adagrad_plain": lambda: pe.RowwiseAdagrad(0.05),
              "adagrad": lambda: pe.Adagrad(0.05),
              "adam": lambda: pe.Adam(0.05),
              "partial_rowwise_adam": lambda: pe.PartialRowwiseAdam(0.05),
              "ftrl": lambda: pe.Ftrl(0.05),
              "sgd": lambda: pe.Sgd(0.05)}
_UPDATE_STEP = 7  # updates applied before the timed one (lazy decay > 0)
_FILL_TOKEN = 2**31 - 1  # an unused unique slot's token (outside any table)


def on_gpu() -> bool:
  return jax.devices()[0].platform == "gpu"


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.kernels",
                              description=__doc__.splitlines()[0])
  p.add_argument("--what", default=None,
                 help=f"cases, comma-separated, of {WHATS} (default all; "
                 f"--sweep: {SWEPT})")
  p.add_argument("--sweep", action="store_true",
                 help="sweep the Pallas kernels' block sizes instead of "
                 "timing the backends")
  p.add_argument("--rows", type=int, default=10_000_000, help="table rows")
  p.add_argument("--widths", default=None,
                 help="shard widths (default 8,128; --sweep: "
                 "8,16,64,128,512)")
  p.add_argument("--tokens", default="262144",
                 help="ids per call, comma-separated")
  p.add_argument("--step_tokens", type=int, default=65_536)
  p.add_argument("--step_widths", default="8,64")
  p.add_argument("--dtypes", default="bfloat16,float32")
  p.add_argument("--ids", default="zipf,uniform",
                 help="id distributions: zipf (--zipf), uniform")
  p.add_argument("--zipf", type=float, default=1.05)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--optimizer", default="rowwise_adagrad",
                 choices=sorted(OPTIMIZERS),
                 help="the update case's rule (lazy row-wise Adagrad with "
                 "a half-life and weight decay by default)")
  p.add_argument("--backends", default=None,
                 help="default pallas,xla on a GPU, interpret,xla elsewhere")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--inner", type=int, default=1,
                 help="ops per executable (gather, segment_sum, update)")
  p.add_argument("--copy_mb", type=int, default=256,
                 help="buffer of the copy-bandwidth probe")
  p.add_argument("--max_configs", type=int, default=None,
                 help="--sweep: candidates per shape (default all)")
  p.add_argument("--budget_s", type=float, default=None)
  p.add_argument("--json_out", default=None)
  p.add_argument("--dry_run", action="store_true",
                 help="tiny sizes, interpret backend (CPU check of this "
                 "program, not a measurement)")
  args = p.parse_args(argv)
  args.interpret = args.dry_run or not on_gpu()
  if args.widths is None:
    args.widths = "8,16,64,128,512" if args.sweep else "8,128"
  if args.what is None:
    args.what = ",".join(SWEPT if args.sweep else WHATS)
  if args.interpret:
    args.rows = min(args.rows, 4096)
    args.tokens, args.step_tokens = "256", min(args.step_tokens, 256)
    args.widths, args.step_widths = "8", "8"
    args.reps, args.rounds = min(args.reps, 2), 1
    args.copy_mb = min(args.copy_mb, 1)
    args.max_configs = args.max_configs or 3
  if args.backends is None:
    args.backends = "interpret,xla" if args.interpret else "pallas,xla"
  for name in ("what", "widths", "step_widths", "dtypes", "ids", "backends",
               "tokens"):
    setattr(args, name, getattr(args, name).split(","))
  bad = set(args.what) - set(SWEPT if args.sweep else WHATS)
  if bad:
    p.error(f"--what: {sorted(bad)} not of "
            f"{SWEPT if args.sweep else WHATS}")
  args.widths = [int(w) for w in args.widths]
  args.step_widths = [int(w) for w in args.step_widths]
  args.tokens = [int(float(t)) for t in args.tokens]
  return args


def make_ids(args, kind: str, num_ids: int, seed: int = 0) -> np.ndarray:
  """Ids in rows 1..rows-1 (row 0 is padding), `pallas_emb.datasets`'."""
  exponent = args.zipf if kind == "zipf" else 0.0
  return zipf_ids(np.random.default_rng(seed), args.rows - 1, num_ids,
                  exponent)


def _normal(key, shape, dtype):
  return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(
      dtype))(key)


def _repeat(op, inner: int):
  """`op(k, carry)` for k < inner, the last result (one executable)."""
  if inner <= 1:
    return op(jnp.int32(0), None)
  first = op(jnp.int32(0), None)
  return jax.lax.fori_loop(1, inner, lambda k, c: op(k, c), first)


def _copy_state(state):
  return jax.tree.map(jnp.copy, state)


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def time_rounds(fns: dict, inputs, reps: int, rounds: int,
                donated: bool) -> dict:
  """Seconds per call of each fn: its rounds' means, rounds interleaved.

  A donated fn is called as `state = fn(state, *rest)`, each its own copy
  of the state fed back call after call.
  """
  states = {name: _copy_state(inputs[0]) for name in fns} if donated else {}
  times = {name: [] for name in fns}

  def burst(name, fn, count):
    out = None
    for _ in range(count):
      if donated:
        states[name] = out = fn(states[name], *inputs[1:])
      else:
        out = fn(*inputs)
    jax.block_until_ready(out)

  for name, fn in fns.items():  # warm-up (compile)
    burst(name, fn, 1)
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      burst(name, fn, reps)
      times[name].append((time.perf_counter() - start) / reps)
  return times


def _stats(times) -> dict:
  t = np.asarray(times)
  return {"median_s": float(np.median(t)),
          "p25_s": float(np.percentile(t, 25)),
          "p75_s": float(np.percentile(t, 75)), "n": int(t.size)}


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


def _exact(got, want):
  bad = int(_mismatched_bits(got, want))
  return bad == 0, bad


def _update_tol(dtype) -> float:
  # The GPU's division / sqrt / exp may move an update by an ulp: one bf16
  # step, or 1e-5 of the largest f32 value.
  return 2.0**-7 if dtype == jnp.bfloat16 else 1e-5


# --------------------------------------------------------------------------
# Cases: each a `Case`; `run(backend, config, *inputs)` is one op.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
  """One workload: inputs, its op per backend / config, traffic, check.

  `run(backend, config, k, *inputs)` is the op (k: the --inner index, which
  shifts the ids so repeated ops are not folded); `donated`: inputs[0] is
  state updated in place and fed back. `candidates(width, dtype)` and
  `heuristic` give the sweep's configs.
  """
  inputs: tuple
  run: Callable
  moved: int
  check: Callable
  donated: bool = False
  candidates: Callable | None = None
  heuristic: Any = None


def gather_case(args, width, dtype, ids):
  rows = args.rows
  table = _normal(jax.random.key(1), (rows, width), dtype)

  def run(backend, config, k, table, ids):
    return kernels.gather_rows(table, (ids + k) % rows, backend=backend,
                               config=config)

  def candidates():
    itemsize = jnp.dtype(dtype).itemsize
    # Rows of up to 4x the heuristic's longest row segment per block.
    for block_cols in _pow2_down(1, common.next_pow2(width)):
      if block_cols * itemsize > 4096:
        continue
      for block_rows in _pow2_down(1, 4096):
        if not 128 <= block_rows * block_cols <= common.MAX_TILE_ELEMENTS:
          continue
        for num_warps in (1, 2, 4, 8):
          yield gather_kernel.GatherConfig(block_rows, block_cols, num_warps)

  return Case((table, jnp.asarray(ids)), run,
              ids.size * (2 * width * jnp.dtype(dtype).itemsize + 4),
              _exact, candidates=candidates,
              heuristic=gather_kernel.resolve_config(None, ids.size, width,
                                                     dtype))


def segment_sum_case(args, width, dtype, ids):
  _, segments = np.unique(ids, return_inverse=True)
  num_segments = int(segments.max()) + 2  # an empty slot, as dedup pads
  distinct = num_segments - 1
  grads = _normal(jax.random.key(2), (ids.size, width), dtype)

  def run(backend, config, k, grads, segments):
    # Shifted segments (same sizes, other slots) when --inner > 1.
    segments = jnp.where(segments >= 0, (segments + k) % distinct, segments)
    return kernels.segment_sum_rows(grads, segments, num_segments,
                                    round_dtype=dtype, backend=backend,
                                    config=config)

  def check(got, want):
    ok_a, err_a = _close(got[0], want[0], 1e-5)
    ok_s, err_s = _close(got[1], want[1], 1e-5)
    return ok_a and ok_s, max(err_a, err_s)

  def candidates():
    top = common.next_pow2(width)
    for block_cols in _pow2_down(min(top, 8), min(top, 256)):
      for block_segments in _pow2_down(16, 1024):
        if block_segments * block_cols > 4096:
          continue
        for piece_rows in (16, 32, 64, 128):
          yield segment_sum_kernel.SegmentSumConfig(
              piece_rows, block_segments, block_cols)

  return Case((grads, jnp.asarray(segments.astype(np.int32))), run,
              ids.size * (width * jnp.dtype(dtype).itemsize + 4)
              + num_segments * (width + 1) * 4, check,
              candidates=candidates,
              heuristic=segment_sum_kernel.resolve_config(
                  None, ids.size, num_segments, width))


def update_case(args, width, dtype, ids):
  """`--optimizer`'s fused update of the rows of `ids`, in place."""
  rows = args.rows
  opt = OPTIMIZERS[args.optimizer]()
  unique = np.unique(ids).astype(np.int32)
  # As dedup hands them over: ids.size + 1 slots, the unused ones holding
  # a fill token outside the table and a zero gradient (skipped).
  slots_used = unique.size
  tokens = np.full((ids.size + 1,), _FILL_TOKEN, np.int32)
  tokens[:slots_used] = unique
  table = _normal(jax.random.key(3), (rows, width), dtype)
  grad = _normal(jax.random.key(4), (tokens.size, width), jnp.float32)
  grad = grad * (jnp.arange(tokens.size) < slots_used)[:, None]
  row_sq = jnp.sum(jnp.square(grad), axis=1)
  slots = opt.slots()
  row_state = tuple(jnp.full((rows,), s.init, s.dtype) for s in slots
                    if s.kind == "row")
  element_state = tuple(jnp.full((rows, width), s.init, s.dtype)
                        for s in slots if s.kind != "row")
  scalars = opt.scalars(jnp.int32(_UPDATE_STEP))

  def run(backend, config, k, state, tokens, grad, row_sq):
    table, row_state, element_state = state
    return kernels.sparse_update_rows(
        opt, table, row_state, element_state, tokens, grad, row_sq, True,
        _UPDATE_STEP + k, scalars, emb_width=width, backend=backend,
        config=config)

  def check(got, want):
    ok, err = _close(got[0], want[0], _update_tol(dtype))
    for g, w in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
      if jnp.issubdtype(w.dtype, jnp.integer):
        ok = ok and _exact(g, w)[0]
      else:
        ok_s, err_s = _close(g, w, 1e-5)
        ok, err = ok and ok_s, max(err, err_s)
    return ok, err

  def candidates():
    top = common.next_pow2(width)
    for block_cols in _pow2_down(min(top, 8), min(top, 256)):
      for block_rows in _pow2_down(8, 1024):
        if 128 <= block_rows * block_cols <= 8192:
          for num_warps in (1, 2, 4, 8):
            yield update_kernel.SparseUpdateConfig(block_rows, block_cols,
                                                   num_warps)

  itemsize = jnp.dtype(dtype).itemsize
  state_bytes = sum(4 * (width if s.kind != "row" else 1) for s in slots)
  moved = slots_used * (width * (2 * itemsize + 4) + 2 * state_bytes + 8)
  return Case(((table, row_state, element_state), jnp.asarray(tokens), grad,
               row_sq), run, moved, check, donated=True,
              candidates=candidates,
              heuristic=update_kernel.resolve_config(None, tokens.size,
                                                     width))


def step_case(args, width, dtype, ids):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  ctx = pe.make_context(mesh, "x", tokens_per_batch=ids.size, emb_width=width,
                        num_unique=ids.size + 1)
  opt = OPTIMIZERS["rowwise_adagrad"]()
  table = jax.device_put(_normal(jax.random.key(5), (args.rows, width),
                                 dtype), pe.table_sharding(ctx))
  state = (table, opt.init(ctx, table))

  def run(backend, config, k, st, ids):
    del config, k
    table, opt_state = st
    emb = pe.lookup(ctx, table, ids, backend=backend)
    grads = (emb.astype(jnp.float32) * 0.01).astype(emb.dtype)
    result = pe.dedup(ctx, ids, vocab_rows=args.rows)
    table, opt_state, _ = pe.apply_gradients(ctx, opt, table, opt_state,
                                             grads, result, backend=backend)
    return table, opt_state

  unique = np.unique(ids).size
  itemsize = jnp.dtype(dtype).itemsize
  moved = (3 * ids.size * width * itemsize
           + unique * width * (2 * itemsize + 8) + unique * 12)

  def check(got, want):
    ok_t, err_t = _close(got[0], want[0], _update_tol(dtype))
    ok_s, err_s = _close(got[1].row_state, want[1].row_state, 1e-5)
    return ok_t and ok_s, max(err_t, err_s)

  ids = jax.device_put(jnp.asarray(ids), pe.token_sharding(ctx))
  return Case((state, ids), run, moved, check, donated=True)


CASES = {"gather": gather_case, "segment_sum": segment_sum_case,
         "update": update_case, "step": step_case}


def _pow2_down(lo: int, hi: int) -> list[int]:
  """Powers of two in [lo, hi], largest first (whole rows before splits)."""
  return [1 << k for k in range(max(hi, 1).bit_length())
          if lo <= 1 << k <= hi][::-1]


def _jit(case: Case, backend: str, config, inner: int):
  """One executable: `inner` ops of `case` (state fed through if donated)."""
  if case.donated:
    def fn(state, *rest):
      def op(k, carry):
        return case.run(backend, config, k,
                        state if carry is None else carry, *rest)
      return _repeat(op, inner)
    return jax.jit(fn, donate_argnums=0)
  return jax.jit(lambda *inputs: _repeat(
      lambda k, c: case.run(backend, config, k, *inputs), inner))


def _check_once(case: Case, fn, want):
  if case.donated:
    got = fn(_copy_state(case.inputs[0]), *case.inputs[1:])
  else:
    got = fn(*case.inputs)
  return case.check(got, want)


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def _copy_fn(num_bytes: int):
  """A device copy (`-x`) reading and writing `num_bytes` in total."""
  x = jnp.zeros((max(1, num_bytes // 8),), jnp.float32)
  return jax.jit(lambda v: -v), x


def copy_bandwidth(args) -> float:
  """GB/s of a `--copy_mb` device copy (read + write)."""
  fn, x = _copy_fn(2 * args.copy_mb * 2**20)
  times = time_rounds({"copy": fn}, (x,), args.reps, args.rounds, False)
  return 2 * x.size * 4 / _stats(times["copy"])["median_s"] / 1e9


def time_case(args, what, case: Case, tag: dict, copy_gbps: float
              ) -> list[dict]:
  """Every backend of one case, checked and timed; one record each."""
  inner = 1 if what == "step" else max(args.inner, 1)
  fns = {b: _jit(case, b, None, inner) for b in args.backends}
  copy, x = _copy_fn(case.moved * inner)
  want = None
  if "xla" in fns:
    want = (fns["xla"](_copy_state(case.inputs[0]), *case.inputs[1:])
            if case.donated else fns["xla"](*case.inputs))
  records, timed = [], {}
  for backend, fn in fns.items():
    record = dict(what=what, backend=backend, **tag, bytes=int(case.moved),
                  inner=inner, copy_gbps=copy_gbps)
    try:
      if want is not None:
        ok, err = _check_once(case, fn, want)
        record.update(check="ok" if ok else "FAIL", max_err=float(err))
      timed[backend] = fn
    except Exception as e:  # pylint: disable=broad-except
      record.update(error=f"{type(e).__name__}: {str(e)[:300]}")
    records.append(record)
  del want
  times = time_rounds(timed, case.inputs, args.reps, args.rounds,
                      case.donated) if timed else {}
  same = time_rounds({"copy": copy}, (x,), args.reps, args.rounds, False)
  same_s = _stats(same["copy"])["median_s"] / inner
  xla_s = (_stats(times["xla"])["median_s"] / inner if "xla" in times
           else None)
  for record in records:
    backend = record["backend"]
    head = (f"{what:12s} {record['dtype']:8s} w={record['width']:<4d} "
            f"{record['ids']:7s} n={record['tokens']:<7d} {backend:9s}")
    if backend not in times or "error" in record:
      record.setdefault("error", "not timed")
      print(f"{head} FAILED {record['error']}", flush=True)
      continue
    st = {k: v / inner if k.endswith("_s") else v
          for k, v in _stats(times[backend]).items()}
    seconds = st["median_s"]
    record.update(st, us=seconds * 1e6, gbps=case.moved / seconds / 1e9,
                  of_same_copy=same_s / seconds,
                  same_copy_gbps=case.moved / same_s / 1e9)
    record["of_copy"] = record["gbps"] / copy_gbps
    if xla_s is not None:
      record["speedup_vs_xla"] = xla_s / seconds
    print(f"{head} {record['us']:10.1f} us (IQR "
          f"{(st['p75_s'] - st['p25_s']) * 1e6:.1f}) "
          f"{record['gbps']:8.1f} GB/s ({record['of_same_copy']:5.0%} of a "
          f"same-size copy, {record['of_copy']:5.0%} of copy) "
          f"x{record.get('speedup_vs_xla', float('nan')):.2f} vs xla  "
          f"check {record.get('check', '-')} "
          f"(err {record.get('max_err', 0):.2g})", flush=True)
  return records


def sweep_case(args, what, case: Case, tag: dict) -> list[dict]:
  """Every candidate config of the Pallas kernel, checked and timed."""
  backend = "interpret" if args.interpret else "triton"
  twin = _jit(case, "xla", None, 1)
  want = (twin(_copy_state(case.inputs[0]), *case.inputs[1:])
          if case.donated else twin(*case.inputs))
  twin_s = _stats(time_rounds({"xla": twin}, case.inputs, args.reps,
                              args.rounds, case.donated)["xla"])["median_s"]
  print(f"{what:12s} {tag['dtype']:8s} w={tag['width']:<4d} {tag['ids']:7s} "
        f"n={tag['tokens']:<7d} xla twin {twin_s * 1e6:10.1f} us",
        flush=True)
  configs = [case.heuristic] + [c for c in case.candidates()
                                if c != case.heuristic]
  if args.max_configs:
    configs = configs[:args.max_configs]
  records = []
  for i, config in enumerate(configs):
    fn = _jit(case, backend, config, 1)
    record = dict(what=what, backend=backend, **tag, config=repr(config),
                  heuristic=i == 0, twin_s=twin_s)
    try:
      ok, err = _check_once(case, fn, want)
      times = time_rounds({"k": fn}, case.inputs, args.reps, args.rounds,
                          case.donated)["k"]
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {config}: FAILED {type(e).__name__}: {str(e)[:200]}")
      records.append(dict(record, error=f"{type(e).__name__}: {e}"[:300]))
      continue
    seconds = _stats(times)["median_s"]
    record.update(_stats(times), gbps=case.moved / seconds / 1e9,
                  check="ok" if ok else "FAIL", max_err=float(err),
                  speedup_vs_xla=twin_s / seconds)
    print(f"  {seconds * 1e6:10.1f} us {record['gbps']:8.1f} GB/s "
          f"{'ok ' if ok else 'BAD'} {'heuristic' if i == 0 else '':9s} "
          f"{config}", flush=True)
    records.append(record)
  return records


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  start = time.perf_counter()
  print(f"# bench.kernels{' --sweep' if args.sweep else ''}: "
        f"rows={args.rows:,} tokens={args.tokens} "
        f"step_tokens={args.step_tokens:,} backends={args.backends} "
        f"optimizer={args.optimizer} interpret={args.interpret} "
        f"device={jax.devices()[0].device_kind}", flush=True)
  copy_gbps = 0.0
  if not args.sweep:
    copy_gbps = copy_bandwidth(args)
    print(f"# copy bandwidth ({args.copy_mb} MB): {copy_gbps:.1f} GB/s")
  ids = {(kind, n): make_ids(args, kind, n) for kind in args.ids
         for n in args.tokens}
  step_ids = {kind: make_ids(args, kind, args.step_tokens, seed=1)
              for kind in args.ids}
  for (kind, n), values in ids.items():
    top = np.bincount(values).max()
    print(f"# {kind} ids, {n:,}: {np.unique(values).size:,} distinct, top "
          f"id {top:,} times ({top / values.size:.1%})")
  # bf16 Zipf for every kernel first, so a time-boxed run covers them all.
  cases = []
  for dtype, kind, what in itertools.product(args.dtypes, args.ids,
                                             args.what):
    if what == "step":
      cases += [(dtype, kind, what, w, args.step_tokens)
                for w in args.step_widths]
    else:
      cases += [(dtype, kind, what, w, n) for w in args.widths
                for n in args.tokens]
  records = []
  for i, (dtype, kind, what, width, n) in enumerate(cases):
    if args.budget_s and time.perf_counter() - start > args.budget_s:
      print(f"# budget of {args.budget_s:.0f} s spent: {len(cases) - i} "
            "cases not run")
      break
    values = step_ids[kind] if what == "step" else ids[(kind, n)]
    dtype = jnp.dtype(dtype)
    case = CASES[what](args, width, dtype, values)
    tag = dict(dtype=dtype.name, width=width, ids=kind, tokens=int(n),
               rows=args.rows)
    if what == "update":
      tag["optimizer"] = args.optimizer
    if args.sweep:
      records += sweep_case(args, what, case, tag)
    else:
      records += time_case(args, what, case, tag, copy_gbps)
    del case
    if args.json_out:
      with open(args.json_out, "w") as f:
        json.dump(records, f, indent=1)
  failed = [r for r in records if r.get("check") != "ok"]
  print(f"# {len(records)} results, {len(failed)} failed checks or errors, "
        f"{time.perf_counter() - start:.0f} s")
  return records


if __name__ == "__main__":
  main()
