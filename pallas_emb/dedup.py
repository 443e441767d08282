"""Unique tokens of a global batch, with a static size (DESIGN §5)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_emb import exchange
from pallas_emb import validation
from pallas_emb.errors import UniqueOverflowError
from pallas_emb.validation import EmbeddingContext

# Pads unique_tokens; >= any vocab_rows, so the update skips it.
FILL_VALUE = np.iinfo(np.int32).max


class DedupResult(NamedTuple):
  """The unique tokens of one global batch.

  unique_tokens: int32 `[num_unique]`, sorted, padded with FILL_VALUE;
    identical on every rank.
  segment_ids: int32, shaped and sharded like the token ids: each token's
    index into unique_tokens; -1 for the padding id (no gradient) and for
    tokens that did not fit.
  num_distinct: int32 scalar, distinct rows the batch's ids update or pad
    (ids outside the table after one wrap are not counted).
  num_overflow: int32 scalar, distinct ids that did not fit in num_unique.
  """
  unique_tokens: jax.Array
  segment_ids: jax.Array
  num_distinct: jax.Array
  num_overflow: jax.Array


def unique_and_segments(keys: jax.Array, num_unique: int, *,
                        on_cpu: bool = False):
  """Sorted unique keys (padded with FILL_VALUE) and each key's slot.

  `keys` are int32 rows; FILL_VALUE marks a key that takes no slot (and
  gets segment -1). Two formulations, the same results:

  * accelerators: one sort with the positions as payload gives the unique
    list and, through the inverse permutation, every key's slot (no
    searchsorted: a chain of log N small kernels on GPU);
  * `on_cpu`: XLA:CPU sorts a lone int32 array several times faster than
    one with a payload, and its searchsorted is one fused loop, so the keys
    are sorted alone and each finds its slot by binary search.

  Returns `(unique_tokens[num_unique], segment_ids like keys, num_distinct,
  num_overflow)`; keys whose slot is >= num_unique get segment -1 and are
  counted in num_overflow.
  """
  n = keys.shape[0]
  if on_cpu:
    ordered = jnp.sort(keys)
  else:
    ordered, order = lax.sort((keys, lax.iota(jnp.int32, n)), num_keys=1)
  is_first = jnp.concatenate(
      [ordered[:1] != FILL_VALUE, (ordered[1:] != ordered[:-1])
       & (ordered[1:] != FILL_VALUE)])
  slot = jnp.cumsum(is_first, dtype=jnp.int32) - 1
  num_distinct = slot[-1] + 1
  unique_tokens = jnp.full((num_unique,), FILL_VALUE, jnp.int32).at[
      jnp.where(is_first, slot, num_unique)].set(ordered, mode="drop")
  if on_cpu:
    # Every non-FILL key is in `unique_tokens` unless its slot overflowed.
    found = jnp.searchsorted(unique_tokens, keys).astype(jnp.int32)
    keep = (keys != FILL_VALUE) & (found < num_unique) & (
        jnp.take(unique_tokens, found, mode="clip") == keys)
    segment_ids = jnp.where(keep, found, -1)
  else:
    keep = (ordered != FILL_VALUE) & (slot < num_unique)
    segment_ids = jnp.zeros((n,), jnp.int32).at[order].set(
        jnp.where(keep, slot, -1), unique_indices=True)
  num_overflow = jnp.maximum(num_distinct - num_unique, 0)
  return unique_tokens, segment_ids, num_distinct, num_overflow


def on_cpu(ctx: EmbeddingContext) -> bool:
  """Whether the context's devices are CPUs (picks the dedup formulation)."""
  return ctx.mesh.devices.flat[0].platform == "cpu"


def update_keys(ids: jax.Array, vocab_rows: int,
                padding_id: int | None) -> jax.Array:
  """The row each id updates (wrapped once), or FILL_VALUE.

  FILL_VALUE for the padding id and for ids still outside the table after
  the wrap: lookup clamps those onto a real row, but the update skips them.
  """
  rows = jnp.where(ids < 0, ids + vocab_rows, ids)
  ok = (rows >= 0) & (rows < vocab_rows)
  if padding_id is not None:
    ok &= ids != padding_id
  return jnp.where(ok, rows, FILL_VALUE)


def _dedup_per_rank(ctx, vocab_rows, ids):
  local = ids.reshape(-1)
  everyone = local
  if ctx.group_size * ctx.num_replicas > 1:
    everyone = lax.all_gather(
        local, exchange.axis_name(ctx.replica_axis + ctx.table_axis), axis=0,
        tiled=True)
  # An id is wrapped exactly once, as lookup does; what is still outside the
  # table takes no slot (lookup clamps it, the update skips it). The padding
  # id keeps its slot, as in the reference, but gets no gradient.
  unique_tokens, segments, num_distinct, num_overflow = unique_and_segments(
      update_keys(everyone, vocab_rows, None), ctx.num_unique,
      on_cpu=on_cpu(ctx))
  if ctx.padding_id is not None:
    segments = jnp.where(everyone == ctx.padding_id, -1, segments)
  mine = segments
  if ctx.group_size * ctx.num_replicas > 1:
    rank = lax.axis_index(
        exchange.axis_name(ctx.replica_axis + ctx.table_axis))
    mine = lax.dynamic_slice_in_dim(segments, rank * local.shape[0],
                                    local.shape[0])
  return DedupResult(unique_tokens, mine.reshape(ids.shape),
                     num_distinct.astype(jnp.int32),
                     num_overflow.astype(jnp.int32))


def dedup(ctx: EmbeddingContext, token_ids, *,
          vocab_rows: int) -> DedupResult:
  """Unique tokens and per-token segment ids of a global batch.

  Args:
    ctx: the layout (its padding_id gets segment -1).
    token_ids: int32 ids, sharded like lookup's input (array-likes are
      converted and placed).
    vocab_rows: rows of the table. Required: negative ids are wrapped once
      first (as lookup does), so `-1` and `vocab_rows - 1` share one unique
      slot; without it they would be two slots updating one row, and one
      gradient would be lost.
  """
  validation.check_positive("vocab_rows", vocab_rows)
  token_ids = validation.as_ids(token_ids)
  validation.check_token_ids(ctx, token_ids)
  token_ids = exchange.place_tokens(ctx, token_ids)
  fn = functools.partial(_dedup_per_rank, ctx, vocab_rows)
  return exchange.shard(
      ctx, fn, in_specs=(exchange.token_spec(ctx),),
      out_specs=DedupResult(P(), exchange.token_spec(ctx), P(), P()),
  )(token_ids)


def default_num_unique(tokens_per_batch: int, vocab_rows: int) -> int:
  """A num_unique that no batch can overflow (DESIGN §5)."""
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
