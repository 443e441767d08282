"""The single-table API: one table, one context, as the reference lays it out.

    ctx = pe.make_context(mesh, "x", tokens_per_batch=T, emb_width=D,
                          num_unique=U)
    emb = pe.lookup(ctx, table, ids)                      # ids.shape + (D,)
    dd = pe.dedup(ctx, ids, vocab_rows=V)                 # DedupResult
    table, opt_state, stats = pe.apply_gradients(ctx, opt, table, opt_state,
                                                 emb_grads, dd)

A thin facade over a one-table, one-feature `EmbeddingCollection` (built
once per context and table shape): routing, dedup, wrap/clamp, padding (the
context's `padding_id` takes no unique slot and gets no gradient), overflow
and the ordering of reads before the in-place write all run the
collection's per-rank code. What is added here: the context's checks
(`tokens_per_batch` ids, a table laid out as the context says) and the
`DedupResult` view of a stack's routing: `unique_tokens [num_unique]` and
one segment id per token, shaped and sharded like the ids.

Column placement only, by design: a row, table or replicated table lives
in an `EmbeddingCollection` (`TableSpec(placement=...)`); a table laid out
as one is refused by `validation.check_table` (docs/placements.md).

`lookup_and_dedup` is the one-all-gather step (the collection's
`lookup_and_route`); it orders the lookup's reads before the update's
write, so a step whose gradients do not read the embeddings (a loss linear
in them) holds no table copy. `lookup` and `dedup` called apart cannot.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_emb import exchange
from pallas_emb import stack
from pallas_emb import validation
from pallas_emb.collection import EmbeddingCollection
from pallas_emb.dedup import FILL_VALUE
from pallas_emb.errors import IdOutOfRangeError
from pallas_emb.errors import InputError
from pallas_emb.errors import UniqueOverflowError
from pallas_emb.specs import FeatureSpec
from pallas_emb.specs import TableSpec
from pallas_emb.state import CollectionState
from pallas_emb.state import StackState
from pallas_emb.update import UPDATE_STATS_SPEC
from pallas_emb.validation import EmbeddingContext

_TABLE = "table"
_FEATURE = "ids"


class DedupResult(NamedTuple):
  """The unique rows of one global batch (a stack's routing, per token).

  unique_tokens: int32 `[num_unique]`, sorted, padded with FILL_VALUE;
    identical on every rank.
  segment_ids: int32, shaped and sharded like the token ids: each token's
    index into unique_tokens; -1 for ids that reach the padding row, ids
    outside the table (after one wrap) and tokens that did not fit (no
    gradient).
  num_distinct: int32 scalar, distinct rows the batch trains.
  num_overflow: int32 scalar, distinct rows that did not fit in num_unique.
  """
  unique_tokens: jax.Array
  segment_ids: jax.Array
  num_distinct: jax.Array
  num_overflow: jax.Array


@functools.lru_cache(maxsize=64)
def _collection(ctx: EmbeddingContext, vocab_rows: int, dtype, optimizer,
                padding_id, backend, kernel_config) -> EmbeddingCollection:
  """The one-table, one-feature collection the context describes."""
  table = TableSpec(_TABLE, vocab_rows, ctx.emb_width, optimizer=optimizer,
                    dtype=dtype, padding_id=padding_id,
                    max_unique=ctx.num_unique)
  return EmbeddingCollection(
      [table], [FeatureSpec(_FEATURE, _TABLE)], ctx.mesh, ctx.table_axis,
      data_axis=ctx.data_axis, replica_axis=ctx.replica_axis,
      backend=backend, kernel_config=kernel_config, dedup="sort")


def _facade(ctx, vocab_rows, dtype=jnp.float32, optimizer=None, *,
            padding_id="ctx", backend=None, kernel_config=None):
  if padding_id == "ctx":
    padding_id = ctx.padding_id
  return _collection(ctx, int(vocab_rows), np.dtype(dtype), optimizer,
                     padding_id, validation.resolve_backend(ctx, backend),
                     kernel_config)


def _state(coll: EmbeddingCollection, table, opt_state=None
           ) -> CollectionState:
  (stack_plan,) = coll.plan.stacks
  return CollectionState({stack_plan.name: StackState(table, opt_state)})


def _ids(ctx: EmbeddingContext, token_ids) -> jax.Array:
  token_ids = validation.as_ids(token_ids)
  validation.check_token_ids(ctx, token_ids)
  return token_ids


# --- lookup --------------------------------------------------------------------


def lookup(ctx: EmbeddingContext, table: jax.Array, token_ids, *,
           backend: str | None = None, kernel_config=None) -> jax.Array:
  """Embeddings `token_ids.shape + (emb_width,)` of a column-sharded table.

  A pure copy of `table[ids]` (negative ids wrapped once, then clamped into
  the table), sharded like the ids. Ids may be any integer array-like; they
  are converted to int32 and placed on the context's token sharding.
  Differentiable w.r.t. the table: the cotangent is the dense scatter-add
  (nothing for the context's padding id and ids outside the table, as in
  the sparse update), right for any optax optimizer but O(vocab) memory;
  `apply_gradients` is the sparse path. `kernel_config`: a
  `pe.KernelConfig` (None: the shape heuristics).
  """
  return lookup_with_padding(ctx, table, token_ids, padding_id=ctx.padding_id,
                             backend=backend, kernel_config=kernel_config)


def lookup_with_padding(ctx: EmbeddingContext, table: jax.Array, token_ids,
                        *, padding_id: int | None, backend=None,
                        kernel_config=None) -> jax.Array:
  """`lookup` with another padding id than the context's (the layers')."""
  validation.check_table(ctx, table)
  token_ids = _ids(ctx, token_ids)
  validation.check_padding_id(padding_id, table.shape[0], "lookup")
  coll = _facade(ctx, table.shape[0], table.dtype, padding_id=padding_id,
                 backend=backend, kernel_config=kernel_config)
  return coll.lookup(_state(coll, table), {_FEATURE: token_ids})[_FEATURE]


# --- dedup ---------------------------------------------------------------------


def _dedup_view(ctx: EmbeddingContext, routing: stack.StackRouting
                ) -> DedupResult:
  """Per rank: a stack's routing as the single-table `DedupResult`: the
  unique rows padded to `num_unique`, this rank's tokens' segments."""
  unique = routing.unique_tokens
  if unique.shape[0] < ctx.num_unique:  # the batch cannot use more
    unique = jnp.concatenate([unique, jnp.full(
        (ctx.num_unique - unique.shape[0],), FILL_VALUE, jnp.int32)])
  t = ctx.tokens_per_rank
  mine = routing.segments
  if ctx.group_size > 1:
    rank = lax.axis_index(exchange.axis_name(ctx.table_axis))
    mine = lax.dynamic_slice_in_dim(mine, rank * t, t)
  return DedupResult(unique, mine, routing.num_distinct, routing.num_overflow)


def _dedup_per_rank(ctx, layout, ids):
  keys_all, weights_all = stack.gather_entries(layout, [ids], [])
  view = _dedup_view(ctx, stack.route(layout, keys_all, weights_all))
  return view._replace(segment_ids=view.segment_ids.reshape(ids.shape))


def _lookup_and_dedup_per_rank(ctx, layout, backend, kernel_config, table,
                               ids):
  keys_all, weights_all = stack.gather_entries(layout, [ids], [])
  (emb,), routing = stack.serve_and_route(layout, backend, table, keys_all,
                                          weights_all, kernel_config)
  view = _dedup_view(ctx, routing)
  return emb, view._replace(segment_ids=view.segment_ids.reshape(ids.shape))


def _dedup_specs(ctx):
  return DedupResult(P(), exchange.token_spec(ctx), P(), P())


def dedup(ctx: EmbeddingContext, token_ids, *,
          vocab_rows: int) -> DedupResult:
  """Unique rows and per-token segment ids of a global batch.

  Args:
    ctx: the layout (its padding_id takes no slot and gets segment -1).
    token_ids: int32 ids, sharded like lookup's input (array-likes are
      converted and placed).
    vocab_rows: rows of the table. Required: negative ids are wrapped once
      first (as lookup does), so `-1` and `vocab_rows - 1` share one unique
      slot; without it they would be two slots updating one row, and one
      gradient would be lost.
  """
  validation.check_positive("vocab_rows", vocab_rows)
  token_ids = _ids(ctx, token_ids)
  coll = _facade(ctx, vocab_rows)
  (layout,) = coll._layouts(((_FEATURE, tuple(token_ids.shape)),))  # pylint: disable=protected-access
  return exchange.shard(
      ctx, functools.partial(_dedup_per_rank, ctx, layout),
      in_specs=(exchange.token_spec(ctx),), out_specs=_dedup_specs(ctx),
  )(exchange.place_tokens(ctx, token_ids))


def lookup_and_dedup(ctx: EmbeddingContext, table: jax.Array, token_ids, *,
                     backend: str | None = None, kernel_config=None
                     ) -> tuple[jax.Array, DedupResult]:
  """`lookup` and `dedup` of the same ids from one all-gather, the dedup
  ordered after the lookup's reads (see the module docstring). Not
  differentiable: pass the embeddings' gradients to `apply_gradients`."""
  validation.check_table(ctx, table)
  token_ids = _ids(ctx, token_ids)
  coll = _facade(ctx, table.shape[0], table.dtype, backend=backend,
                 kernel_config=kernel_config)
  validation.check_runs_on(coll.backend, coll.platform, (table, token_ids),
                           "lookup_and_dedup")
  (layout,) = coll._layouts(((_FEATURE, tuple(token_ids.shape)),))  # pylint: disable=protected-access
  fn = functools.partial(_lookup_and_dedup_per_rank, ctx, layout,
                         coll.backend, kernel_config)
  return exchange.shard(
      ctx, fn,
      in_specs=(exchange.table_spec(ctx), exchange.token_spec(ctx)),
      out_specs=(exchange.token_spec(ctx), _dedup_specs(ctx)),
  )(exchange.place_table(ctx, table), exchange.place_tokens(ctx, token_ids))


def default_num_unique(tokens_per_batch: int, vocab_rows: int) -> int:
  """A num_unique that no batch can overflow."""
  return min(tokens_per_batch, vocab_rows) + 1


def raise_if_overflow(num_overflow, num_distinct, num_unique: int) -> None:
  """Host-side guard: raises if a batch's distinct ids did not all fit.

  Reads the (small) counters back to the host, so call it outside jit.
  """
  num_overflow = int(jax.device_get(num_overflow))
  if num_overflow:
    raise UniqueOverflowError(
        f"pallas_emb batch has {int(jax.device_get(num_distinct))} distinct "
        f"ids but num_unique={num_unique}: the gradients of {num_overflow} "
        "ids would be lost. Raise num_unique in make_context (min("
        "tokens_per_batch, vocab_rows) + 1 never overflows).")


# --- the sparse update ---------------------------------------------------------


def _apply_per_rank(ctx, layout, backend, kernel_config, table, opt_state,
                    grads, segment_ids, unique_tokens, pending, num_overflow):
  segments = exchange.all_gather_ids(ctx, segment_ids.reshape(-1))
  routing = stack.StackRouting(unique_tokens, segments,
                               jnp.zeros((0,), jnp.float32),
                               jnp.int32(0), num_overflow)
  grads = grads.reshape((ctx.tokens_per_rank, ctx.emb_width))
  table, opt_state, stats = stack.update(
      layout, backend, table, opt_state, routing, [grads], pending,
      kernel_config)
  return table, opt_state, stats


def apply_gradients(ctx: EmbeddingContext, opt, table: jax.Array, opt_state,
                    emb_grads: jax.Array, dedup_result: DedupResult, *,
                    pending: bool | jax.Array = True,
                    backend: str | None = None, kernel_config=None):
  """One fused sparse optimizer step.

  Args:
    ctx: the layout.
    opt: the sparse optimizer (e.g. `pe.RowwiseAdagrad`, `pe.Adam`).
    table: `[vocab_rows, emb_width]`, column-sharded.
    opt_state: from `opt.init(ctx, table)`.
    emb_grads: gradients w.r.t. lookup's output, shaped and sharded like it.
    dedup_result: `dedup` (or `lookup_and_dedup`) of the ids looked up.
    pending: apply (True) or skip (False) this update; may be traced.
    backend: one of `validation.BACKENDS` (BUILD.md, "Backends"); None
      picks the fastest measured on the platform.
    kernel_config: `pe.KernelConfig` tile sizes (None: heuristics).

  Returns:
    `(table, opt_state, stats)`. Donate table and opt_state to the jitted
    caller so the rows are updated in place.
  """
  if not hasattr(opt, "update_rows"):
    raise InputError(
        f"pallas_emb opt={opt!r} is not a sparse optimizer; pass one such "
        "as pallas_emb.RowwiseAdagrad(0.05) or pallas_emb.Adam(1e-3).")
  validation.check_table(ctx, table)
  segment_ids = dedup_result.segment_ids
  validation.check_grads(ctx, emb_grads, segment_ids.shape)
  opt.check_state(opt_state, table.shape)
  coll = _facade(ctx, table.shape[0], table.dtype, opt, backend=backend,
                 kernel_config=kernel_config)
  validation.check_runs_on(coll.backend, coll.platform, (table, emb_grads),
                           "apply_gradients")
  (layout,) = coll._layouts(((_FEATURE, tuple(segment_ids.shape)),))  # pylint: disable=protected-access
  tokens = exchange.token_spec(ctx)
  state_spec = opt.state_specs(exchange.table_spec(ctx))
  fn = functools.partial(_apply_per_rank, ctx, layout, coll.backend,
                         kernel_config)
  return exchange.shard(
      ctx, fn,
      in_specs=(exchange.table_spec(ctx), state_spec, tokens, tokens, P(),
                P(), P()),
      out_specs=(exchange.table_spec(ctx), state_spec, UPDATE_STATS_SPEC),
  )(exchange.place_table(ctx, table), opt_state,
    exchange.place_tokens(ctx, emb_grads),
    exchange.place_tokens(ctx, segment_ids), dedup_result.unique_tokens,
    jnp.asarray(pending, bool), dedup_result.num_overflow)


# --- opt-in id checking --------------------------------------------------------


def count_out_of_range(token_ids: jax.Array, vocab_rows: int) -> jax.Array:
  """int32 count of ids that wrap-then-clamp would move (checking mode).

  Ids in [-vocab_rows, 0) wrap once onto a real row and are not counted;
  anything else outside [0, vocab_rows) is clamped by lookup and skipped by
  the update, which is defined but almost always a bug upstream.
  """
  bad = (token_ids < -vocab_rows) | (token_ids >= vocab_rows)
  return jnp.sum(bad, dtype=jnp.int32)


def raise_if_out_of_range(count, vocab_rows: int, what: str = "batch") -> None:
  """Host-side: raises if `count_out_of_range` found any id."""
  count = int(jax.device_get(count))
  if count:
    raise IdOutOfRangeError(
        f"pallas_emb {what} has {count} token ids outside [-{vocab_rows}, "
        f"{vocab_rows}); lookup would clamp them onto row 0 or "
        f"{vocab_rows - 1} and the update would skip them. Hash or remap ids "
        "into the table's range.")
