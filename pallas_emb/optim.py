"""The fused sparse update of one table (DESIGN §4, §12).

`apply_gradients` routes one batch's embedding gradients to the ranks that
own their columns, sums them per unique row, and has the table's sparse
optimizer (`pallas_emb.optimizers`: RowwiseAdagrad, Adam, ...) update only
those rows of the table and of its state. `update_from_routed` is the part
after the routing, which the collection shares.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_emb.dedup import DedupResult
from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import validation
from pallas_emb.kernels import common
from pallas_emb.errors import InputError
from pallas_emb.optimizers.base import SparseOptimizer
# Re-exported: their home before the optimizer family (DESIGN §12).
from pallas_emb.optimizers.rowwise_adagrad import RowwiseAdagrad  # pylint: disable=unused-import
from pallas_emb.optimizers.rowwise_adagrad import RowwiseAdagradState  # pylint: disable=unused-import
from pallas_emb.validation import EmbeddingContext


class UpdateStats(NamedTuple):
  """norm: f32 full-width gradient norm of the batch.

  valid: int32, 1 if the update was applied (finite norm and pending).
  pending: int32, the pending flag that came in.
  num_overflow: int32, distinct ids that did not fit in num_unique (their
    gradients were not applied; `raise_if_overflow` turns it into an error).
  """
  norm: jax.Array
  valid: jax.Array
  pending: jax.Array
  num_overflow: jax.Array


UPDATE_STATS_SPEC = UpdateStats(P(), P(), P(), P())


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
                       num_overflow, kernel_config=None):
  """DESIGN §4.2-§4.6 on one rank, once the gradients are routed.

  `routed` `[N, S]` holds this rank's columns of the gradient of every token
  of the communicator, `segments` `[N]` each token's unique slot (-1: none).
  """
  grad_accum, row_sq = kernels.segment_sum_rows(
      routed, segments, ctx.num_unique, round_dtype=table.dtype,
      backend=backend,
      config=kernel_config.segment_sum if kernel_config else None)
  return update_from_sums(ctx, opt, backend, table, opt_state, grad_accum,
                          row_sq, unique_tokens, pending, num_overflow,
                          kernel_config)


def update_from_sums(ctx: EmbeddingContext, opt, backend: str, table,
                     opt_state, grad_accum, row_sq, unique_tokens, pending,
                     num_overflow, kernel_config=None):
  """DESIGN §4.3-§4.6 on one rank from this rank's segment sums.

  `grad_accum` f32 `[U, S]` and `row_sq` `[U + 1]` as
  `kernels.segment_sum_rows` returns them for this rank's tokens.
  """
  if ctx.replica_axis:
    # Every replica applies the same update: sum all replicas' rows first.
    grad_accum = _ordered_sum(grad_accum, ctx.replica_axis)
    row_sq = common.row_square_sums(grad_accum, table.dtype)
  if ctx.group_size > 1:
    row_sq = _ordered_sum(row_sq, ctx.table_axis)
  norm = jnp.sqrt(row_sq[ctx.num_unique])
  apply = jnp.isfinite(norm) & pending
  table, opt_state = opt.update_rows(
      table, opt_state, unique_tokens, grad_accum, row_sq[:ctx.num_unique],
      apply, emb_width=ctx.emb_width, backend=backend,
      config=kernel_config.update if kernel_config else None)
  stats = UpdateStats(norm, apply.astype(jnp.int32),
                      pending.astype(jnp.int32), num_overflow)
  return table, opt_state, stats


def _apply_per_rank(ctx, opt, backend, kernel_config, table, opt_state, grads,
                    segment_ids, unique_tokens, pending, num_overflow):
  segments = exchange.all_gather_ids(ctx, segment_ids.reshape(-1))
  routed = exchange.route_gradients(
      ctx, grads.reshape(ctx.tokens_per_rank, ctx.emb_width))
  return update_from_routed(ctx, opt, backend, table, opt_state, routed,
                            segments, unique_tokens, pending, num_overflow,
                            kernel_config)


def apply_gradients(ctx: EmbeddingContext, opt: SparseOptimizer,
                    table: jax.Array, opt_state,
                    emb_grads: jax.Array,
                    dedup_result: DedupResult, *,
                    pending: bool | jax.Array = True,
                    backend: str | None = None,
                    kernel_config=None):
  """One fused sparse optimizer step (DESIGN §4, §12).

  Args:
    ctx: the layout.
    opt: the sparse optimizer (e.g. `RowwiseAdagrad`, `Adam`).
    table: `[vocab_rows, emb_width]`, column-sharded.
    opt_state: from `opt.init`.
    emb_grads: gradients w.r.t. lookup's output, shaped and sharded like it.
    dedup_result: `dedup` of the token ids that were looked up.
    pending: apply (True) or skip (False) this update; may be traced.
    backend: "pallas", "interpret", "xla" or None for the platform default.
    kernel_config: `kernels.KernelConfig` tile sizes (None: heuristics).

  Returns:
    `(table, opt_state, stats)`. Donate table and opt_state to the jitted
    caller so the rows are updated in place.
  """
  validation.check_table(ctx, table)
  validation.check_grads(ctx, emb_grads, dedup_result.segment_ids.shape)
  _check_state(opt, table, opt_state)
  backend = validation.resolve_backend(ctx, backend)
  table = exchange.place_table(ctx, table)
  emb_grads = exchange.place_tokens(ctx, emb_grads)
  tokens = exchange.token_spec(ctx)
  state_spec = opt.state_specs(exchange.table_spec(ctx))
  fn = functools.partial(_apply_per_rank, ctx, opt, backend, kernel_config)
  return exchange.shard(
      ctx, fn,
      in_specs=(exchange.table_spec(ctx), state_spec, tokens, tokens, P(),
                P(), P()),
      out_specs=(exchange.table_spec(ctx), state_spec, UPDATE_STATS_SPEC),
  )(table, opt_state, emb_grads, dedup_result.segment_ids,
    dedup_result.unique_tokens, jnp.asarray(pending, bool),
    dedup_result.num_overflow)


def _check_state(opt, table, opt_state) -> None:
  if not hasattr(opt, "update_rows"):
    raise InputError(
        f"pallas_emb opt={opt!r} is not a sparse optimizer; pass one such "
        "as pallas_emb.RowwiseAdagrad(0.05) or pallas_emb.Adam(1e-3).")
  if hasattr(opt, "check_state"):
    opt.check_state(opt_state, table.shape)
