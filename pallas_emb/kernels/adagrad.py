"""Pallas (Triton) kernel: the fused sparse row-wise Adagrad update, in place.

One program owns `block_rows` unique slots. For each slot u it wraps the token
once, skips it when the update is not applied or the token is outside the
table (fill values), and otherwise reads `row_state[t]` (and `last_step[t]`
in lazy mode), the `[block_rows, next_pow2(S)]` table tile and the matching
`grad_accum` tile, and writes the updated row, accumulator and step back
(DESIGN §4.5; the arithmetic is `common.adagrad_row_update` /
`common.adagrad_new_values`, shared with the jnp twin).

The table, `row_state` and `last_step` are aliased to the outputs
(`input_output_aliases`): unique tokens are unique, so every touched row is
read and written by exactly one lane of one program and no other row is
written at all. Under donation the update costs O(U * S), not O(V * S).

As in `gather.py` the table is addressed through a flat view (any width), and
masked lanes get out-of-range positive offsets: interpret mode turns a
masked store into a scatter that drops out-of-range writes, but would let an
in-range masked lane overwrite a real row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common
from pallas_emb.kernels.hparams import AdagradHParams


@dataclasses.dataclass(frozen=True)
class AdagradConfig:
  """Tile sizes of the Adagrad kernel (`block_rows` a power of two)."""
  block_rows: int = 16
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
      raise ValueError(f"AdagradConfig.block_rows must be a positive power "
                       f"of two, got {self.block_rows}.")


def _adagrad_kernel(apply_ref, step_ref, lr_ref, tokens_ref, grad_ref,
                    row_sq_ref, table_ref, state_ref, *refs, hparams,
                    num_unique, vocab_rows, width, block_rows, block_cols):
  if hparams.lazy:
    last_ref, table_out, state_out, last_out = refs
  else:
    (table_out, state_out), last_ref, last_out = refs, None, None

  slots = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  slot_ok = slots < num_unique
  tokens = plgpu.load(tokens_ref.at[jnp.where(slot_ok, slots, num_unique)],
                      mask=slot_ok, other=0)
  tokens = common.wrap_once(tokens, vocab_rows)
  ok = (slot_ok & (apply_ref[0] != 0) & (tokens >= 0)
        & (tokens < vocab_rows))
  rows = jnp.where(ok, tokens, vocab_rows)  # out of range when skipped
  step = step_ref[0]

  row_sq = plgpu.load(row_sq_ref.at[jnp.where(ok, slots, num_unique)],
                      mask=ok, other=0)
  state = plgpu.load(state_ref.at[rows], mask=ok, other=0)
  last = (None if last_ref is None
          else plgpu.load(last_ref.at[rows], mask=ok, other=0))
  accum, wd, lr_scale = common.adagrad_row_update(
      state, last, row_sq, step, lr_ref[0], hparams)

  cols = jnp.arange(block_cols)
  tile_ok = ok[:, None] & (cols < width)[None, :]
  table_at = jnp.where(tile_ok, rows[:, None] * width + cols[None, :],
                       vocab_rows * width)
  grad_at = jnp.where(tile_ok, slots[:, None] * width + cols[None, :],
                      num_unique * width)
  values = plgpu.load(table_ref.at[table_at], mask=tile_ok, other=0)
  grad = plgpu.load(grad_ref.at[grad_at], mask=tile_ok, other=0)
  new_values = common.adagrad_new_values(
      values.astype(jnp.float32), wd[:, None], lr_scale[:, None], grad,
      table_ref.dtype)

  plgpu.store(table_out.at[table_at], new_values, mask=tile_ok)
  plgpu.store(state_out.at[rows], accum, mask=ok)
  if last_out is not None:
    plgpu.store(last_out.at[rows], jnp.full((block_rows,), step, jnp.int32),
                mask=ok)


def adagrad_apply(table: jax.Array, row_state: jax.Array,
                  last_step: jax.Array | None, unique_tokens: jax.Array,
                  grad_accum: jax.Array, row_sq: jax.Array, apply, step,
                  learning_rate, *, hparams: AdagradHParams,
                  interpret: bool = False,
                  config: AdagradConfig = AdagradConfig()):
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
    config: tile sizes.

  Returns:
    `(table, row_state, last_step)`, `last_step` None in eager mode.
  """
  row_sq = common.check_adagrad_args(table, row_state, last_step,
                                     unique_tokens, grad_accum, row_sq,
                                     hparams)
  vocab_rows, width = table.shape
  (num_unique,) = unique_tokens.shape
  common.check_flat_size(table, "table shard")
  common.check_flat_size(grad_accum, "grad_accum")

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
      _adagrad_kernel, hparams=hparams, num_unique=num_unique,
      vocab_rows=vocab_rows, width=width, block_rows=config.block_rows,
      block_cols=pl.next_power_of_2(width))
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
