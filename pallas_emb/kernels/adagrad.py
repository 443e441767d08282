"""Pallas (Triton) kernel: the fused sparse row-wise Adagrad update, in place.

One program owns `block_rows` unique slots. For each slot u it wraps the token
once, skips it when the update is not applied or the token is outside the
table (fill values), and otherwise reads `row_state[t]` (and `last_step[t]`
in lazy mode), then, one `[block_rows, block_cols]` column block at a time,
the table tile and the matching `grad_accum` tile, and writes the updated
rows; the accumulator and step are written once per row at the end (DESIGN
§4.5; the arithmetic is `common.adagrad_row_update` /
`common.adagrad_new_values`, shared with the jnp twin). Column blocks are a
loop inside the program, not a grid axis: a second program reading
`row_state[t]` after the first one wrote it would apply the decay twice.

The table, `row_state` and `last_step` are aliased to the outputs
(`input_output_aliases`): unique tokens are unique, so every touched row is
read and written by exactly one lane of one program and no other row is
written at all. Under donation the update costs O(U * S), not O(V * S).

As in `gather.py` the table is addressed through a flat view (any width)
with per-row masks on 1-D vectors, so table and gradient rows are read and
written with vector accesses; `row_state` / `last_step` hold one element per
row and are gathered / scattered by token.

Run `python -m pallas_emb.kernels.adagrad --help` for the block-size sweep.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common
from pallas_emb.kernels.hparams import AdagradHParams


# Tiles of 4 KiB of f32: with 4 warps, at most 8 elements (two rows) per
# thread. The per-row arithmetic (two `exp`s in lazy mode) is replicated on
# every thread of a row; at four rows per thread ptxas spills the inlined
# expf (seen at [32, 64] and [16, 128] f32 tiles, 4 warps).
_TILE_BYTES = 4096
_MAX_ROW_BYTES = 1024
_MIN_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class AdagradConfig:
  """Tile of the Adagrad kernel; a field left None takes the shape heuristic.

  block_rows, block_cols: powers of two, `block_rows * block_cols <=
  common.MAX_TILE_ELEMENTS`; a wider shard loops over column blocks inside
  the program (the row's accumulator is read and written once).
  """
  block_rows: int | None = None
  block_cols: int | None = None
  num_warps: int | None = None
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_rows", "block_cols", "num_warps"):
      common.check_pow2("AdagradConfig", name, getattr(self, name))
    common.check_tile("AdagradConfig", self.block_rows, self.block_cols)
    if self.num_stages < 1:
      raise ValueError(f"pallas_emb AdagradConfig.num_stages must be >= 1, "
                       f"got {self.num_stages}.")


def resolve_config(config: AdagradConfig | None, num_unique: int,
                   width: int) -> AdagradConfig:
  """`config` with every None field filled in by the shape heuristic."""
  config = config or AdagradConfig()
  f32 = 4  # the update is computed in f32 whatever the table dtype
  block_cols = config.block_cols or common.block_cols_for(
      width, f32, _MAX_ROW_BYTES)
  block_rows = config.block_rows or common.block_rows_for(
      num_unique, block_cols, f32, tile_bytes=_TILE_BYTES,
      min_programs=_MIN_PROGRAMS)
  num_warps = config.num_warps or common.num_warps_for(
      block_rows * block_cols, f32)
  return AdagradConfig(block_rows, block_cols, num_warps, config.num_stages)


def _eager_kernel(apply_ref, step_ref, lr_ref, tokens_ref, grad_ref,
                  row_sq_ref, table_ref, state_ref, table_out, state_out,
                  **static):
  _update(apply_ref, step_ref, lr_ref, tokens_ref, grad_ref, row_sq_ref,
          table_ref, state_ref, None, table_out, state_out, None, **static)


def _lazy_kernel(apply_ref, step_ref, lr_ref, tokens_ref, grad_ref,
                 row_sq_ref, table_ref, state_ref, last_ref, table_out,
                 state_out, last_out, **static):
  _update(apply_ref, step_ref, lr_ref, tokens_ref, grad_ref, row_sq_ref,
          table_ref, state_ref, last_ref, table_out, state_out, last_out,
          **static)


def _update(apply_ref, step_ref, lr_ref, tokens_ref, grad_ref, row_sq_ref,
            table_ref, state_ref, last_ref, table_out, state_out, last_out, *,
            hparams, num_unique, vocab_rows, width, block_rows, block_cols,
            interpret):
  slots = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  slot_ok = slots < num_unique
  # Contiguous and masked: lanes past the end read nothing on a GPU.
  tokens = plgpu.load(tokens_ref.at[slots], mask=slot_ok, other=0)
  tokens = common.wrap_once(tokens, vocab_rows)
  ok = (slot_ok & (apply_ref[0] != 0) & (tokens >= 0)
        & (tokens < vocab_rows))
  # Per-row masking on 1-D vectors: skipped lanes address row 0 / slot 0
  # (in range) and are masked.
  rows = jnp.where(ok, tokens, 0)
  slots = jnp.where(ok, slots, 0)
  step = step_ref[0]

  row_sq = plgpu.load(row_sq_ref.at[slots], mask=ok, other=0)
  state = plgpu.load(state_ref.at[rows], mask=ok, other=0)
  last = (None if last_ref is None
          else plgpu.load(last_ref.at[rows], mask=ok, other=0))
  accum, wd, lr_scale = common.adagrad_row_update(
      state, last, row_sq, step, lr_ref[0], hparams)

  def column_block(j, carry):
    cols = j * block_cols + jnp.arange(block_cols)
    mask = ok[:, None]
    if width % block_cols:
      mask = mask & (cols < width)[None, :]
    table_at = rows[:, None] * width + cols[None, :]
    values = plgpu.load(table_ref.at[table_at], mask=mask, other=0)
    grad = plgpu.load(grad_ref.at[slots[:, None] * width + cols[None, :]],
                      mask=mask, other=0)
    new_values = common.adagrad_new_values(
        values.astype(jnp.float32), wd[:, None], lr_scale[:, None], grad,
        table_ref.dtype)
    # Unique tokens: each touched row is written by exactly one lane.
    plgpu.store(table_out.at[common.store_offsets(
        table_at, mask, vocab_rows * width, interpret)], new_values,
                mask=mask)
    return carry

  num_col_blocks = pl.cdiv(width, block_cols)
  if num_col_blocks == 1:
    column_block(0, 0)
  else:
    lax.fori_loop(0, num_col_blocks, column_block, 0)
  # One element per row: these are gathers/scatters by token by nature.
  state_at = common.store_offsets(rows, ok, vocab_rows, interpret)
  plgpu.store(state_out.at[state_at], accum, mask=ok)
  if last_out is not None:
    plgpu.store(last_out.at[state_at],
                jnp.full((block_rows,), step, jnp.int32), mask=ok)


def adagrad_apply(table: jax.Array, row_state: jax.Array,
                  last_step: jax.Array | None, unique_tokens: jax.Array,
                  grad_accum: jax.Array, row_sq: jax.Array, apply, step,
                  learning_rate, *, hparams: AdagradHParams,
                  interpret: bool = False,
                  config: AdagradConfig | None = None):
  """Row-wise Adagrad on the rows of `unique_tokens`, in place.

  Args:
    table: `[V, S]` f32 or bf16 column shard.
    row_state: f32 `[V]` accumulators.
    last_step: int32 `[V]` (lazy mode) or None (eager mode).
    unique_tokens: int32 `[U]`, unique among the valid ones; a negative token
      is wrapped once, any other outside `[0, V)` (fill values) is skipped.
    grad_accum: f32 `[U, S]` summed gradients of the shard's columns.
    row_sq: f32 `[U]` full-width squared row norms (a trailing total slot,
      `[U + 1]`, is ignored).
    apply: bool scalar; when false nothing changes.
    step: int32 scalar (lazy mode's current step).
    learning_rate: f32 scalar.
    hparams: the static `AdagradHParams`.
    interpret: run through the Pallas interpreter.
    config: tile sizes (None fields: the shape heuristic).

  Returns:
    `(table, row_state, last_step)`, `last_step` None in eager mode.
  """
  row_sq = common.check_adagrad_args(table, row_state, last_step,
                                     unique_tokens, grad_accum, row_sq,
                                     hparams)
  vocab_rows, width = table.shape
  (num_unique,) = unique_tokens.shape
  common.check_flat_sizes("adagrad", **{"table shard": table.shape,
                                        "grad_accum": grad_accum.shape})
  if num_unique == 0:
    return table, row_state, last_step
  config = resolve_config(config, num_unique, width)

  # Traced scalars travel as shape-(1,) arrays (bools as int32).
  scalars = (jnp.asarray(apply, jnp.int32).reshape(1),
             jnp.asarray(step, jnp.int32).reshape(1),
             jnp.asarray(learning_rate, jnp.float32).reshape(1))
  state_args = [table.reshape(-1), row_state]
  out_shape = [jax.ShapeDtypeStruct((vocab_rows * width,), table.dtype),
               jax.ShapeDtypeStruct((vocab_rows,), jnp.float32)]
  if hparams.lazy:
    state_args.append(last_step)
    out_shape.append(jax.ShapeDtypeStruct((vocab_rows,), jnp.int32))
  first_state = len(scalars) + 3
  kernel = functools.partial(
      _lazy_kernel if hparams.lazy else _eager_kernel, hparams=hparams,
      num_unique=num_unique,
      vocab_rows=vocab_rows, width=width, block_rows=config.block_rows,
      block_cols=config.block_cols, interpret=interpret)
  with common.quiet_triton_deprecation():
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(pl.cdiv(num_unique, config.block_rows),),
        input_output_aliases={first_state + i: i
                              for i in range(len(state_args))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        name="pallas_emb_adagrad",
    )(*scalars, unique_tokens, grad_accum.reshape(-1), row_sq, *state_args)
  table = outs[0].reshape(vocab_rows, width)
  last_step = outs[2] if hparams.lazy else None
  return table, outs[1], last_step


# --------------------------------------------------------------------------
# Block-size sweep: python -m pallas_emb.kernels.adagrad
# --------------------------------------------------------------------------


def main(argv=None) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels import reference  # pylint: disable=g-import-not-at-top
  from pallas_emb.kernels import sweep  # pylint: disable=g-import-not-at-top

  args = sweep.parse_args("adagrad", argv, rows=10_000_000, tokens=262_144)
  unique = np.unique(sweep.zipf_ids(args.tokens, args.rows, args.zipf,
                                    args.seed))
  hparams = AdagradHParams(eps=1e-8, inv_width=1 / 128, lazy=True,
                           accum_decay_rate=float(np.log(2) / 2500),
                           weight_decay_rate=1e-4)

  def setup(width, dtype, key):
    k1, k2 = jax.random.split(key)
    table = jax.random.normal(k1, (args.rows, width), jnp.float32).astype(
        dtype)
    grad = jax.random.normal(k2, (unique.size, width), jnp.float32)
    row_sq = jnp.sum(jnp.square(grad), axis=1)
    return (table, jnp.zeros((args.rows,), jnp.float32),
            jnp.zeros((args.rows,), jnp.int32),
            jnp.asarray(unique.astype(np.int32)), grad, row_sq)

  def run(config, table, state, last, tokens, grad, row_sq):
    return adagrad_apply(table, state, last, tokens, grad, row_sq, True, 7,
                         0.05, hparams=hparams, interpret=args.interpret,
                         config=config)

  def twin(table, state, last, tokens, grad, row_sq):
    return reference.adagrad_apply(table, state, last, tokens, grad, row_sq,
                                   True, 7, 0.05, hparams=hparams)

  def timer(config, inputs):
    # In place: the table and state are donated and fed back every call.
    fn = jax.jit(lambda st, *a: run(config, *st, *a), donate_argnums=0)
    seconds, _ = sweep.time_donated(
        fn, tuple(jnp.copy(x) for x in inputs[:3]), inputs[3:], args.reps)
    return seconds

  def candidates(width, dtype):
    del dtype
    top = common.next_pow2(width)
    for block_cols in sweep.pow2_down(min(top, 8), min(top, 256)):
      for block_rows in sweep.pow2_down(8, 1024):
        if 128 <= block_rows * block_cols <= 8192:
          for num_warps in (1, 2, 4, 8):
            yield AdagradConfig(block_rows, block_cols, num_warps)

  def bytes_moved(width, dtype):
    return unique.size * width * (2 * jnp.dtype(dtype).itemsize + 4)

  sweep.run_sweep(
      args, setup=setup, run=run, twin=twin, candidates=candidates,
      default=lambda width, dtype: resolve_config(None, unique.size, width),
      bytes_moved=bytes_moved, exact=args.interpret, timer=timer)


if __name__ == "__main__":
  main()
