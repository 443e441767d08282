"""The forward lookup (DESIGN §3) and its dense cotangent."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import validation
from pallas_emb.errors import IdOutOfRangeError
from pallas_emb.kernels import common
from pallas_emb.validation import EmbeddingContext


def serve_rows(ctx: EmbeddingContext, backend: str, table: jax.Array,
               ids_all: jax.Array, config=None) -> jax.Array:
  """Per rank: my columns of the communicator's `[W*T]` ids, exchanged back
  into my tokens' full rows `[T, emb_width]` (`config`: the gather's)."""
  rows = kernels.gather_rows(table, ids_all, backend=backend, config=config)
  return exchange.exchange_rows(ctx, rows)


def dense_table_grad(ctx: EmbeddingContext, table: jax.Array,
                     ids_all: jax.Array, routed: jax.Array) -> jax.Array:
  """Per rank: the dense scatter-add of routed `[W*T, S]` gradients into a
  zero table shard (summed over replicas), in the table's dtype."""
  rows = common.wrap_and_clamp(ids_all, table.shape[0])
  dense = jnp.zeros(table.shape, jnp.float32).at[rows].add(
      routed.astype(jnp.float32))
  if ctx.replica_axis:
    dense = jax.lax.psum(dense, ctx.replica_axis)
  return dense.astype(table.dtype)


def _lookup_per_rank(ctx, backend, config, table, ids):
  ids_all = exchange.all_gather_ids(ctx, ids.reshape(-1))
  return serve_rows(ctx, backend, table, ids_all, config).reshape(
      ids.shape + (-1,))


def _dense_grad_per_rank(ctx, table, ids, cotangent):
  ids_all = exchange.all_gather_ids(ctx, ids.reshape(-1))
  routed = exchange.route_gradients(
      ctx, cotangent.reshape(ctx.tokens_per_rank, ctx.emb_width))
  return dense_table_grad(ctx, table, ids_all, routed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _lookup(ctx, backend, config, table, token_ids):
  fn = functools.partial(_lookup_per_rank, ctx, backend, config)
  return exchange.shard(
      ctx, fn,
      in_specs=(exchange.table_spec(ctx), exchange.token_spec(ctx)),
      out_specs=exchange.token_spec(ctx))(table, token_ids)


def _lookup_fwd(ctx, backend, config, table, token_ids):
  return _lookup(ctx, backend, config, table, token_ids), (table, token_ids)


def _lookup_bwd(ctx, backend, config, residuals, cotangent):
  del backend, config
  table, token_ids = residuals
  table_ct = exchange.shard(
      ctx, functools.partial(_dense_grad_per_rank, ctx),
      in_specs=(exchange.table_spec(ctx), exchange.token_spec(ctx),
                exchange.token_spec(ctx)),
      out_specs=exchange.table_spec(ctx))(table, token_ids, cotangent)
  return table_ct, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def lookup(ctx: EmbeddingContext, table: jax.Array, token_ids: jax.Array, *,
           backend: str | None = None, kernel_config=None) -> jax.Array:
  """Embeddings `token_ids.shape + (emb_width,)` of a column-sharded table.

  A pure copy of `table[ids]` (negative ids wrapped once, then clamped into
  the table), sharded like the ids. Ids may be any integer array-like; they
  are converted to int32 and placed on the context's token sharding.
  Differentiable w.r.t. the table: the cotangent is the dense scatter-add,
  right for any optax optimizer but O(vocab) memory; `apply_gradients` is
  the sparse path. `kernel_config`: a `kernels.KernelConfig` (its gather
  tile; None: the shape heuristic).
  """
  validation.check_table(ctx, table)
  token_ids = validation.as_ids(token_ids)
  validation.check_token_ids(ctx, token_ids)
  backend = validation.resolve_backend(ctx, backend)
  config = kernel_config.gather if kernel_config else None
  return _lookup(ctx, backend, config, exchange.place_table(ctx, table),
                 exchange.place_tokens(ctx, token_ids))


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
