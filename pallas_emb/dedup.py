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
from pallas_emb.validation import EmbeddingContext

# Pads unique_tokens; >= any vocab_rows, so the update skips it.
FILL_VALUE = np.iinfo(np.int32).max
PADDING_ID = 0


class DedupResult(NamedTuple):
  """The unique tokens of one global batch.

  unique_tokens: int32 `[num_unique]`, sorted, padded with FILL_VALUE;
    identical on every rank.
  segment_ids: int32, shaped and sharded like the token ids: each token's
    index into unique_tokens; -1 for the padding id 0 (no gradient) and for
    tokens that did not fit.
  num_distinct: int32 scalar, distinct ids in the batch (padding included).
  num_overflow: int32 scalar, distinct ids that did not fit in num_unique.
  """
  unique_tokens: jax.Array
  segment_ids: jax.Array
  num_distinct: jax.Array
  num_overflow: jax.Array


class UniqueOverflowError(ValueError):
  """A batch had more distinct ids than the context's num_unique."""


def _batch_axes(ctx: EmbeddingContext):
  """All axes the global batch is spread over (replicas included)."""
  axes = ctx.replica_axis + ctx.table_axis
  return axes[0] if len(axes) == 1 else axes


def _dedup_per_rank(ctx, vocab_rows, ids):
  local = ids.reshape(-1)
  if vocab_rows is not None:
    local = jnp.where(local < 0, local + vocab_rows, local)
  everyone = local
  if ctx.group_size * ctx.num_replicas > 1:
    everyone = lax.all_gather(local, _batch_axes(ctx), axis=0, tiled=True)
  ordered = jnp.sort(everyone)
  is_first = jnp.concatenate(
      [jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  slot = jnp.cumsum(is_first) - 1
  num_distinct = slot[-1] + 1
  unique_tokens = jnp.full((ctx.num_unique,), FILL_VALUE, jnp.int32).at[
      jnp.where(is_first, slot, ctx.num_unique)].set(ordered, mode="drop")
  found = jnp.searchsorted(unique_tokens, local).astype(jnp.int32)
  found_ok = jnp.take(unique_tokens, found, mode="clip") == local
  segment_ids = jnp.where(
      (found < ctx.num_unique) & found_ok & (local != PADDING_ID), found, -1)
  num_overflow = jnp.maximum(num_distinct - ctx.num_unique, 0)
  return DedupResult(unique_tokens, segment_ids.reshape(ids.shape),
                     num_distinct.astype(jnp.int32),
                     num_overflow.astype(jnp.int32))


def dedup(ctx: EmbeddingContext, token_ids: jax.Array, *,
          vocab_rows: int | None = None) -> DedupResult:
  """Unique tokens and per-token segment ids of a global batch.

  Args:
    ctx: the layout.
    token_ids: int32 ids, sharded like lookup's input.
    vocab_rows: if given, negative ids are wrapped once first (as lookup
      does), so that `-1` and `vocab_rows - 1` share one unique slot. Pass it
      whenever negative ids can occur.
  """
  validation.check_token_ids(ctx, token_ids)
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
