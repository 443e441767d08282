"""`Embed` for Flax linen, a drop-in for `flax.linen.Embed` (DESIGN §8).

Swapping it in changes one line::

  # embed = nn.Embed(num_embeddings=vocab, features=width)
  embed = pe_flax.Embed(num_embeddings=vocab, features=width, ctx=ctx)

The param is still called `embedding`, has shape `[num_embeddings, features]`
and the same default initializer, so the same init key gives the same values
as `nn.Embed`. What changes is where it lives: its columns are sharded over
`ctx.table_axis` (`pallas_emb.table_sharding(ctx)`), and `__call__` is the
column-sharded `pallas_emb.lookup`.

Sharding follows Flax's own recipe for partitioned params: the param is
created with `nn.with_partitioning(..., (None, ctx.table_axis))`, so it is a
`nn.Partitioned` box in the variables, and `nn.get_partition_spec` /
`nn.get_sharding` give its `P(None, table_axis)`. On top of that the
initializer places its value, so `model.init(...)` -- eager or under
`jax.jit`, with or without `out_shardings` -- already returns the column-
sharded table. `nn.unbox(variables)` gives plain arrays (the same pytree as
`nn.Embed`'s); both forms can be passed to `apply`.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
from flax.linen import dtypes as flax_dtypes
import jax
import jax.numpy as jnp

from pallas_emb import exchange
from pallas_emb.lookup import lookup
from pallas_emb.validation import EmbeddingContext

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

# flax.linen.linear.default_embed_init, spelled out.
default_embed_init = nn.initializers.variance_scaling(
    1.0, "fan_in", "normal", out_axis=0)


def _placed_init(init: Initializer, ctx: EmbeddingContext) -> Initializer:
  def placed(*args, **kwargs):
    value = init(*args, **kwargs)
    if isinstance(value, nn.meta.AxisMetadata):
      raise ValueError(
          "pallas_emb.flax.Embed adds the column partitioning itself; pass "
          "the plain initializer as embedding_init, not one wrapped with "
          "nn.with_partitioning.")
    return exchange.place(value, exchange.table_sharding(ctx))
  return placed


class Embed(nn.Module):
  """Embedding module with a column-sharded table; `nn.Embed`'s convention.

  A parameterized function from integers `[0, num_embeddings)` to
  `features`-dimensional vectors, looked up with `pallas_emb.lookup`.

  Differences from `nn.Embed`:
    * `ctx` (a `pallas_emb.EmbeddingContext`) fixes the layout: its
      `emb_width` must equal `features`, and every call must pass exactly
      `ctx.tokens_per_batch` ids whose leading dimension shards over the
      context's token axes.
    * Ids are cast to int32. Out-of-range ids: `nn.Embed` returns NaN rows
      for ids >= num_embeddings (and for ids < -num_embeddings); this layer
      wraps a negative id once (`id += num_embeddings`) and then clamps into
      `[0, num_embeddings - 1]`, so it always returns a real row. For ids in
      `[-num_embeddings, num_embeddings)` the output is bit-identical to
      `nn.Embed`'s on the same params.
    * The output is sharded like the ids (the context's token sharding).

  Training: plain `jax.grad` works (the table's gradient is the dense
  scatter-add, O(num_embeddings) memory) with any optax optimizer.

  Attributes:
    num_embeddings: number of embeddings / vocab size.
    features: number of feature dimensions for each embedding (= ctx.emb_width).
    ctx: the layout, from `pallas_emb.make_context`.
    dtype: the dtype of the embedding vectors (default: same as embedding).
      The table the lookup reads must be float32 or bfloat16.
    param_dtype: the dtype passed to parameter initializers (default: float32).
    embedding_init: embedding initializer (default: flax's default_embed_init);
      a plain initializer, the column partitioning is added by the layer.
    promote_dtype: as in `nn.Embed`.
    backend: lookup backend ("pallas", "interpret", "xla"); None picks pallas
      on GPU and xla elsewhere.
  """

  num_embeddings: int
  features: int
  ctx: EmbeddingContext
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  embedding_init: Initializer = default_embed_init
  promote_dtype: Callable[..., Any] = flax_dtypes.promote_dtype
  backend: str | None = None

  def setup(self):
    if not isinstance(self.ctx, EmbeddingContext):
      raise TypeError(
          "pallas_emb.flax.Embed ctx must be a pallas_emb.EmbeddingContext; "
          f"got {type(self.ctx).__name__}. Build one with "
          "pallas_emb.make_context(mesh, table_axis, ...).")
    if self.features != self.ctx.emb_width:
      raise ValueError(
          f"pallas_emb.flax.Embed features={self.features} does not match "
          f"the context's emb_width={self.ctx.emb_width}. Make the context "
          f"with emb_width={self.features}, or set features="
          f"{self.ctx.emb_width}.")
    init = nn.with_partitioning(
        _placed_init(self.embedding_init, self.ctx),
        (None, self.ctx.table_axis))
    self.embedding = self.param(
        "embedding", init, (self.num_embeddings, self.features),
        self.param_dtype)

  def __call__(self, inputs: Array) -> Array:
    """Embeds the inputs along a new last dimension.

    Args:
      inputs: integer ids, `ctx.tokens_per_batch` of them; all dimensions
        are batch dimensions, the leading one sharded over the token axes.

    Returns:
      `inputs.shape + (features,)`, sharded like the ids.
    """
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    if inputs.dtype != jnp.int32:
      inputs = inputs.astype(jnp.int32)
    (embedding,) = self.promote_dtype(
        self.embedding, dtype=self.dtype, inexact=False)
    return lookup(self.ctx, embedding, inputs, backend=self.backend)

  def attend(self, query: Array) -> Array:
    """`nn.Embed.attend`: inner products of the queries with every embedding.

    Dense: the result has a last dimension of `num_embeddings`, so this is
    O(num_embeddings) compute and memory per query (the contraction over the
    sharded columns is a reduction over `table_axis`). Meant for tied
    output layers of small vocabularies, not for huge tables.

    Args:
      query: array whose last dimension is `features`.

    Returns:
      `query.shape[:-1] + (num_embeddings,)`.
    """
    query, embedding = self.promote_dtype(
        query, self.embedding, dtype=self.dtype)
    return jnp.dot(query, embedding.T)
