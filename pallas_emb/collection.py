"""Many tables and features over one exchange per stack (DESIGN §10).

    tables = [pe.TableSpec("items", 10_000_000, 64, optimizer=opt),
              pe.TableSpec("genre", 32, 16, optimizer=opt)]
    features = [pe.FeatureSpec("item_id", table="items"),     # [B]    -> [B, D]
                pe.FeatureSpec("history", table="items"),     # [B, L] -> [B, L, D]
                pe.FeatureSpec("genres", table="genre")]
    coll = pe.EmbeddingCollection(tables, features, mesh, table_axis="x")
    state = coll.init(jax.random.key(0))
    emb = coll.lookup(state, batch)                 # {feature: embeddings}
    state, stats = coll.apply_gradients(state, batch, emb_grads)

Tables with the same (emb_width, dtype, optimizer) are *stacked*: stored as
one column-sharded array, each table at a row offset. Every feature of a
stack goes through one id all-gather, one gather kernel, one all-to-all, and
one dedup + segment-sum + update per step. An id is wrapped and clamped
inside its own table before the offset is added, so it never reaches
another table of its stack.

Per call, everything about the batch's shapes (batch size, sequence
lengths, how many ids each stack carries) is read from the ids and checked
before tracing; the plan (which table is in which stack, where) is fixed at
construction and printable (`coll.plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import zlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import optim
from pallas_emb import stack as stack_lib
from pallas_emb import validation
from pallas_emb.errors import InputError
from pallas_emb.errors import UniqueOverflowError
from pallas_emb.validation import EmbeddingContext

Initializer = Callable[..., jax.Array]

# flax.linen.Embed's default: variance_scaling(1.0, "fan_in", "normal",
# out_axis=0), i.e. N(0, 1 / emb_width) rows.
default_initializer = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "normal", out_axis=0)

COMBINERS = ("sum", "mean", "sqrtn")
MAX_INT32 = np.iinfo(np.int32).max


def _name_ok(name) -> bool:
  return isinstance(name, str) and bool(name)


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One logical embedding table `[vocab_rows, emb_width]`.

  Attributes:
    name: unique name; features refer to it, checkpoints store it.
    vocab_rows: rows (ids `[-vocab_rows, vocab_rows)` are wrapped once,
      then clamped into the table).
    emb_width: columns; must divide evenly over the communicator.
    optimizer: the sparse optimizer of its rows (e.g. `pe.RowwiseAdagrad`).
    dtype: float32 or bfloat16.
    initializer: `(key, shape, dtype) -> array`; default nn.Embed's.
    padding_id: an id that is looked up but never trains (None: none).
    max_unique: cap on the distinct rows of one batch this table may use in
      its stack's unique buffer (default: never overflows); a batch over
      the cap raises `UniqueOverflowError` when its stats are checked.
      `EmbeddingCollection.fit_max_unique` sets it from sample batches.
  """
  name: str
  vocab_rows: int
  emb_width: int
  _: dataclasses.KW_ONLY
  optimizer: Any
  dtype: Any = jnp.float32
  initializer: Initializer = default_initializer
  padding_id: int | None = None
  max_unique: int | None = None

  def __post_init__(self):
    if not _name_ok(self.name):
      raise InputError(f"pallas_emb TableSpec name={self.name!r} must be a "
                       "non-empty string.")
    what = f"TableSpec {self.name!r}"
    for field in ("vocab_rows", "emb_width"):
      validation.check_positive(f"{what} {field}", getattr(self, field))
    if self.vocab_rows > MAX_INT32:
      raise InputError(
          f"pallas_emb {what} vocab_rows={self.vocab_rows} exceeds int32 "
          "ids; split the table or hash ids into a smaller range.")
    try:
      dtype = np.dtype(self.dtype)
    except TypeError as e:
      raise InputError(f"pallas_emb {what} dtype={self.dtype!r} is not a "
                       "dtype; use jnp.float32 or jnp.bfloat16.") from e
    if dtype.name not in validation.TABLE_DTYPES:
      raise InputError(f"pallas_emb {what} dtype={dtype.name}; expected one "
                       f"of {validation.TABLE_DTYPES}.")
    object.__setattr__(self, "dtype", dtype)
    if not hasattr(self.optimizer, "update_rows"):
      raise InputError(
          f"pallas_emb {what} optimizer={self.optimizer!r} is not a sparse "
          "optimizer; pass one such as pallas_emb.RowwiseAdagrad(0.05).")
    if not callable(self.initializer):
      raise InputError(f"pallas_emb {what} initializer must be callable "
                       "(key, shape, dtype) -> array.")
    validation.check_padding_id(self.padding_id)
    if self.max_unique is not None:
      validation.check_positive(f"{what} max_unique", self.max_unique)

  @property
  def stack_key(self):
    """Tables with equal keys share one physical array."""
    return (self.emb_width, self.dtype.name, self.optimizer)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One sparse input feature read from `batch[name]`.

  Attributes:
    name: the batch key of its ids and the key of its embeddings.
    table: the name of the table its ids index.
    combiner: None for a sequence feature (ids of any shape `[B, ...]` give
      `[B, ..., D]`); "sum", "mean" or "sqrtn" pools a bag `[B, L]` into
      `[B, D]`.
    weighted: a pooled feature whose per-id weights are required (from
      `batch[name + "_weights"]` or a `pe.Bag`); any pooled feature may be
      given weights, e.g. the 0/1 padding mask of `pe.pad_ragged`.
  """
  name: str
  table: str
  _: dataclasses.KW_ONLY
  combiner: str | None = None
  weighted: bool = False

  def __post_init__(self):
    if not _name_ok(self.name):
      raise InputError(f"pallas_emb FeatureSpec name={self.name!r} must be "
                       "a non-empty string.")
    if not _name_ok(self.table):
      raise InputError(f"pallas_emb FeatureSpec {self.name!r} table="
                       f"{self.table!r} must name a TableSpec.")
    if self.combiner is not None and self.combiner not in COMBINERS:
      raise InputError(
          f"pallas_emb FeatureSpec {self.name!r} combiner={self.combiner!r}; "
          f"expected None (a sequence feature) or one of {COMBINERS}.")
    if self.weighted and self.combiner is None:
      raise InputError(f"pallas_emb FeatureSpec {self.name!r} weighted=True "
                       "needs a combiner ('sum', 'mean' or 'sqrtn').")


class Bag(NamedTuple):
  """The ids `[B, L]` of a pooled feature, with what marks the real ones.

  weights: f32 `[B, L]` per-id weights (a weighted feature); 0 = padding.
  lengths: int `[B]` valid ids per example (the first `lengths[b]`).
  Without either, the table's padding id (if any) marks the padding.
  """
  ids: Any
  weights: Any = None
  lengths: Any = None


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """Tables stored together as one `[total_rows, emb_width]` array."""
  name: str
  tables: tuple[str, ...]
  row_offsets: tuple[int, ...]
  vocab_rows: tuple[int, ...]
  emb_width: int
  dtype: np.dtype
  optimizer: Any
  features: tuple[str, ...]

  @property
  def total_rows(self) -> int:
    return sum(self.vocab_rows)


@dataclasses.dataclass(frozen=True)
class CollectionPlan:
  """Which table is stored in which stack, at which row offset."""
  stacks: tuple[StackPlan, ...]

  def stack_of(self, table: str) -> tuple[StackPlan, int]:
    """The stack holding `table` and the table's index in it."""
    for stack in self.stacks:
      if table in stack.tables:
        return stack, stack.tables.index(table)
    raise KeyError(table)

  def __str__(self) -> str:
    lines = []
    for s in self.stacks:
      lines.append(
          f"{s.name}: [{s.total_rows}, {s.emb_width}] {s.dtype.name}, "
          f"{type(s.optimizer).__name__}, features {list(s.features)}")
      for table, offset, rows in zip(s.tables, s.row_offsets, s.vocab_rows):
        lines.append(f"  {table}: rows [{offset}, {offset + rows})")
    return "\n".join(lines)


def _make_plan(tables: Sequence[TableSpec],
               features: Sequence[FeatureSpec]) -> CollectionPlan:
  groups: dict[Any, list[TableSpec]] = {}
  for table in tables:
    groups.setdefault(table.stack_key, []).append(table)
  stacks = []
  for i, members in enumerate(groups.values()):
    names = tuple(t.name for t in members)
    rows = tuple(t.vocab_rows for t in members)
    if sum(rows) > MAX_INT32:
      raise InputError(
          f"pallas_emb tables {list(names)} stack into {sum(rows)} rows, "
          "more than int32 row ids address; give one of them another "
          "width, dtype or optimizer so it is stored apart.")
    offsets = tuple(int(o) for o in np.cumsum((0,) + rows[:-1]))
    stacks.append(StackPlan(
        name=f"stack{i}", tables=names, row_offsets=offsets, vocab_rows=rows,
        emb_width=members[0].emb_width, dtype=members[0].dtype,
        optimizer=members[0].optimizer,
        features=tuple(f.name for f in features if f.table in names)))
  return CollectionPlan(tuple(stacks))


class StackState(NamedTuple):
  """The physical array of one stack and its optimizer state."""
  table: jax.Array
  opt_state: Any


class CollectionState(NamedTuple):
  """Everything a collection trains: stack name -> StackState."""
  stacks: dict[str, StackState]


StackRouting = stack_lib.StackRouting


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["stacks"],
                   meta_fields=["shapes", "implicit_weights"])
@dataclasses.dataclass(frozen=True)
class Routing:
  """A looked-up batch's routing, kept for its update (one per stack).

  `shapes` (static) are the ids' shapes per feature, so the update knows
  the batch layout without the batch; `implicit_weights` (static) the
  pooled features whose weights were ones or a lengths mask (see
  `_inputs`), so that the update can skip the weights where every training
  entry weighs 1. Static fields are not saved in a checkpoint;
  a restored routing takes them from the restore target, so build that
  target from batches of the same kind (plain ids or lengths vs per-id
  weights) as the saved run's.
  """
  stacks: dict[str, StackRouting]
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  implicit_weights: tuple[str, ...] = ()


class EmbeddingCollection:
  """Tables and features sharing one exchange per stack (DESIGN §10).

  Args:
    tables: the `TableSpec`s (unique names).
    features: the `FeatureSpec`s (unique names; several may share a table,
      every table is read by at least one).
    mesh: the device mesh.
    table_axis: mesh axis name(s) of the communicator (columns are sharded
      over them).
    data_axis: mesh axis name(s) the batch is sharded over (default:
      table_axis).
    replica_axis: mesh axis name(s) over which whole copies of the tables
      are kept (the batch is sharded over replica_axis + data_axis).
    backend: "pallas", "interpret", "xla" or None (pallas on GPU, else xla).
    kernel_config: tile sizes of the Pallas kernels (`kernels.KernelConfig`;
      None: each kernel's shape heuristic). The Trainer and the layers use
      the collection's.

  Layout rules 1-3 and 5 of DESIGN §2 are checked here; rule 4 (the batch
  shards evenly) at each call, naming the feature.
  """

  def __init__(self, tables: Sequence[TableSpec],
               features: Sequence[FeatureSpec], mesh: jax.sharding.Mesh,
               table_axis: str | Sequence[str], *,
               data_axis: str | Sequence[str] | None = None,
               replica_axis: str | Sequence[str] = (),
               backend: str | None = None,
               kernel_config: kernels.KernelConfig | None = None):
    tables, features = tuple(tables), tuple(features)
    self.table_axis, self.data_axis, self.replica_axis = (
        validation.check_layout(mesh, table_axis, data_axis, replica_axis,
                                "EmbeddingCollection"))
    self.mesh = mesh
    self.group_size = validation.axes_size(mesh, self.table_axis)
    self.num_replicas = validation.axes_size(mesh, self.replica_axis)
    self.backend = validation.resolve_backend(mesh, backend)
    if kernel_config is not None and not isinstance(kernel_config,
                                                    kernels.KernelConfig):
      raise InputError(
          f"pallas_emb EmbeddingCollection kernel_config is a "
          f"{type(kernel_config).__name__}; expected a "
          "pallas_emb.KernelConfig (or None for the shape heuristics).")
    self.kernel_config = kernel_config
    _check_specs(tables, features)
    for table in tables:
      validation.check_width_shards(table.emb_width, self.group_size,
                                    f"table {table.name!r}")
    self.tables = {t.name: t for t in tables}
    self.features = {f.name: f for f in features}
    self.plan = _make_plan(tables, features)
    self._calls_cache = {}

  # --- layout ---------------------------------------------------------------

  @property
  def token_axes(self) -> tuple[str, ...]:
    return self.replica_axis + self.data_axis

  def table_sharding(self) -> NamedSharding:
    """Rows replicated, columns over the communicator."""
    return NamedSharding(self.mesh, P(None, self.table_axis))

  def token_sharding(self) -> NamedSharding:
    """The leading (batch) dimension over the token axes."""
    return NamedSharding(self.mesh, P(self.token_axes))

  def _table_spec(self) -> P:
    return P(None, self.table_axis)

  def _token_spec(self) -> P:
    return P(self.token_axes)

  def _state_specs(self) -> CollectionState:
    return CollectionState({
        s.name: StackState(self._table_spec(),
                           s.optimizer.state_specs(self._table_spec()))
        for s in self.plan.stacks})

  # --- state ----------------------------------------------------------------

  def init(self, key: jax.Array) -> CollectionState:
    """Tables (each from its initializer) and optimizer states, sharded.

    Each table's values depend only on `key` and its name, so adding a
    table or restacking does not change the others.
    """
    return self.state_from_stacks(
        {s.name: self.init_stack(key, s.name) for s in self.plan.stacks})

  def init_stack(self, key: jax.Array, stack_name: str) -> jax.Array:
    """One stack's physical table, each of its tables from its initializer."""
    (stack,) = [s for s in self.plan.stacks if s.name == stack_name]

    def init(key):
      parts = []
      for name in stack.tables:
        spec = self.tables[name]
        table_key = jax.random.fold_in(key, zlib.crc32(name.encode()))
        parts.append(spec.initializer(
            table_key, (spec.vocab_rows, spec.emb_width),
            spec.dtype).astype(spec.dtype))
      return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    return jax.jit(init, out_shardings=self.table_sharding())(key)

  def state_from_stacks(self, tables: Mapping[str, jax.Array]
                        ) -> CollectionState:
    """A state from physical stack tables, with fresh optimizer state."""
    stacks = {s.name: s for s in self.plan.stacks}
    if set(tables) != set(stacks):
      raise InputError(
          f"pallas_emb collection stack tables {sorted(tables)}; expected "
          f"exactly the stacks {sorted(stacks)} of coll.plan.")
    replicated = NamedSharding(self.mesh, P())
    return CollectionState({
        name: StackState(
            tables[name], stack.optimizer.init_state(
                stack.total_rows, replicated, self.table_sharding(),
                emb_width=stack.emb_width))
        for name, stack in stacks.items()})

  def state_from_arrays(self, tables: Mapping[str, jax.Array],
                        opt_states: Mapping[str, Any] | None = None
                        ) -> CollectionState:
    """A state from logical tables (and their optimizer states, else fresh).

    The inverse of `table_arrays` / `optimizer_arrays`; what a checkpoint of
    another stacking, rank count or mesh restores through.
    """
    _check_names(tables, self.tables, "tables")
    if opt_states is not None:
      _check_names(opt_states, self.tables, "opt_states")
    replicated = NamedSharding(self.mesh, P())
    stacks = {}
    for stack in self.plan.stacks:
      arrays = []
      for name in stack.tables:
        spec = self.tables[name]
        array = tables[name]
        validation.check_table_array(array, spec.emb_width,
                                     f"tables[{name!r}]")
        if (array.shape[0] != spec.vocab_rows or
            np.dtype(array.dtype) != spec.dtype):
          raise InputError(
              f"pallas_emb tables[{name!r}] is {np.dtype(array.dtype).name}"
              f"{list(array.shape)}; its TableSpec says {spec.dtype.name}"
              f"[{spec.vocab_rows}, {spec.emb_width}].")
        arrays.append(array)
      table = _concat_rows(arrays, self.table_sharding())
      opt = stack.optimizer
      if opt_states is None:
        opt_state = opt.init_state(stack.total_rows, replicated,
                                   self.table_sharding(),
                                   emb_width=stack.emb_width)
      else:
        opt_state = opt.concat_rows([opt_states[n] for n in stack.tables])
      stacks[stack.name] = StackState(table, opt_state)
    return CollectionState(stacks)

  def table_arrays(self, state: CollectionState) -> dict[str, jax.Array]:
    """`{table name: [vocab_rows, emb_width]}`, column-sharded."""
    _check_state(self, state)
    out = {}
    for name in self.tables:
      stack, i = self.plan.stack_of(name)
      start = stack.row_offsets[i]
      out[name] = state.stacks[stack.name].table[
          start:start + stack.vocab_rows[i]]
    return out

  def optimizer_arrays(self, state: CollectionState) -> dict[str, Any]:
    """`{table name: optimizer state of its rows}`."""
    out = {}
    for name in self.tables:
      stack, i = self.plan.stack_of(name)
      start = stack.row_offsets[i]
      out[name] = stack.optimizer.slice_rows(
          state.stacks[stack.name].opt_state, start,
          start + stack.vocab_rows[i])
    return out

  # --- per-call checks ----------------------------------------------------------

  def _inputs(self, batch: Mapping[str, Any]):
    """`(ids, weights, implicit)`: every feature's ids and every pooled
    feature's combiner input weights, converted and checked (before
    tracing), and the pooled features whose weights are ones or a lengths
    mask (static: `stack.FeatureCall.unit_weights` builds on it)."""
    self._check_per_feature(batch, "batch", "ids",
                            "Give every feature's ids.")
    ids, weights, implicit = {}, {}, []
    for name, spec in self.features.items():
      value = batch[name]
      bag = value if isinstance(value, Bag) else Bag(value)
      if spec.combiner is None and isinstance(value, Bag):
        raise InputError(
            f"pallas_emb batch[{name!r}] is a Bag, but feature {name!r} is a "
            "sequence feature (no combiner); pass its ids as an array.")
      x = validation.as_ids(bag.ids, f"batch[{name!r}]")
      validation.check_leading_dim(x.shape, self.group_size,
                                   self.num_replicas, f"batch[{name!r}]")
      ids[name] = x
      if spec.combiner is not None:
        weights[name], from_mask = _bag_weights(spec, bag, batch, x)
        if from_mask:
          implicit.append(name)
    return ids, weights, tuple(implicit)

  def _check_per_feature(self, mapping, what: str, noun: str, fix: str):
    """`mapping` is a dict with an entry for every feature."""
    if not isinstance(mapping, Mapping):
      raise InputError(
          f"pallas_emb collection {what} is a {type(mapping).__name__}; "
          f"expected a dict {{feature name: {noun}}}.")
    missing = [f for f in self.features if f not in mapping]
    if missing:
      raise InputError(f"pallas_emb collection {what} has no {noun} for "
                       f"features {missing}; it has keys "
                       f"{sorted(map(str, mapping))}. {fix}")

  def _calls(self, shapes: tuple[tuple[str, tuple[int, ...]], ...],
             implicit_weights: tuple[str, ...] = ()
             ) -> tuple[stack_lib.StackCall, ...]:
    """The per-stack layout of a batch with these ids shapes and implicit
    weights (cached)."""
    key = (shapes, implicit_weights)
    if key not in self._calls_cache:
      self._calls_cache[key] = self._make_calls(dict(shapes),
                                                implicit_weights)
    return self._calls_cache[key]

  def _make_calls(self, shapes, implicit_weights
                  ) -> tuple[stack_lib.StackCall, ...]:
    shards = self.group_size * self.num_replicas
    calls = []
    for stack in self.plan.stacks:
      feats, bounds = [], {}
      for name in stack.features:
        spec = self.features[name]
        i = stack.tables.index(spec.table)
        table = self.tables[spec.table]
        feats.append(stack_lib.FeatureCall(
            name=name, row_offset=stack.row_offsets[i],
            vocab_rows=table.vocab_rows, padding_id=table.padding_id,
            shape=tuple(shapes[name]), combiner=spec.combiner,
            local_examples=shapes[name][0] // shards,
            implicit_weights=name in implicit_weights))
        bounds[table.name] = bounds.get(table.name, 0) + math.prod(
            shapes[name])
      # Sequence features first: their ids are gathered, pooled ones pooled.
      feats = ([f for f in feats if not f.pooled] +
               [f for f in feats if f.pooled])
      # A table's distinct rows in one batch are at most its ids and its
      # rows (padding takes no slot): their sum never overflows; a table's
      # max_unique caps its share.
      num_unique = max(1, sum(
          min(count, self.tables[t].vocab_rows,
              self.tables[t].max_unique or count)
          for t, count in bounds.items()))
      rows = sum(f.local_rows for f in feats)
      ctx = EmbeddingContext(
          mesh=self.mesh, table_axis=self.table_axis,
          data_axis=self.data_axis, group_size=self.group_size,
          tokens_per_batch=rows * shards, tokens_per_rank=rows,
          emb_width=stack.emb_width,
          shard_width=stack.emb_width // self.group_size,
          num_unique=num_unique, num_devices_per_node=jax.local_device_count(),
          replica_axis=self.replica_axis, padding_id=None)
      call = stack_lib.StackCall(stack.name, stack.optimizer, ctx,
                                 tuple(feats))
      _check_offsets(call, stack)
      calls.append(call)
    return tuple(calls)

  def _shapes(self, ids: Mapping[str, jax.Array]):
    return tuple((name, tuple(ids[name].shape)) for name in self.features)

  def _placed(self, values: Mapping[str, jax.Array]) -> tuple[jax.Array, ...]:
    return tuple(exchange.place(values[name], self.token_sharding())
                 for name in self.features)

  def _tables(self, state: CollectionState) -> tuple[jax.Array, ...]:
    _check_state(self, state)
    return exchange.place_state(
        tuple(state.stacks[s.name].table for s in self.plan.stacks),
        self._table_specs(), self.mesh, "state table")

  def _stack_states(self, state: CollectionState):
    _check_state(self, state)
    specs = self._state_specs()
    return exchange.place_state(
        tuple(state.stacks[s.name] for s in self.plan.stacks),
        tuple(specs.stacks[s.name] for s in self.plan.stacks), self.mesh,
        "state")

  # --- lookup ---------------------------------------------------------------

  def lookup(self, state: CollectionState, batch: Mapping[str, Any]
             ) -> dict[str, jax.Array]:
    """`{feature: embeddings}`: `ids.shape + (emb_width,)` for a sequence
    feature, `[B, emb_width]` for a pooled one.

    Differentiable w.r.t. the state's tables: the cotangent is the dense
    scatter-add (right for plain `jax.grad` + optax, O(rows) memory) and,
    like the sparse update, gives nothing to padding and to ids outside
    their table; `apply_gradients` is the sparse path.
    """
    ids, weights, implicit = self._inputs(batch)
    calls = self._calls(self._shapes(ids), implicit)
    outs = _collection_lookup(self, calls, self._tables(state),
                              self._placed(ids), self._placed_weights(weights))
    return dict(zip(self.features, outs))

  def lookup_and_route(self, state: CollectionState, batch
                       ) -> tuple[dict[str, jax.Array], Routing]:
    """The embeddings and the routing their update needs, from one all-gather
    of the ids per stack (what the `Trainer` calls)."""
    ids, weights, implicit = self._inputs(batch)
    shapes = self._shapes(ids)
    calls = self._calls(shapes, implicit)
    fn = functools.partial(_lookup_per_rank, self.backend,
                           self.kernel_config, self._order(), calls,
                           route=True)
    outs, routings = exchange.shard(
        calls[0].ctx, fn,
        in_specs=(self._table_specs(), self._feature_specs(),
                  self._pooled_specs()),
        out_specs=(self._feature_specs(), self._routing_specs()),
    )(self._tables(state), self._placed(ids), self._placed_weights(weights))
    return (dict(zip(self.features, outs)),
            Routing(dict(zip((s.name for s in self.plan.stacks), routings)),
                    shapes, implicit))

  def route(self, batch) -> Routing:
    """The routing of a batch alone (its ids' all-gather and dedup)."""
    ids, weights, implicit = self._inputs(batch)
    shapes = self._shapes(ids)
    calls = self._calls(shapes, implicit)
    fn = functools.partial(_route_per_rank, self._order(), calls)
    routings = exchange.shard(
        calls[0].ctx, fn,
        in_specs=(self._feature_specs(), self._pooled_specs()),
        out_specs=self._routing_specs())(self._placed(ids),
                                         self._placed_weights(weights))
    return Routing(dict(zip((s.name for s in self.plan.stacks), routings)),
                   shapes, implicit)

  def _order(self):
    """(feature names, pooled feature names), the orders of the inputs."""
    return (tuple(self.features),
            tuple(n for n, f in self.features.items() if f.combiner))

  def _table_specs(self):
    return tuple(self._table_spec() for _ in self.plan.stacks)

  def _feature_specs(self):
    return tuple(self._token_spec() for _ in self.features)

  def _pooled_specs(self):
    return tuple(self._token_spec() for _ in self._order()[1])

  def _placed_weights(self, weights) -> tuple[jax.Array, ...]:
    return tuple(exchange.place(weights[name], self.token_sharding())
                 for name in self._order()[1])

  def _routing_specs(self):
    tokens = self._token_spec()
    return tuple(stack_lib.StackRouting(P(), tokens, tokens, P(), P())
                 for _ in self.plan.stacks)

  # --- update ---------------------------------------------------------------

  def apply_gradients(self, state: CollectionState, batch_or_routing,
                      emb_grads: Mapping[str, jax.Array], *,
                      pending: bool | jax.Array = True):
    """The fused sparse update of every stack from one batch's gradients.

    Args:
      state: the collection state (donate it to the jitted caller).
      batch_or_routing: the batch that was looked up, or the `Routing`
        `lookup_and_route` returned for it (saves the ids' all-gather).
      emb_grads: `{feature: gradient w.r.t. its embeddings}`.
      pending: apply (True) or skip (False); may be traced.

    Returns:
      `(state, {stack name: UpdateStats})`; check the stats with
      `raise_if_overflow` outside jit.
    """
    _check_state(self, state)
    routing = (batch_or_routing if isinstance(batch_or_routing, Routing)
               else self.route(batch_or_routing))
    calls = self._calls(routing.shapes, routing.implicit_weights)
    grads = self._grads(emb_grads, dict(routing.shapes))
    specs = self._state_specs()
    fn = functools.partial(_apply_per_rank, self.backend,
                           self.kernel_config, tuple(self.features), calls)
    stack_states = self._stack_states(state)
    routings = exchange.place_state(
        tuple(routing.stacks[s.name] for s in self.plan.stacks),
        self._routing_specs(), self.mesh, "routing")
    new_states, stats = exchange.shard(
        calls[0].ctx, fn,
        in_specs=(tuple(specs.stacks[s.name] for s in self.plan.stacks),
                  self._routing_specs(), self._feature_specs(), P()),
        out_specs=(tuple(specs.stacks[s.name] for s in self.plan.stacks),
                   tuple(optim.UPDATE_STATS_SPEC for _ in self.plan.stacks)),
    )(stack_states, routings, self._placed(grads),
      jnp.asarray(pending, bool))
    names = [s.name for s in self.plan.stacks]
    return (CollectionState(dict(zip(names, new_states))),
            dict(zip(names, stats)))

  def _grads(self, emb_grads, shapes) -> dict[str, jax.Array]:
    self._check_per_feature(emb_grads, "emb_grads", "gradient",
                            "Give every feature's (zeros for unused ones).")
    out = {}
    for name, spec in self.features.items():
      width = self.tables[spec.table].emb_width
      rows = shapes[name][:1] if spec.combiner else shapes[name]
      validation.check_grads_array(emb_grads[name], tuple(rows) + (width,),
                                   f"emb_grads[{name!r}]")
      out[name] = emb_grads[name]
    return out

  # --- unique buffers from the stream ------------------------------------------

  def distinct_rows(self, batch: Mapping[str, Any]) -> dict[str, int]:
    """Host-side: `{table: distinct rows one batch trains}`, counted as
    the stack's dedup counts them (ids wrapped once; padding, ids outside
    the table and weight-0 entries take no slot). Reads the ids back."""
    ids, weights, implicit = self._inputs(batch)
    rows = {name: [] for name in self.tables}
    for call in self._calls(self._shapes(ids), implicit):
      for f in call.features:
        keys = np.asarray(jax.device_get(stack_lib.entry_keys(
            f, ids[f.name], weights.get(f.name))))
        rows[self.features[f.name].table].append(keys[keys >= 0])
    return {name: int(np.unique(np.concatenate(r)).size)
            for name, r in rows.items()}

  def fit_max_unique(self, batches: Sequence[Mapping[str, Any]], *,
                     headroom: float = 1.25) -> EmbeddingCollection:
    """This collection with each table's `max_unique` fit to a sample of
    the stream: `headroom` x the most distinct rows of the table in one of
    `batches`, rounded up to a multiple of 8 (a table that had a cap keeps
    the smaller one).

    A stack's unique buffer holds its tables' caps summed; without caps it
    is sized for the worst case (every id distinct), and the zero-fill,
    row norms and update of the step walk all of it. On skewed ids (Zipf)
    a batch touches a fraction of that. Same plan, so the state carries
    over. A later batch with more distinct rows than a cap loses those
    rows' gradients and says so: check the stats with `raise_if_overflow`.
    """
    if (not isinstance(headroom, numbers.Real) or isinstance(headroom, bool)
        or not (np.isfinite(headroom) and headroom >= 1)):
      raise InputError(f"pallas_emb fit_max_unique headroom={headroom!r}; "
                       "expected a finite number >= 1.")
    batches = list(batches)
    if not batches:
      raise InputError("pallas_emb fit_max_unique got no batches; give at "
                       "least one sample batch of the stream.")
    most = {name: 0 for name in self.tables}
    for batch in batches:
      for name, count in self.distinct_rows(batch).items():
        most[name] = max(most[name], count)
    tables = []
    for name, spec in self.tables.items():
      cap = 8 * max(1, math.ceil(headroom * most[name] / 8))
      if spec.max_unique is not None:
        cap = min(cap, spec.max_unique)
      tables.append(dataclasses.replace(spec, max_unique=cap))
    return type(self)(
        tables, tuple(self.features.values()), self.mesh, self.table_axis,
        data_axis=self.data_axis, replica_axis=self.replica_axis,
        backend=self.backend, kernel_config=self.kernel_config)

  def raise_if_overflow(self, stats: Mapping[str, optim.UpdateStats]) -> None:
    """Host-side: raises if a stack's batch had more distinct rows than its
    unique buffer (only possible with `TableSpec.max_unique`)."""
    for stack in self.plan.stacks:
      overflow = int(jax.device_get(stats[stack.name].num_overflow))
      if overflow:
        raise UniqueOverflowError(
            f"pallas_emb {stack.name} (tables {list(stack.tables)}) had "
            f"{overflow} more distinct ids in one batch than its unique "
            "buffer holds; their gradients were not applied. Raise or drop "
            "max_unique of these tables.")


def _check_offsets(call: stack_lib.StackCall, stack: StackPlan) -> None:
  """Flat offsets of the stack's per-rank arrays fit int32 (before tracing)."""
  ctx = call.ctx
  for what, size in (
      ("table shard", stack.total_rows * ctx.shard_width),
      ("gathered rows", ctx.group_size * call.entries * ctx.shard_width),
      ("exchanged rows", ctx.group_size * ctx.tokens_per_rank
       * ctx.shard_width)):
    if size > MAX_INT32:
      raise InputError(
          f"pallas_emb {stack.name} {what} has {size} elements per rank, "
          "more than int32 offsets address; shard over more ranks or use "
          "smaller batches.")


def _check_specs(tables, features) -> None:
  for kind, specs, cls in (("tables", tables, TableSpec),
                           ("features", features, FeatureSpec)):
    if not specs:
      raise InputError(f"pallas_emb EmbeddingCollection needs at least one "
                       f"of {kind}.")
    for spec in specs:
      if not isinstance(spec, cls):
        raise InputError(
            f"pallas_emb EmbeddingCollection {kind} holds a "
            f"{type(spec).__name__}; expected pallas_emb.{cls.__name__}.")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
      raise InputError(f"pallas_emb EmbeddingCollection {kind} names "
                       f"{dupes} more than once; names must be unique.")
  table_names = {t.name for t in tables}
  for f in features:
    if f.table not in table_names:
      raise InputError(
          f"pallas_emb FeatureSpec {f.name!r} reads table {f.table!r}, which "
          f"is not among the tables {sorted(table_names)}.")
  unread = sorted(table_names - {f.table for f in features})
  if unread:
    raise InputError(
        f"pallas_emb EmbeddingCollection tables {unread} are read by no "
        "feature; add a FeatureSpec for each, or drop them.")


def _bag_weights(spec: FeatureSpec, bag: Bag, batch, ids
                 ) -> tuple[jax.Array, bool]:
  """The input weights `[B, L]` of a pooled feature's bags (before tracing),
  and whether they are implicit (ones or a lengths mask: 0 or 1 only).

  From `bag.weights` (e.g. the 0/1 mask of `pe.pad_ragged`), or for a
  weighted feature `batch[name + "_weights"]` (required), else from
  `bag.lengths` (the first lengths[b] ids are real), else ones (the table's
  padding id, if any, is zeroed later, per rank).
  """
  name = spec.name
  if ids.ndim != 2:
    raise InputError(
        f"pallas_emb batch[{name!r}] has shape {tuple(ids.shape)}; pooled "
        f"feature {name!r} ({spec.combiner}) takes bags [batch, max_len]. "
        "Pad ragged bags with pe.pad_ragged.")
  weights = bag.weights
  if weights is None and spec.weighted:
    weights = batch.get(name + "_weights")
    if weights is None:
      raise InputError(
          f"pallas_emb feature {name!r} is weighted but the batch has no "
          f"{name + '_weights'!r} and batch[{name!r}] is not a pe.Bag with "
          "weights; give the per-id weights [batch, max_len].")
  if weights is not None:
    if not hasattr(weights, "shape"):
      weights = np.asarray(weights, np.float32)
    if tuple(weights.shape) != tuple(ids.shape) or not jnp.issubdtype(
        weights.dtype, jnp.floating):
      raise InputError(
          f"pallas_emb weights of feature {name!r} are "
          f"{np.dtype(weights.dtype).name}{list(weights.shape)}; expected "
          f"float weights of the ids' shape {list(ids.shape)}.")
    return jnp.asarray(weights, jnp.float32), False
  if bag.lengths is not None:
    lengths = validation.as_ids(bag.lengths, f"lengths of feature {name!r}")
    if tuple(lengths.shape) != tuple(ids.shape[:1]):
      raise InputError(
          f"pallas_emb lengths of feature {name!r} have shape "
          f"{tuple(lengths.shape)}; expected ({ids.shape[0]},), one per "
          "example.")
    return (jnp.arange(ids.shape[1]) < lengths[:, None]).astype(
        jnp.float32), True
  return jnp.ones(ids.shape, jnp.float32), True


def _check_names(mapping, expected, what) -> None:
  if set(mapping) != set(expected):
    raise InputError(
        f"pallas_emb collection {what} has {sorted(mapping)}; expected "
        f"exactly the tables {sorted(expected)}.")


def _check_state(coll: EmbeddingCollection, state) -> None:
  if not isinstance(state, CollectionState):
    raise InputError(
        f"pallas_emb collection state is a {type(state).__name__}; expected "
        "the CollectionState that coll.init(key) returns.")
  expected = sorted(s.name for s in coll.plan.stacks)
  if sorted(state.stacks) != expected:
    raise InputError(
        f"pallas_emb collection state has stacks {sorted(state.stacks)}; "
        f"this collection's plan has {expected} (a state of another "
        "collection? restore it through table_arrays/state_from_arrays).")
  for stack in coll.plan.stacks:
    table = state.stacks[stack.name].table
    shape = (stack.total_rows, stack.emb_width)
    if tuple(table.shape) != shape or np.dtype(table.dtype) != stack.dtype:
      raise InputError(
          f"pallas_emb collection state {stack.name} table is "
          f"{np.dtype(table.dtype).name}{list(table.shape)}; the plan says "
          f"{stack.dtype.name}{list(shape)}.")


def _concat_rows(arrays, sharding) -> jax.Array:
  if len(arrays) == 1:
    return jax.device_put(arrays[0], sharding)
  return jax.jit(lambda *a: jnp.concatenate(a, axis=0),
                 out_shardings=sharding)(*arrays)


# --- per rank ------------------------------------------------------------------


def _per_stack(coll_order, calls, all_ids, all_weights):
  """Per stack (in plan order): `(call, its features' ids, the combiner
  weights of its pooled features)`, from the collection-ordered inputs."""
  order, pooled_order = coll_order
  ids_by = dict(zip(order, all_ids))
  weights_by = dict(zip(pooled_order, all_weights))
  for call in calls:
    ids = [ids_by[f.name] for f in call.features]
    weights = [stack_lib.combiner_weights(f, ids_by[f.name],
                                          weights_by[f.name])
               for f in call.pooled]
    yield call, ids, weights


def _lookup_per_rank(backend, kernel_config, coll_order, calls, tables,
                     all_ids, all_weights, route):
  """Embeddings of every feature (collection order) [+ each stack's routing]."""
  outs, routings = {}, []
  for (call, ids, weights), table in zip(
      _per_stack(coll_order, calls, all_ids, all_weights), tables):
    keys_all, weights_all = stack_lib.gather_entries(call, ids, weights)
    if route:
      embs, routing = stack_lib.serve_and_route(
          call, backend, table, keys_all, weights_all, kernel_config)
      routings.append(routing)
    else:
      embs = stack_lib.serve(call, backend, table, keys_all, weights_all,
                             kernel_config)
    outs.update(zip((f.name for f in call.features), embs))
  embeddings = tuple(outs[name] for name in coll_order[0])
  return (embeddings, tuple(routings)) if route else embeddings


def _route_per_rank(coll_order, calls, all_ids, all_weights):
  return tuple(
      stack_lib.route(call, *stack_lib.gather_entries(call, ids, weights))
      for call, ids, weights in _per_stack(coll_order, calls, all_ids,
                                           all_weights))


def _by_stack(order, calls, values):
  """Per-feature values (in collection order) grouped per stack."""
  by_name = dict(zip(order, values))
  return [[by_name[f.name] for f in call.features] for call in calls]


def _apply_per_rank(backend, kernel_config, order, calls, states, routings,
                    all_grads, pending):
  new_states, stats = [], []
  for call, state, routing, grads in zip(
      calls, states, routings, _by_stack(order, calls, all_grads)):
    table, opt_state, stack_stats = stack_lib.update(
        call, backend, state.table, state.opt_state, routing, grads, pending,
        kernel_config)
    new_states.append(StackState(table, opt_state))
    stats.append(stack_stats)
  return tuple(new_states), tuple(stats)


def _dense_grads_per_rank(coll_order, calls, tables, all_ids, all_weights,
                          all_cotangents):
  """The dense scatter-add cotangent of every stack table."""
  cts = _by_stack(coll_order[0], calls, all_cotangents)
  return tuple(
      stack_lib.dense_grad(call, table,
                           *stack_lib.gather_entries(call, ids, weights),
                           stack_cts)
      for (call, ids, weights), table, stack_cts in zip(
          _per_stack(coll_order, calls, all_ids, all_weights), tables, cts))


# --- the differentiable lookup ----------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _collection_lookup(coll, calls, tables, all_ids, all_weights):
  fn = functools.partial(_lookup_per_rank, coll.backend, coll.kernel_config,
                         coll._order(), calls, route=False)
  return exchange.shard(
      calls[0].ctx, fn,
      in_specs=(coll._table_specs(), coll._feature_specs(),
                coll._pooled_specs()),
      out_specs=coll._feature_specs())(tables, all_ids, all_weights)


def _collection_lookup_fwd(coll, calls, tables, all_ids, all_weights):
  return (_collection_lookup(coll, calls, tables, all_ids, all_weights),
          (tables, all_ids, all_weights))


def _collection_lookup_bwd(coll, calls, residuals, cotangents):
  tables, all_ids, all_weights = residuals
  fn = functools.partial(_dense_grads_per_rank, coll._order(), calls)
  table_cts = exchange.shard(
      calls[0].ctx, fn,
      in_specs=(coll._table_specs(), coll._feature_specs(),
                coll._pooled_specs(), coll._feature_specs()),
      out_specs=coll._table_specs())(tables, all_ids, all_weights,
                                     tuple(cotangents))
  # No cotangent for the ids; the weights' would need the table (unused).
  return table_cts, None, jax.tree.map(jnp.zeros_like, all_weights)


_collection_lookup.defvjp(_collection_lookup_fwd, _collection_lookup_bwd)
