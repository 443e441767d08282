"""Flax linen layers and their sparse trainer.

    from pallas_emb import flax as pe_flax

`Embed` is a drop-in for `flax.linen.Embed` whose table is column-sharded;
`EmbeddingCollection` wraps a `pallas_emb.EmbeddingCollection` as a module
returning `{feature: embeddings}`; `FlaxTrainer` trains a model's tables
with the fused sparse update through the pipelined `pallas_emb.Trainer` and
every other param with any optax optimizer.

How the trainer feeds the layers: it looks the tables up itself (one step
early when pipelined) and passes the embeddings in the variable collection
`LOOKUPS` (`{"pallas_emb_lookups": {<module path>: {"embeddings": ...}}}`);
a layer that finds its embeddings there returns them (in its own dtype) and
never creates or reads its table param. Each layer also records its calls
(and an Embed its padding_id) in the mutable collection `CALLS`, so the
trainer can insist that every table is looked up exactly once per forward
pass, that no `Embed` outside the collection looks itself up, and that an
Embed's padding_id is its table's.

Serving: `serving_variables(serving, path)` hands an `EmbeddingCollection`
module a `coll.quantize(...)` state (int8, bf16, f16) or a `CollectionState`
through the variable collection `SERVING`; the module then reads no params
and returns `coll.lookup` of that state:

    model.apply({"params": dense_params,
                 **pe_flax.serving_variables(coll.quantize(state, "int8"),
                                             "embed")}, batch)

Inside the package `import flax` still means the real Flax: imports are
absolute, so this module is only ever `pallas_emb.flax`.
"""

# Imported as the top-level `flax`: pallas_emb/ itself is on sys.path.
if __name__ == "flax":
  raise ImportError(
      "pallas_emb/flax.py was imported as the top-level module `flax`, "
      "which means the pallas_emb/ package directory itself is on sys.path "
      "(e.g. a script run as `python pallas_emb/some_binary.py`). Run "
      "programs as modules instead: `python -m examples.train`.")

# pylint: disable=g-import-not-at-top,g-bad-import-order
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
from flax import traverse_util
from flax.linen import dtypes as flax_dtypes
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb import exchange
from pallas_emb import pipeline
from pallas_emb import placement as placement_lib
from pallas_emb import validation
from pallas_emb.specs import Bag
from pallas_emb.state import CollectionState
from pallas_emb.collection import EmbeddingCollection as Collection
from pallas_emb.state import ServingState
from pallas_emb.state import StackState
from pallas_emb.specs import default_initializer
from pallas_emb.errors import InputError
from pallas_emb.single_table import lookup_with_padding
from pallas_emb.validation import EmbeddingContext

__all__ = ["Embed", "EmbeddingCollection", "FlaxTrainer", "LOOKUPS",
           "SERVING", "default_embed_init", "serving_variables"]

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

# The variable collections the trainer talks to the layers through.
LOOKUPS = "pallas_emb_lookups"
CALLS = "pallas_emb_calls"
# The collection that hands an EmbeddingCollection module its serving tables.
SERVING = "pallas_emb_serving"


def serving_variables(serving: ServingState | CollectionState,
                      path: str = "embed") -> dict:
  """`{SERVING: ...}` variables that make the `EmbeddingCollection` module
  at `path` ("/"-separated module names, e.g. "encoder/embed") serve
  `serving` (`coll.quantize(state, dtype)` or a `CollectionState`); merge
  them into the variables of `model.apply`."""
  if not isinstance(serving, (ServingState, CollectionState)):
    raise InputError(
        f"pallas_emb.flax.serving_variables got a {type(serving).__name__}; "
        "expected a ServingState (collection.quantize(state, dtype)) or a "
        "CollectionState.")
  return {SERVING: traverse_util.unflatten_dict(
      {tuple(path.split("/")) + ("tables",): serving})}

# flax.linen.linear.default_embed_init, spelled out.
default_embed_init = default_initializer


def _supplied(module: nn.Module):
  """The embeddings the trainer passed to this module, or None."""
  if module.has_variable(LOOKUPS, "embeddings"):
    module.sow(CALLS, "calls", 1)
    return module.get_variable(LOOKUPS, "embeddings")
  if module.is_mutable_collection(CALLS) and not module.is_initializing():
    # Under FlaxTrainer (CALLS mutable) a layer it did not feed is a table
    # the collection does not hold: the trainer names it.
    module.sow(CALLS, "unsupplied", 1)
  return None


def _path(module: nn.Module) -> str:
  return "/".join(str(p) for p in module.path)


def _placed_init(init: Initializer, sharding) -> Initializer:
  def placed(*args, **kwargs):
    value = init(*args, **kwargs)
    if isinstance(value, nn.meta.AxisMetadata):
      raise InputError(
          "pallas_emb.flax layers add the column partitioning themselves; "
          "pass the plain initializer, not one wrapped with "
          "nn.with_partitioning.")
    return exchange.place(value, sharding)
  return placed


class Embed(nn.Module):
  """Embedding module with a column-sharded table; `nn.Embed`'s convention.

  Swapping it in changes one line::

    # embed = nn.Embed(num_embeddings=vocab, features=width)
    embed = pe_flax.Embed(num_embeddings=vocab, features=width, ctx=ctx)

  The param is still `embedding`, `[num_embeddings, features]`, with the same
  default initializer (the same key gives the same values), created with
  `nn.with_partitioning(..., (None, ctx.table_axis))` and placed column-
  sharded. `nn.unbox(variables)` gives `nn.Embed`'s plain pytree.

  Differences from `nn.Embed`:
    * `ctx` (from `pallas_emb.make_context`) fixes the layout: its
      `emb_width` equals `features`, and a call passes `ctx.tokens_per_batch`
      ids whose leading dimension shards over the context's token axes
      (under `FlaxTrainer`, any batch size the collection accepts). The
      context's `padding_id` is not used: the layer's own applies.
    * Out-of-range ids: `nn.Embed` returns NaN rows for ids >=
      num_embeddings; this layer wraps a negative id once and clamps, so it
      always returns a real row. In range the output is bit-identical. An
      id outside int32 (e.g. a uint32 id >= 2**31) raises InputError, or
      under jit becomes int32 max, clamped like any id past the table
      (`pallas_emb.validation.as_ids`), never wrapped.
    * The output is sharded like the ids.
    * `padding_id` (default None, as `nn.Embed`: every id trains): the
      padding row, looked up as usual but given no gradient, whatever id
      reaches it after the wrap and clamp (with 0, also -num_embeddings),
      under plain `jax.grad` and under `FlaxTrainer` (whose TableSpec for
      this layer must have the same padding_id; checked).

  Training: plain `jax.grad` works (dense table gradient, O(num_embeddings)
  memory) with any optax optimizer; `FlaxTrainer` is the sparse path.
  """

  num_embeddings: int
  features: int
  ctx: EmbeddingContext
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  embedding_init: Initializer = default_embed_init
  promote_dtype: Callable[..., Any] = flax_dtypes.promote_dtype
  backend: str | None = None
  padding_id: int | None = None

  def _check(self):
    if not isinstance(self.ctx, EmbeddingContext):
      raise InputError(
          "pallas_emb.flax.Embed ctx must be a pallas_emb.EmbeddingContext; "
          f"got {type(self.ctx).__name__}. Build one with "
          "pallas_emb.make_context(mesh, table_axis, ...).")
    if self.features != self.ctx.emb_width:
      raise InputError(
          f"pallas_emb.flax.Embed features={self.features} does not match "
          f"the context's emb_width={self.ctx.emb_width}. Make the context "
          f"with emb_width={self.features}, or set features="
          f"{self.ctx.emb_width}.")
    validation.check_padding_id(self.padding_id, self.num_embeddings,
                                "flax.Embed")

  def _table(self) -> Array:
    init = nn.with_partitioning(
        _placed_init(self.embedding_init,
                     exchange.table_sharding(self.ctx)),
        (None, self.ctx.table_axis))
    return self.param("embedding", init,
                      (self.num_embeddings, self.features), self.param_dtype)

  def setup(self):
    self._check()
    # Fed by FlaxTrainer: the table lives in the trainer, not in the params.
    if not self.has_variable(LOOKUPS, "embeddings"):
      self.embedding = self._table()

  def __call__(self, inputs: Array) -> Array:
    """`inputs.shape + (features,)` embeddings, sharded like the ids."""
    # nn.Embed's sentence (a ValueError too), then what and how.
    inputs = validation.integer_ids(inputs, lambda dtype: (
        "Input type must be an integer or unsigned integer; "
        f"pallas_emb.flax.Embed got ids of dtype {dtype}. Cast them with "
        "ids.astype(jnp.int32)."))
    supplied = _supplied(self)
    if supplied is not None:
      self.sow(CALLS, "padding_id", self.padding_id)
      expected = tuple(inputs.shape) + (self.features,)
      if tuple(supplied.shape) != expected:
        raise InputError(
            f"pallas_emb.flax.Embed {_path(self)!r} was called with ids of "
            f"shape {tuple(inputs.shape)}, but FlaxTrainer looked up "
            f"embeddings of shape {tuple(supplied.shape)} for it; call the "
            "Embed with its feature's ids from the batch, unchanged.")
      return supplied.astype(self.dtype or self.param_dtype)
    inputs = validation.as_ids(inputs, "flax.Embed ids")
    (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype,
                                      inexact=False)
    # The layer's padding id (not the context's) gets no gradient.
    return lookup_with_padding(self.ctx, embedding, inputs,
                               padding_id=self.padding_id,
                               backend=self.backend)

  def attend(self, query: Array) -> Array:
    """`nn.Embed.attend`: inner products of the queries with every embedding.

    Dense (`[..., num_embeddings]`): meant for tied output layers of small
    vocabularies, not for huge tables. Not under `FlaxTrainer`, which keeps
    the table out of the model's params.
    """
    if self.has_variable(LOOKUPS, "embeddings"):
      raise InputError(
          f"pallas_emb.flax.Embed {_path(self)!r} attend needs the whole "
          "table, which FlaxTrainer keeps out of the model's params; tie the "
          "output layer to a table the dense optimizer trains (nn.Embed), "
          "or call attend outside the trainer on trainer.params(state).")
    query, embedding = self.promote_dtype(query, self.embedding,
                                          dtype=self.dtype)
    return jnp.dot(query, embedding.T)


class EmbeddingCollection(nn.Module):
  """A `pallas_emb.EmbeddingCollection` as a linen module.

  `__call__(batch) -> {feature: embeddings}` (`collection.lookup`). Params:
  one per stack (`collection.plan`), named by the stack, `[total_rows,
  emb_width]`, sharded as the stack's placement says
  (`nn.with_partitioning` names it: `(None, table_axis)` for column) and initialized from each table's own initializer;
  `collection.state_from_stacks(params)` turns them into a
  `CollectionState`. Plain `jax.grad` + optax trains them (dense
  cotangents); `FlaxTrainer` trains them with the sparse step.
  """

  collection: Collection

  @nn.compact
  def __call__(self, batch) -> dict[str, Array]:
    coll = self.collection
    if not isinstance(coll, Collection):
      raise InputError(
          f"pallas_emb.flax.EmbeddingCollection collection is a "
          f"{type(coll).__name__}; expected a pallas_emb.EmbeddingCollection "
          "(build one from TableSpecs and FeatureSpecs).")
    if self.has_variable(SERVING, "tables"):
      serving = self.get_variable(SERVING, "tables")
      if not isinstance(serving, (ServingState, CollectionState)):
        raise InputError(
            f"pallas_emb.flax.EmbeddingCollection {_path(self)!r} got a "
            f"{type(serving).__name__} in its {SERVING!r} variables; "
            "expected a ServingState or CollectionState "
            "(pallas_emb.flax.serving_variables makes them).")
      return coll.lookup(serving, batch)
    validation.check_no_host_tables(coll.host_tables, "pallas_emb.flax")
    supplied = _supplied(self)
    if supplied is not None:
      return self._check_supplied(dict(supplied), batch)
    tables = {}
    for stack in coll.plan.stacks:
      spec = tuple(placement_lib.table_spec(stack, coll.table_axis))
      init = nn.with_partitioning(
          functools.partial(coll.init_stack, stack_name=stack.name),
          spec + (None,) * (2 - len(spec)))
      tables[stack.name] = self.param(stack.name, init)
    state = CollectionState({name: StackState(table, None)
                             for name, table in tables.items()})
    return coll.lookup(state, batch)

  def _check_supplied(self, supplied, batch):
    coll = self.collection
    missing = [f for f in coll.features
               if not isinstance(batch, Mapping) or f not in batch]
    if missing:
      raise InputError(
          f"pallas_emb.flax.EmbeddingCollection {_path(self)!r} was called "
          f"without ids for features {missing}; call it with the batch "
          "FlaxTrainer was given.")
    for name, spec in coll.features.items():
      value = batch[name]
      shape = tuple(jnp.shape(value.ids if isinstance(value, Bag) else value))
      # A pooled feature gives one row per example, a sequence one per id.
      expected = ((shape[:1] if spec.combiner else shape)
                  + (coll.tables[spec.table].emb_width,))
      if tuple(supplied[name].shape) != expected:
        raise InputError(
            f"pallas_emb.flax.EmbeddingCollection {_path(self)!r} was called "
            f"with batch[{name!r}] of shape {shape}, but FlaxTrainer looked "
            f"up embeddings of shape {tuple(supplied[name].shape)} for it; "
            "call the module with the batch's ids, unchanged.")
    return supplied


def module_key(module: nn.Module) -> str:
  """A module's path joined with "/" (how FlaxTrainer names its tables)."""
  return _path(module)


def _flat_params(params) -> dict[tuple[str, ...], Any]:
  if isinstance(params, Mapping) and set(params) == {"params"}:
    params = params["params"]  # accept the whole variables dict too
  return traverse_util.flatten_dict(nn.unbox(dict(params)))


def _embed_path(table: str) -> tuple[str, ...]:
  return tuple(table.split("/")) + ("embedding",)


_UNKNOWN = object()  # FlaxTrainer._home before the model's params are seen


class FlaxTrainer:
  """Sparse-trained tables + optax-trained dense params of a linen model.

  Args:
    model: the linen module; called as `model.apply(variables, batch)`.
    collection: the `pallas_emb.EmbeddingCollection` of its sparse tables.
      Either the model holds one `pe_flax.EmbeddingCollection(collection)`
      module, or every table is a `pe_flax.Embed` whose module path
      ("/"-joined, e.g. "tower/item_embed") is the table's name and which is
      called with the ids of the one feature reading that table (same
      values, same shape: derive ids in the data pipeline, not the model).
    loss: `(outputs, batch) -> (loss, aux)` or `-> loss`.
    dense_optimizer: any optax GradientTransformation for the other params.
    pipelined: the one-step-stale pipelined step (True) or synchronous.
    check_overflow: raise when a capped table overflows (see
      `pallas_emb.Trainer`); True by default.

  Checked when a step is traced: each table's layer is called exactly once
  per forward pass, every `pe_flax.Embed` the model calls is a table of the
  collection, and an Embed's `padding_id` is its TableSpec's.

  On XLA:CPU with several simulated devices, wait for each step (e.g.
  `jax.block_until_ready(metrics.loss)`) before dispatching the next: many
  queued steps can deadlock the in-process collectives (BUILD.md).
  """

  def __init__(self, model: nn.Module, collection: Collection,
               loss: Callable[..., Any], dense_optimizer, *,
               pipelined: bool = True, check_overflow: bool = True):
    if not isinstance(collection, Collection):
      raise InputError(
          f"pallas_emb FlaxTrainer collection is a "
          f"{type(collection).__name__}; expected a "
          "pallas_emb.EmbeddingCollection of the model's tables.")
    self.model = model
    self.collection = collection
    self.loss = loss
    self._table_features = {}
    for feature in collection.features.values():
      self._table_features.setdefault(feature.table, []).append(feature.name)
    self.trainer = pipeline.Trainer(collection, self._loss_fn,
                                    dense_optimizer, pipelined=pipelined,
                                    check_overflow=check_overflow)
    # Where the tables live: the path of the EmbeddingCollection module, or
    # None for Embed layers; found from the params (split) or the model.
    self._home = _UNKNOWN
    # Jitted: eager shard_maps would compile op by op (seconds each).
    self._flush = jax.jit(self.trainer.flush)

  @property
  def pipelined(self) -> bool:
    return self.trainer.pipelined

  # --- where the tables live --------------------------------------------------

  def _find_home(self, flat) -> tuple[str, ...] | None:
    """From the model's (flat) params: the collection module's path, or
    None when every table is an Embed layer (checked)."""
    coll = self.collection
    stacks = [s.name for s in coll.plan.stacks]
    homes = {path[:-1] for path in flat
             if path[-1] in stacks and all(path[:-1] + (s,) in flat
                                           for s in stacks)}
    if len(homes) > 1:
      raise InputError(
          f"pallas_emb FlaxTrainer found the collection's stacks {stacks} "
          f"under several modules {sorted('/'.join(h) for h in homes)}; use "
          "one EmbeddingCollection module per collection.")
    if homes:
      (home,) = homes
      self._home = home
      return home
    for name in coll.tables:
      path = _embed_path(name)
      if path not in flat:
        have = sorted("/".join(p[:-1]) for p in flat if p[-1] == "embedding")
        raise InputError(
            f"pallas_emb FlaxTrainer table {name!r}: params have no "
            f"{'/'.join(path)!r} (Embed params found at {have}) and no "
            f"EmbeddingCollection module with stacks {stacks}. Name each "
            "table after its Embed's module path.")
      features = self._table_features[name]
      if len(features) != 1:
        raise InputError(
            f"pallas_emb FlaxTrainer table {name!r} is an Embed layer read "
            f"by features {features}; an Embed is fed by exactly one feature "
            "(use a pe_flax.EmbeddingCollection module to share tables).")
    self._home = None
    return None

  def _discover(self, batch) -> None:
    """Finds where the tables live from the model's abstract init."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
        batch)
    variables = jax.eval_shape(
        lambda b: self.model.init(jax.random.key(0), b), abstract)
    self._find_home(_flat_params(variables.get("params", {})))

  # --- params ---------------------------------------------------------------

  def split(self, params) -> tuple[CollectionState, Any]:
    """`(collection state with fresh optimizer state, dense params)`."""
    flat = _flat_params(params)
    home = self._find_home(flat)
    coll = self.collection
    if home is not None:
      tables = {s.name: flat.pop(home + (s.name,)) for s in coll.plan.stacks}
      state = coll.state_from_stacks(tables)
    else:
      state = coll.state_from_arrays(
          {name: flat.pop(_embed_path(name)) for name in coll.tables})
    return state, traverse_util.unflatten_dict(flat)

  def params(self, state: pipeline.PipelineState):
    """The flax params tree (unboxed) of a state: dense params + tables.

    In pipelined mode, `flush` first so the last update is in the tables.
    """
    if self._home is _UNKNOWN:
      raise InputError(
          "pallas_emb FlaxTrainer.params does not know yet where the model "
          "keeps its tables; call it after init(params), a step or "
          "apply(state, batch).")
    flat = traverse_util.flatten_dict(dict(state.dense_params))
    embedding = state.embedding
    if self._home is not None:
      plans = {s.name: s for s in self.collection.plan.stacks}
      for name, stack in embedding.stacks.items():
        flat[self._home + (name,)] = placement_lib.as_logical(
            plans[name], stack.table)
    else:
      for name, table in self.collection.table_arrays(embedding).items():
        flat[_embed_path(name)] = table
    return traverse_util.unflatten_dict(flat)

  # --- the model with looked-up embeddings ------------------------------------

  def _lookups(self, embeddings: Mapping[str, Array]):
    """The LOOKUPS variables that hand the embeddings to the layers."""
    if self._home is not None:
      return traverse_util.unflatten_dict(
          {self._home + ("embeddings",): dict(embeddings)})
    flat = {}
    for name in self.collection.tables:
      (feature,) = self._table_features[name]
      flat[tuple(name.split("/")) + ("embeddings",)] = embeddings[feature]
    return traverse_util.unflatten_dict(flat)

  def _check_calls(self, calls) -> None:
    coll = self.collection
    sown = {}
    for path, values in traverse_util.flatten_dict(dict(calls)).items():
      sown.setdefault("/".join(path[:-1]), {})[path[-1]] = values
    unfed = sorted(k for k, v in sown.items() if "unsupplied" in v)
    if unfed:
      raise InputError(
          f"pallas_emb FlaxTrainer: the Embed at {unfed[0]!r} is not a table "
          f"of the collection (tables {list(coll.tables)}); add a "
          f"TableSpec named {unfed[0]!r} and a FeatureSpec for its ids, or "
          "use nn.Embed for a table the dense optimizer trains.")
    expected = (["/".join(self._home)] if self._home is not None
                else list(coll.tables))
    counts = {k: sum(sown.get(k, {}).get("calls", ())) for k in expected}
    wrong = {k: n for k, n in counts.items() if n != 1}
    if wrong:
      raise InputError(
          f"pallas_emb FlaxTrainer: each sparse-trained layer must be called "
          f"exactly once per forward pass; call counts {wrong}. Call each "
          "Embed (or the EmbeddingCollection module) once, with its batch "
          "ids.")
    if self._home is None:
      for name in coll.tables:
        (padding_id,) = sown[name]["padding_id"]
        if padding_id != coll.tables[name].padding_id:
          raise InputError(
              f"pallas_emb FlaxTrainer table {name!r}: its Embed has "
              f"padding_id={padding_id!r} but its TableSpec has padding_id="
              f"{coll.tables[name].padding_id!r}; give both the same "
              "padding_id.")

  def _run(self, dense_params, embeddings, batch):
    if self._home is _UNKNOWN:
      self._discover(batch)
    outputs, calls = self.model.apply(
        {"params": dense_params, LOOKUPS: self._lookups(embeddings)}, batch,
        mutable=[CALLS])
    self._check_calls(calls.get(CALLS, {}))
    return outputs

  def _loss_fn(self, dense_params, embeddings, batch):
    result = self.loss(self._run(dense_params, embeddings, batch), batch)
    if isinstance(result, tuple):
      return result
    return result, None

  def apply(self, state: pipeline.PipelineState, batch):
    """The model's outputs on `batch` with the state's tables (no update).

    A pipelined state's tables lack the staged update: evaluate
    `flush(state)[0]` for the latest tables. Any batch size the collection
    accepts works (its leading dimension divisible by the ranks).
    """
    embeddings = self.collection.lookup(state.embedding, batch)
    return self._run(state.dense_params, embeddings, batch)

  # --- the train step (pallas_emb.Trainer) ------------------------------------

  def init(self, params, first_batch=None) -> pipeline.PipelineState:
    """The initial state from the model's params (pipelined: + first batch).

    The state may share buffers with `params`, and the step donates it:
    pass copies if you still need `params` afterwards.
    """
    embedding, dense = self.split(params)
    return self.init_from(embedding, dense, first_batch)

  def init_from(self, embedding: CollectionState, dense_params,
                first_batch=None) -> pipeline.PipelineState:
    """`pallas_emb.Trainer.init` on an already split state (e.g. restored
    from a checkpoint): the collection state and the dense params.

    Leaves not yet placed (fresh from `model.init`, optimizer counters) are
    replicated on the collection's mesh, where the step leaves them: the
    second step then reuses the first step's compilation.
    """
    replicated = NamedSharding(self.collection.mesh, P())

    def place(x):
      return x if validation.is_committed(x) else jax.device_put(x,
                                                                 replicated)

    state = self.trainer.init(embedding, jax.tree.map(place, dense_params),
                              first_batch)
    return jax.tree.map(place, state)

  def step(self, state: pipeline.PipelineState, batch, next_batch=None):
    """`pallas_emb.Trainer.step`: jit it with `donate_argnums=0`."""
    return self.trainer.step(state, batch, next_batch)

  def flush(self, state: pipeline.PipelineState):
    """`pallas_emb.Trainer.flush`: apply the last staged update (jitted)."""
    return self._flush(state)
