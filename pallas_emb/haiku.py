"""Haiku layers: `from pallas_emb import haiku as pe_haiku`.

`Embed` is a drop-in for `haiku.Embed` whose table is column-sharded;
`EmbeddingCollection` wraps a `pallas_emb.EmbeddingCollection` as a module
returning `{feature: embeddings}`.

Inside the package `import haiku` still means the real Haiku: imports are
absolute, so this module is only ever `pallas_emb.haiku`.
"""

# Imported as the top-level `haiku`: pallas_emb/ itself is on sys.path.
if __name__ == "haiku":
  raise ImportError(
      "pallas_emb/haiku.py was imported as the top-level module `haiku`, "
      "which means the pallas_emb/ package directory itself is on sys.path "
      "(e.g. a script run as `python pallas_emb/some_binary.py`). Run "
      "programs as modules instead: `python -m examples.train`.")


from typing import Any, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import exchange
from pallas_emb import validation
from pallas_emb.state import CollectionState
from pallas_emb.collection import EmbeddingCollection as Collection
from pallas_emb.state import ServingState
from pallas_emb.state import StackState
from pallas_emb.errors import InputError
from pallas_emb.single_table import lookup_with_padding
from pallas_emb.validation import EmbeddingContext

__all__ = ["Embed", "EmbeddingCollection", "shard_params"]

Array = jax.Array


def _positive_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0


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
    * Ids are converted to int32 by `pallas_emb.validation.as_ids` (an id
      outside int32 raises InputError, or under jit becomes int32 max,
      clamped like any id past the table, never wrapped); a negative id is
      wrapped once, then ids are clamped into `[0, vocab_size - 1]` -- the
      same rows `hk.Embed`'s default ARRAY_INDEX lookup returns, bit for
      bit, for every int32 id.
    * The output is sharded like the ids.
    * `padding_id` (default None, as `hk.Embed`: every id trains): the
      padding row, looked up as usual but given no gradient, whatever id
      reaches it after the wrap and clamp (with 0, also -vocab_size).

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
               padding_id: int | None = None,
               name: str | None = None):
    """Constructs the module.

    Args:
      vocab_size: number of rows of the table.
      embed_dim: embedding width; must equal `ctx.emb_width`.
      ctx: the layout, from `pallas_emb.make_context`.
      w_init: initializer of the table; default `TruncatedNormal()`.
      dtype: dtype of the table (float32 or bfloat16).
      backend: lookup backend (`validation.BACKENDS`); None picks the
        fastest measured on the platform.
      padding_id: the padding row's id, in [-vocab_size, vocab_size): the
        row gets no gradient (None: every id trains).
      name: module name (default "embed").
    """
    super().__init__(name=name)
    if not isinstance(ctx, EmbeddingContext):
      raise InputError(
          "pallas_emb.haiku.Embed ctx must be a pallas_emb.EmbeddingContext; "
          f"got {type(ctx).__name__}. Build one with "
          "pallas_emb.make_context(mesh, table_axis, ...).")
    if not (_positive_int(vocab_size) and _positive_int(embed_dim)):
      raise InputError(
          "pallas_emb.haiku.Embed needs a positive vocab_size and embed_dim; "
          f"got vocab_size={vocab_size!r}, embed_dim={embed_dim!r}.")
    if embed_dim != ctx.emb_width:
      raise InputError(
          f"pallas_emb.haiku.Embed embed_dim={embed_dim} does not match the "
          f"context's emb_width={ctx.emb_width}. Make the context with "
          f"emb_width={embed_dim}, or set embed_dim={ctx.emb_width}.")
    self.vocab_size = vocab_size
    self.embed_dim = embed_dim
    self.ctx = ctx
    self.w_init = w_init or hk.initializers.TruncatedNormal()
    self.dtype = dtype
    self.backend = backend
    validation.check_padding_id(padding_id, vocab_size,
                                "haiku.Embed")
    self.padding_id = padding_id

  def _init(self, shape, dtype):
    return exchange.place(self.w_init(shape, dtype),
                          exchange.table_sharding(self.ctx))

  @property
  def embeddings(self) -> Array:
    return hk.get_parameter("embeddings", [self.vocab_size, self.embed_dim],
                            dtype=self.dtype, init=self._init)

  def __call__(self, ids: Array | Sequence[int]) -> Array:
    """Looks up `ids.shape + (embed_dim,)` embeddings, sharded like the ids."""
    # hk.Embed's sentence (a ValueError too), then how to fix it.
    ids = validation.integer_ids(ids, lambda dtype: (
        "pallas_emb.haiku.Embed's __call__ method must take an array of "
        f"integer dtype but was called with an array of {dtype}; cast the "
        "ids with ids.astype(jnp.int32)."))
    ids = validation.as_ids(ids, "haiku.Embed ids")
    # The layer's padding id (not the context's) gets no gradient.
    return lookup_with_padding(self.ctx, self.embeddings, ids,
                               padding_id=self.padding_id,
                               backend=self.backend)


class EmbeddingCollection(hk.Module):
  """A `pallas_emb.EmbeddingCollection` as a Haiku module.

  `__call__(batch) -> {feature: embeddings}`. Params: one per stack
  (`collection.plan`), named by the stack, placed as the collection places
  the stack (`collection.stack_sharding`: column-sharded, by rows or
  replicated, by its placement) and initialized from each table's own
  initializer. Plain `jax.grad` + optax trains them
  (dense cotangents); for the sparse step build a `CollectionState` with
  `collection.state_from_stacks(params[module_name])` and use
  `pallas_emb.Trainer`.
  """

  def __init__(self, collection: Collection, name: str | None = None):
    super().__init__(name=name)
    if not isinstance(collection, Collection):
      raise InputError(
          f"pallas_emb.haiku.EmbeddingCollection collection is a "
          f"{type(collection).__name__}; expected a "
          "pallas_emb.EmbeddingCollection.")
    self.collection = collection

  def __call__(self, batch, serving: ServingState | None = None
               ) -> dict[str, Array]:
    """`{feature: embeddings}`; with `serving` (`coll.quantize(state,
    dtype)` or a `CollectionState`) the lookup of those tables, reading no
    params (inference on a quantized copy)."""
    coll = self.collection
    if serving is not None:
      if not isinstance(serving, (ServingState, CollectionState)):
        raise InputError(
            f"pallas_emb.haiku.EmbeddingCollection serving is a "
            f"{type(serving).__name__}; expected a ServingState "
            "(collection.quantize(state, dtype)) or a CollectionState.")
      return coll.lookup(serving, batch)
    validation.check_no_host_tables(coll.host_tables, "pallas_emb.haiku")
    stacks = {}
    for stack in coll.plan.stacks:
      shape = [stack.total_rows, stack.emb_width]
      stacks[stack.name] = StackState(hk.get_parameter(
          stack.name, shape, dtype=stack.dtype,
          init=lambda *_, s=stack.name: coll.init_stack(hk.next_rng_key(), s)),
          None)
    return coll.lookup(CollectionState(stacks), batch)


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
    pallas_emb.InputError: when a named module has no "embeddings" param, or
      when no table is found.
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
      raise InputError(
          "pallas_emb.haiku.shard_params found no 'embeddings' param of width "
          f"{ctx.emb_width} (the context's emb_width) in modules "
          f"{sorted(params)}. Pass modules=... to name them.")
  for m in modules:
    if m not in params or "embeddings" not in params[m]:
      raise InputError(
          f"pallas_emb.haiku.shard_params: module {m!r} has no 'embeddings' "
          f"param; modules with params are {sorted(params)}.")
    out[m]["embeddings"] = jax.device_put(params[m]["embeddings"], sharding)
  return out
