"""`Embed` for Haiku, a drop-in for `haiku.Embed` (DESIGN §8).

Swapping it in changes one line::

  # embed = hk.Embed(vocab_size=vocab, embed_dim=width)
  embed = pe_haiku.Embed(vocab_size=vocab, embed_dim=width, ctx=ctx)

The param is still `<module name>/embeddings` (default module name "embed",
as for `hk.Embed`), shape `[vocab_size, embed_dim]`, default initializer
`hk.initializers.TruncatedNormal()`, so the same init key gives the same
values as `hk.Embed`.

Sharding: Haiku params carry no sharding metadata, so the layer places the
table itself: its initializer puts the value on
`pallas_emb.table_sharding(ctx)`, and `transformed.init(...)` (eager or under
`jax.jit`) returns the embeddings column-sharded. Params that come from
elsewhere (a checkpoint, `hk.Embed`'s init) are placed with
`shard_params(ctx, params)`, i.e.
`jax.device_put(leaf, pallas_emb.table_sharding(ctx))` on each table leaf.
Under `jax.jit` any placement works (the lookup reshards); so does an eager
`apply` with an uncommitted table (e.g. fresh from `hk.Embed`'s init), which
is resharded; an eager `apply` with a table committed to another sharding
raises a clear error.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import haiku as hk
import jax
import jax.numpy as jnp

from pallas_emb import exchange
from pallas_emb.lookup import lookup
from pallas_emb.validation import EmbeddingContext

Array = jax.Array


class Embed(hk.Module):
  """Embedding module with a column-sharded table; `hk.Embed`'s convention.

  Differences from `hk.Embed`:
    * `ctx` (a `pallas_emb.EmbeddingContext`) fixes the layout: its
      `emb_width` must equal `embed_dim`, and every call must pass exactly
      `ctx.tokens_per_batch` ids whose leading dimension shards over the
      context's token axes.
    * No `embedding_matrix`, `lookup_style` or `precision`: the lookup is
      always the column-sharded gather of `pallas_emb.lookup`.
    * `dtype` is the param dtype (float32 or bfloat16); `hk.Embed` always
      makes float32 params.
    * Ids are cast to int32; a negative id is wrapped once, then ids are
      clamped into `[0, vocab_size - 1]` -- the same rows `hk.Embed`'s
      default ARRAY_INDEX lookup returns, bit for bit, for every int32 id.
    * The output is sharded like the ids.

  Training: plain `jax.grad` works (the table's gradient is the dense
  scatter-add, O(vocab_size) memory) with any optax optimizer.
  """

  def __init__(self,
               vocab_size: int,
               embed_dim: int,
               ctx: EmbeddingContext,
               w_init: hk.initializers.Initializer | None = None,
               dtype: Any = jnp.float32,
               backend: str | None = None,
               name: str | None = None):
    """Constructs the module.

    Args:
      vocab_size: number of rows of the table.
      embed_dim: embedding width; must equal `ctx.emb_width`.
      ctx: the layout, from `pallas_emb.make_context`.
      w_init: initializer of the table; default `TruncatedNormal()`.
      dtype: dtype of the table (float32 or bfloat16).
      backend: lookup backend ("pallas", "interpret", "xla"); None picks
        pallas on GPU and xla elsewhere.
      name: module name (default "embed").
    """
    super().__init__(name=name)
    if not isinstance(ctx, EmbeddingContext):
      raise TypeError(
          "pallas_emb.haiku.Embed ctx must be a pallas_emb.EmbeddingContext; "
          f"got {type(ctx).__name__}. Build one with "
          "pallas_emb.make_context(mesh, table_axis, ...).")
    if not vocab_size or not embed_dim:
      raise ValueError(
          "pallas_emb.haiku.Embed needs a positive vocab_size and embed_dim; "
          f"got vocab_size={vocab_size!r}, embed_dim={embed_dim!r}.")
    if embed_dim != ctx.emb_width:
      raise ValueError(
          f"pallas_emb.haiku.Embed embed_dim={embed_dim} does not match the "
          f"context's emb_width={ctx.emb_width}. Make the context with "
          f"emb_width={embed_dim}, or set embed_dim={ctx.emb_width}.")
    self.vocab_size = vocab_size
    self.embed_dim = embed_dim
    self.ctx = ctx
    self.w_init = w_init or hk.initializers.TruncatedNormal()
    self.dtype = dtype
    self.backend = backend

  def _init(self, shape, dtype):
    return exchange.place(self.w_init(shape, dtype), exchange.table_sharding(self.ctx))

  @property
  def embeddings(self) -> Array:
    return hk.get_parameter("embeddings", [self.vocab_size, self.embed_dim],
                            dtype=self.dtype, init=self._init)

  def __call__(self, ids: Array | Sequence[int]) -> Array:
    """Looks up `ids.shape + (embed_dim,)` embeddings, sharded like the ids."""
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError("pallas_emb.haiku.Embed's __call__ method must take an "
                       "array of integer dtype but was called with an array "
                       f"of {ids.dtype}")
    if ids.dtype != jnp.int32:
      ids = ids.astype(jnp.int32)
    return lookup(self.ctx, self.embeddings, ids, backend=self.backend)


def shard_params(ctx: EmbeddingContext, params: hk.Params,
                 modules: str | Sequence[str] | None = None) -> hk.Params:
  """Column-shards the embedding tables of a Haiku params dict.

  Places `params[m]["embeddings"]` with
  `jax.device_put(..., pallas_emb.table_sharding(ctx))` for every module name
  m in `modules`, or, when `modules` is None, for every module whose
  "embeddings" param is a `[rows, ctx.emb_width]` matrix. Other params are
  returned as they are. Use it on params that did not come from this
  layer's init (checkpoints, `hk.Embed`'s init); they must be concrete
  arrays, not tracers.

  Raises:
    ValueError: when a named module has no "embeddings" param, or when no
      table is found.
  """
  if isinstance(modules, str):
    modules = (modules,)
  sharding = exchange.table_sharding(ctx)
  out = {m: dict(p) for m, p in params.items()}
  if modules is None:
    modules = [m for m, p in params.items()
               if "embeddings" in p and jnp.ndim(p["embeddings"]) == 2
               and jnp.shape(p["embeddings"])[1] == ctx.emb_width]
    if not modules:
      raise ValueError(
          "pallas_emb.haiku.shard_params found no 'embeddings' param of width "
          f"{ctx.emb_width} (the context's emb_width) in modules "
          f"{sorted(params)}. Pass modules=... to name them.")
  for m in modules:
    if m not in params or "embeddings" not in params[m]:
      raise ValueError(
          f"pallas_emb.haiku.shard_params: module {m!r} has no 'embeddings' "
          f"param; modules with params are {sorted(params)}.")
    out[m]["embeddings"] = jax.device_put(params[m]["embeddings"], sharding)
  return out
