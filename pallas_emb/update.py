"""The fused sparse update of one stack on one rank.

Once a stack's gradients are routed to the ranks that hold their columns,
`update_from_routed` sums them per unique row (`update_from_sums` takes
sums already made), checks that the step is finite, and has the stack's
sparse optimizer (`pallas_emb.optimizers`) update only those rows of the
table and of its state, in place.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb.kernels import common
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.validation import EmbeddingContext


class UpdateStats(NamedTuple):
  """norm: f32 full-width gradient norm of the batch.

  valid: int32, 1 if the update was applied (finite norm, valid per-step
    scalars such as a schedule's learning rate, and pending).
  pending: int32, the pending flag that came in.
  num_overflow: int32, distinct ids that did not fit in num_unique (their
    gradients were not applied; `raise_if_overflow` turns it into an error).
  """
  norm: jax.Array
  valid: jax.Array
  pending: jax.Array
  num_overflow: jax.Array


UPDATE_STATS_SPEC = UpdateStats(P(), P(), P(), P())

# What `update_from_sums` sums over the communicator (see there).
COLUMNS, ROWS, NONE = "columns", "rows", "none"
MOSAIC = ("mosaic_tpu", "mosaic_tpu_interpret")
# Slots per chunk of `logical_row_sums`.
ROW_SUM_CHUNK = 32768
# A bf16 stack of a power-of-two width: its row norms from the gradients'
# even and odd columns as they are (`common.split_row_square_sums`, the
# same bits), not from the logical columns interleaved again (0.23 ms of a
# v5e bags step against f32's 0.11). On a v5e the 1M x 64 bf16 bags took
# 10.35 ms with it against 10.42 and 10.54 ms without, one run after
# another (`python -m bench.tpu --rows=1000000 --widths=64 --kinds=pooled
# --dtypes=bfloat16 --backends=mosaic_tpu --nodense
# --set=pallas_emb.update.ROW_SUMS_SPLIT=False`, then =True, then =False).
ROW_SUMS_SPLIT = True


def logical_row_sums(grad_accum: jax.Array, width: int, dtype,
                     used=None) -> jax.Array:
  """`common.row_square_sums` of sums in the stored layout's gradient
  columns (`stored.to_grads`), over their logical columns in order (so a
  row's norm has the bits it has on the other backends), `[U + 1]`.

  `used`: the slots at and past it are not read (they may be undefined:
  the Mosaic gradient sums leave them unwritten); their norms are 0. The
  used ones are summed a chunk at a time."""
  num_slots = grad_accum.shape[0]
  if (ROW_SUMS_SPLIT and jnp.dtype(dtype) == jnp.bfloat16 and width >= 2
      and width & (width - 1) == 0):
    offset = stored.high_offset(width, dtype)
    row_sums = lambda g: common.split_row_square_sums(
        g[:, :width // 2], g[:, offset:offset + width // 2], dtype)
  else:
    row_sums = lambda g: common.row_square_sums(
        stored.from_grads(g, width, dtype), dtype)
  if used is None:
    return row_sums(grad_accum)
  if num_slots <= ROW_SUM_CHUNK:
    mask = (jnp.arange(num_slots) < used)[:, None]
    return row_sums(jnp.where(mask, grad_accum, 0.0))

  def body(start, fresh, row_sq):
    del fresh  # A slot's sum is the same each time it is computed.
    chunk = lax.dynamic_slice_in_dim(grad_accum, start, ROW_SUM_CHUNK)
    sums = row_sums(chunk)[:ROW_SUM_CHUNK]
    sums = jnp.where(start + jnp.arange(ROW_SUM_CHUNK) < used, sums, 0.0)
    return lax.dynamic_update_slice_in_dim(row_sq, sums, start, 0)

  row_sq = kernels.xla._over_used_chunks(  # pylint: disable=protected-access
      body, num_slots, used, jnp.zeros((num_slots,), jnp.float32),
      ROW_SUM_CHUNK)
  return jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])


def _ordered_sum(x: jax.Array, axes) -> jax.Array:
  """A psum whose f32 summation order is fixed (rank order).

  An all-reduce's order depends on the collective implementation (in-process,
  gloo, NCCL), so a psum can differ by an ulp between a 1-process and a
  multi-process run; gathering and summing locally gives the same bits
  everywhere, for a payload of only `[ranks, num_unique (+1)]` floats.
  """
  return jnp.sum(lax.all_gather(x, exchange.axis_name(axes), axis=0), axis=0)


def update_from_routed(ctx: EmbeddingContext, opt, backend: str, table,
                       opt_state, routed, segments, unique_tokens, pending,
                       num_overflow, kernel_config=None, norms=COLUMNS):
  """The update on one rank, once the gradients are routed.

  `routed` `[N, S]` holds this rank's columns of the gradient of every token
  of the communicator, `segments` `[N]` each token's unique slot (-1: none).
  """
  grad_accum, row_sq = kernels.segment_sum_rows(
      routed, segments, unique_tokens.shape[0],
      round_dtype=common.logical_dtype(table.dtype), backend=backend,
      config=kernel_config.segment_sum if kernel_config else None)
  return update_from_sums(ctx, opt, backend, table, opt_state, grad_accum,
                          row_sq, unique_tokens, pending, num_overflow,
                          kernel_config, norms)


def update_from_sums(ctx: EmbeddingContext, opt, backend: str, table,
                     opt_state, grad_accum, row_sq, unique_tokens, pending,
                     num_overflow, kernel_config=None, norms=COLUMNS,
                     stored_grads=False, sorted_tokens=False):
  """The update on one rank from this rank's segment sums.

  `grad_accum` f32 `[U, S]` and `row_sq` `[U + 1]` as
  `kernels.segment_sum_rows` returns them for this rank's tokens (or, with
  `stored_grads`, `grad_accum` in the stored layout's gradient columns,
  for a stored table of the Mosaic backend: `stored.to_grads`). `norms`
  says what the communicator adds to them: COLUMNS (a rank holds columns:
  each row's norm is summed over the ranks, full width), ROWS (a rank holds
  whole rows of its own: only the total is summed) or NONE (every rank
  holds every row). The step is applied only where the gradient norm is
  finite and `pending` is true, the same on every rank. `sorted_tokens`:
  `unique_tokens` ascend (the dedup's buffer; `kernels.sparse_update_rows`).
  """
  num_unique = unique_tokens.shape[0]
  dtype = stored.logical_dtype(table) if backend in MOSAIC else (
      common.logical_dtype(table.dtype))
  if (backend in MOSAIC and not stored_grads
      and stored.is_stored(table, grad_accum.shape[1])):
    grad_accum = stored.to_grads(grad_accum, dtype)
    stored_grads = True
  if ctx.replica_axis:
    # Every replica applies the same update: sum all replicas' rows first.
    grad_accum = _ordered_sum(grad_accum, ctx.replica_axis)
    row_sq = (logical_row_sums(grad_accum, ctx.shard_width, dtype)
              if stored_grads else common.row_square_sums(grad_accum, dtype))
  if ctx.group_size > 1 and norms == COLUMNS:
    row_sq = _ordered_sum(row_sq, ctx.table_axis)
  elif ctx.group_size > 1 and norms == ROWS:
    row_sq = row_sq.at[num_unique].set(
        _ordered_sum(row_sq[num_unique], ctx.table_axis))
  norm = jnp.sqrt(row_sq[num_unique])
  apply = (jnp.isfinite(norm) & pending
           & opt.scalars_are_valid(opt_state.step))
  table, opt_state = opt.update_rows(
      table, opt_state, unique_tokens, grad_accum, row_sq[:num_unique],
      apply, emb_width=ctx.emb_width, backend=backend,
      config=kernel_config.update if kernel_config else None,
      sorted_tokens=sorted_tokens)
  stats = UpdateStats(norm, apply.astype(jnp.int32),
                      pending.astype(jnp.int32), num_overflow)
  return table, opt_state, stats
