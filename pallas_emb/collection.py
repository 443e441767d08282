"""Many tables and features over one exchange per stack.

    tables = [pe.TableSpec("items", 10_000_000, 64, optimizer=opt),
              pe.TableSpec("genre", 32, 16, optimizer=opt)]
    features = [pe.FeatureSpec("item_id", table="items"),     # [B]    -> [B, D]
                pe.FeatureSpec("history", table="items"),     # [B, L] -> [B, L, D]
                pe.FeatureSpec("genres", table="genre")]
    coll = pe.EmbeddingCollection(tables, features, mesh, table_axis="x")
    state = coll.init(jax.random.key(0))
    emb = coll.lookup(state, batch)                 # {feature: embeddings}
    state, stats = coll.apply_gradients(state, batch, emb_grads)

The tables are grouped into stacks (`stacking.py`); per call, the batch is read
and checked (`inputs.py`) and laid out per stack (`layout.py`) before
tracing, and one `shard_map` runs every stack's per-rank dataflow
(`per_rank.py`; `stack.py` for column and replicated stacks, `row.py` for
row and table ones, see docs/placements.md). Every feature of a stack goes
through one id exchange, one gather kernel, one exchange of rows, and one
dedup + segment-sum + update per step. An id is wrapped and clamped inside its own table before
the offset is added, so it never reaches another table of its stack.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_emb import cpu_malloc
from pallas_emb import exchange
from pallas_emb import fitting
from pallas_emb import host_batches
from pallas_emb import host_memory
from pallas_emb import host_state
from pallas_emb import host_tier
from pallas_emb import inputs as inputs_lib
from pallas_emb import kernels
from pallas_emb import layout as layout_lib
from pallas_emb import per_rank
from pallas_emb import placement as placement_lib
from pallas_emb import stacking as plan_lib
from pallas_emb import quantize as quantize_lib
from pallas_emb import row as row_lib
from pallas_emb import stack as stack_lib
from pallas_emb import state as state_lib
from pallas_emb import update as update_lib
from pallas_emb import validation
from pallas_emb.errors import InputError
from pallas_emb.errors import UniqueOverflowError
from pallas_emb.specs import FeatureSpec
from pallas_emb.specs import TableSpec
from pallas_emb.state import CollectionState
from pallas_emb.state import Routing
from pallas_emb.state import ServingState
from pallas_emb.state import StackState


class EmbeddingCollection:
  """Tables and features sharing one exchange per stack.

  Args:
    tables: the `TableSpec`s (unique names).
    features: the `FeatureSpec`s (unique names; several may share a table,
      every table is read by at least one).
    mesh: the device mesh.
    table_axis: mesh axis name(s) of the communicator (each table's
      placement says what is sharded over them: columns, rows or tables).
    data_axis: mesh axis name(s) the batch is sharded over (default:
      table_axis).
    replica_axis: mesh axis name(s) over which whole copies of the tables
      are kept, any placement (the batch is sharded over replica_axis +
      data_axis; every update sums all copies' gradients).
    backend: one of `validation.BACKENDS` (BUILD.md, "Backends"); None:
      the fastest measured on the platform, "pallas": its Pallas kernels.
    kernel_config: tile sizes of the Pallas kernels (`kernels.KernelConfig`;
      None: each kernel's shape heuristic). The Trainer and the layers use
      the collection's.
    dedup: how column and replicated stacks find a batch's unique rows:
      "sort", "slot_map" (xla backend only; no sort, through an int32
      `[rows]` map per stack in the state, 4 bytes a row on every rank; the
      same trained values; docs/cpu_performance.md, "Dedup without a
      sort") or None: the platform's faster one (`validation.default_dedup`:
      the slot map on CPU with xla). Row and table stacks always sort.

  Layout rules 1-3 and 5 (validation.py) are checked here; rule 4 (the batch
  shards evenly) at each call, naming the feature.
  """

  def __init__(self, tables: Sequence[TableSpec],
               features: Sequence[FeatureSpec], mesh: jax.sharding.Mesh,
               table_axis: str | Sequence[str], *,
               data_axis: str | Sequence[str] | None = None,
               replica_axis: str | Sequence[str] = (),
               backend: str | None = None,
               kernel_config: kernels.KernelConfig | None = None,
               dedup: str | None = None):
    tables, features = tuple(tables), tuple(features)
    self.table_axis, self.data_axis, self.replica_axis = (
        validation.check_layout(mesh, table_axis, data_axis, replica_axis,
                                "EmbeddingCollection"))
    self.mesh = mesh
    self.group_size = validation.axes_size(mesh, self.table_axis)
    self.num_replicas = validation.axes_size(mesh, self.replica_axis)
    self.backend = validation.resolve_backend(mesh, backend)
    self.platform = platform = mesh.devices.flat[0].platform
    self.dedup = validation.check_dedup(dedup, self.backend,
                                        "EmbeddingCollection", platform)
    if platform == "cpu":
      cpu_malloc.keep_freed_memory()
    if kernel_config is not None and not isinstance(kernel_config,
                                                    kernels.KernelConfig):
      raise InputError(
          f"pallas_emb EmbeddingCollection kernel_config is a "
          f"{type(kernel_config).__name__}; expected a "
          "pallas_emb.KernelConfig (or None for the shape heuristics).")
    self.kernel_config = kernel_config
    plan_lib.check_specs(tables, features)
    for table in tables:
      if table.placement == "column":
        validation.check_width_shards(table.emb_width, self.group_size,
                                      f"table {table.name!r}")
    self.tables = {t.name: t for t in tables}
    self.features = {f.name: f for f in features}
    self.plan = plan_lib.stack_tables(tables, features, self.group_size,
                                      dedup=self.dedup)
    # What a serving copy holds: every stack's rows, a host-tier one's too.
    self.serving_plan = plan_lib.CollectionPlan(tuple(
        dataclasses.replace(s, cache_rows=0) for s in self.plan.stacks))
    self.host_tables = tuple(t.name for t in tables if t.host)
    if self.host_tables and jax.process_count() > 1:
      raise InputError(
          f"pallas_emb host-tier tables {list(self.host_tables)} need a "
          "single-process run (their host memory is this process's); use "
          "storage='device' under jax.distributed.")
    self._layouts_cache = {}

  # --- layout ---------------------------------------------------------------

  @property
  def token_axes(self) -> tuple[str, ...]:
    return self.replica_axis + self.data_axis

  def table_sharding(self) -> NamedSharding:
    """Rows replicated, columns over the communicator: a logical table's
    (`table_arrays`); a stack's physical array has `stack_sharding`."""
    return NamedSharding(self.mesh, P(None, self.table_axis))

  def stack_sharding(self, stack) -> NamedSharding:
    """The sharding of a stack's physical array (by its placement)."""
    return NamedSharding(self.mesh,
                         placement_lib.table_spec(stack, self.table_axis))

  def token_sharding(self) -> NamedSharding:
    """The leading (batch) dimension over the token axes."""
    return NamedSharding(self.mesh, P(self.token_axes))

  def _token_spec(self) -> P:
    return P(self.token_axes)

  def _state_specs(self) -> CollectionState:
    return CollectionState({
        s.name: StackState(placement_lib.table_spec(s, self.table_axis),
                           placement_lib.state_specs(s, self.table_axis),
                           P() if s.slot_map else None,
                           P() if s.host else None)
        for s in self.plan.stacks})

  def _fresh_opt_state(self, stack):
    """A stack's initial optimizer state (None for a looked-up-only one)."""
    return placement_lib.fresh_state(stack, self.mesh, self.table_axis,
                                     self.backend)

  def _fresh_map(self, stack):
    return state_lib.fresh_slot_map(stack, NamedSharding(self.mesh, P()))

  def _maps(self, state: CollectionState | None):
    """Per stack: the slot map its route reads, placed (the state's, else
    a fresh one); None for a stack that sorts."""
    if state is not None:
      self._check_state(state)
    return exchange.place_state(state_lib.route_maps(self.plan, state),
                                self._map_specs(), self.mesh,
                                "state slot map")

  def _map_specs(self):
    return tuple(P() if s.slot_map else None for s in self.plan.stacks)

  def _cache_map_specs(self, cache_maps):
    """The specs of `_cache_maps`' values: the map replicated, the
    entries over the token axes."""
    tokens = self._token_spec()
    return tuple(None if c is None else (
        P(), None if c[1] is None else {f: (tokens, tokens) for f in c[1]})
                 for c in cache_maps)

  def _cache_maps(self, state: CollectionState | None, inputs):
    """Per stack: a host-tier stack's `(cache map, entries)`, placed (the
    entries of its last prefetch, where they are as many as `inputs`' ids
    of each feature; else None, and the step translates through the
    map); None for a device stack."""
    if state is None:
      return (None,) * len(self.plan.stacks)
    self._check_state(state)
    maps = exchange.place_state(
        tuple(state.stacks[s.name].cache_map for s in self.plan.stacks),
        tuple(P() if s.host else None for s in self.plan.stacks), self.mesh,
        "state cache map")
    out = []
    for s, cache_map in zip(self.plan.stacks, maps):
      entries = state.stacks[s.name].cache_entries if s.host else None
      if entries is not None and (set(entries) != set(s.features) or any(
          entries[f][0].size != inputs.ids[f].size for f in s.features)):
        entries = None  # another batch's shape: the map translates
      if entries is not None:
        entries = {f: tuple(exchange.place(x, self.token_sharding())
                            for x in e) for f, e in entries.items()}
      out.append(None if cache_map is None else (cache_map, entries))
    return tuple(out)

  # --- state ----------------------------------------------------------------

  def init(self, key: jax.Array) -> CollectionState:
    """Tables (each from its initializer) and optimizer states, sharded.

    Each table's values depend only on `key` and its name, so adding a
    table or restacking does not change the others. A host-tier table is
    filled in host memory, chunk by chunk (`host_memory.init_table`), after
    a check that the host has the memory for it.
    """
    if self.host_tables:
      host_memory.check_host_memory(self, "coll.init")
      return host_state.collection_state(self, {
          s.name: StackState(self._stored(s, self.init_stack(key, s.name)),
                             self._fresh_opt_state(s), self._fresh_map(s))
          for s in self.plan.stacks if not s.host}, {
              s.name: host_memory.init_table(self.tables[s.tables[0]],
                                           table_key(key, s.tables[0]))
              for s in self.plan.stacks if s.host}, copy=False)
    return self.state_from_stacks(
        {s.name: self.init_stack(key, s.name) for s in self.plan.stacks})

  def init_stack(self, key: jax.Array, stack_name: str) -> jax.Array:
    """One stack's physical table, each of its tables from its initializer."""
    (stack,) = [s for s in self.plan.stacks if s.name == stack_name]
    if stack.host:
      raise InputError(
          f"pallas_emb {stack_name} is a host-tier stack, whose rows live in "
          "host memory; coll.init fills them there.")

    def init(key):
      parts = []
      for name in stack.tables:
        spec = self.tables[name]
        parts.append(spec.initializer(
            table_key(key, name), (spec.vocab_rows, spec.emb_width),
            spec.dtype).astype(spec.dtype))
      return placement_lib.to_physical(stack, parts)

    return jax.jit(init, out_shardings=self.stack_sharding(stack))(key)

  def state_from_stacks(self, tables: Mapping[str, jax.Array]
                        ) -> CollectionState:
    """A state from physical stack tables, with fresh optimizer state."""
    if self.host_tables:
      raise InputError(
          f"pallas_emb state_from_stacks cannot build host-tier tables "
          f"{list(self.host_tables)} (their rows live in host memory); use "
          "coll.init or coll.state_from_arrays.")
    stacks = {s.name: s for s in self.plan.stacks}
    if set(tables) != set(stacks):
      raise InputError(
          f"pallas_emb collection stack tables {sorted(tables)}; expected "
          f"exactly the stacks {sorted(stacks)} of coll.plan.")
    return CollectionState({
        name: StackState(self._stored(stack, tables[name]),
                         self._fresh_opt_state(stack), self._fresh_map(stack))
        for name, stack in stacks.items()}, self.plan.fingerprint)

  def _stored(self, stack, table):
    """A physical table as the state holds it (`placement.storage_dtype`)."""
    return placement_lib.as_storage(stack, self.backend, table)

  def state_from_arrays(self, tables: Mapping[str, jax.Array],
                        opt_states: Mapping[str, Any] | None = None, *,
                        copy: bool = True) -> CollectionState:
    """A state from logical tables (and their optimizer states, else fresh).

    The inverse of `table_arrays` / `optimizer_arrays`; what a checkpoint of
    another stacking, rank count or mesh restores through. A host-tier
    table's arrays (numpy or jax) are copied into host memory; with
    `copy=False` numpy arrays of its dtypes become its host memory as they
    are (no second copy; they change as it trains).
    """
    state_lib.check_names(tables, self.tables, "tables")
    if opt_states is not None:
      state_lib.check_names(opt_states, self.tables, "opt_states")
    if self.host_tables:  # host-tier tables copied into host memory
      host_memory.check_host_memory(self, "state_from_arrays", memory=copy)
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
      if stack.host:  # host memory, below
        continue
      if stack.placement == "column":
        table = placement_lib.concat_rows(arrays, self.table_sharding())
      else:
        table = placement_lib.jitted(placement_lib.to_physical, stack,
                                     self.stack_sharding(stack))(arrays)
      if opt_states is None or stack.optimizer is None:
        opt_state = self._fresh_opt_state(stack)
      elif stack.placement == "column":
        opt_state = stack.optimizer.concat_rows(
            [opt_states[n] for n in stack.tables])
      else:
        shardings = jax.tree.map(
            lambda p: NamedSharding(self.mesh, p),
            placement_lib.state_specs(stack, self.table_axis))
        opt_state = placement_lib.jitted(
            placement_lib.state_to_physical, stack, shardings)(
                [opt_states[n] for n in stack.tables])
      if opt_states is not None and stack.optimizer is not None:
        opt_state = placement_lib.state_as_storage(stack, self.backend,
                                                   opt_state)
      stacks[stack.name] = StackState(self._stored(stack, table), opt_state,
                                      self._fresh_map(stack))
    if self.host_tables:
      host = [s for s in self.plan.stacks if s.host]
      return host_state.collection_state(
          self, stacks, {s.name: tables[s.tables[0]] for s in host},
          opt_states and {s.name: opt_states[s.tables[0]] for s in host},
          copy=copy)
    return CollectionState(stacks, self.plan.fingerprint)

  def table_arrays(self, state: CollectionState) -> dict[str, jax.Array]:
    """`{table name: [vocab_rows, emb_width]}`, column-sharded; a host-tier
    table's a read-only numpy view of its host memory (its changed cache
    rows copied there first; the view follows later steps)."""
    self._check_state(state)
    out = {}
    for stack in self.plan.stacks:
      if stack.host:  # read-only views of host memory
        out[stack.tables[0]] = host_state.logical_arrays(self, state,
                                                        stack)[0]
        continue
      table = placement_lib.as_logical(stack,
                                       state.stacks[stack.name].table)
      if stack.placement == "column":
        parts = placement_lib.from_physical(stack, table)
      else:
        parts = placement_lib.jitted(placement_lib.from_physical, stack,
                                     NamedSharding(self.mesh, P()))(table)
      out.update(zip(stack.tables, parts))
    return {name: out[name] for name in self.tables}

  def optimizer_arrays(self, state: CollectionState) -> dict[str, Any]:
    """`{table name: optimizer state of its rows}` (a host-tier table's
    slots as read-only numpy views of host memory, its step on device)."""
    self._check_state(state)
    out = {}
    for stack in self.plan.stacks:
      opt_state = state.stacks[stack.name].opt_state
      if stack.optimizer is None:
        parts = [None] * len(stack.tables)
      elif stack.host:
        parts = [host_state.logical_arrays(self, state, stack)[1]]
      elif stack.placement == "column":
        parts = [stack.optimizer.slice_rows(opt_state, start, start + rows)
                 for start, rows in zip(stack.row_offsets, stack.vocab_rows)]
      else:
        parts = placement_lib.jitted(placement_lib.state_from_physical,
                                     stack, NamedSharding(self.mesh, P()))(
                                         opt_state)
      if stack.optimizer is not None and not stack.host:  # (host: logical)
        parts = [placement_lib.state_as_logical(stack, self.backend, p)
                 for p in parts]
      out.update(zip(stack.tables, parts))
    return {name: out[name] for name in self.tables}

  def quantize(self, state: CollectionState, dtype: str) -> ServingState:
    """A read-only serving copy of the state's tables, for `lookup`.

    dtype "int8": every stacked row in row-wise int8 (`quantize.py`: uint8
    codes, f32 scale and bias per row; `lookup` then returns float32
    embeddings, each element within `scale / 2` of the table's value plus
    f32 rounding); "bfloat16" / "float16": the tables cast (`lookup`
    returns that dtype). Every placement: the copy lies where the
    stack's table does. No optimizer state; `lookup_and_route`,
    `apply_gradients` and the Trainer refuse it. Rows the copy cannot hold
    (an int8 row with a NaN or an infinity, or whose max - min overflows;
    a value a cast makes infinite: `quantize.unservable_rows`) are one
    InputError naming every such table and its rows. A host-tier table is
    quantized chunk by chunk from host memory and served whole from the
    devices, as a device table of its placement.
    """
    self._check_state(state)
    name = quantize_lib.check_serving_dtype(dtype)
    tables = {s.name: placement_lib.as_logical(s, state.stacks[s.name].table)
              for s in self.plan.stacks if not s.host}
    state_lib.check_servable(self.plan, tables, name)
    return ServingState(
        {s.name: host_state.quantize(self, state, s, name) if s.host else
         quantize_lib.quantize_rows(tables[s.name], name, check=False)
         for s in self.plan.stacks}, name, self.serving_plan.fingerprint,
        state_lib.serving_layouts(self.serving_plan))

  def _serving_specs(self, dtype: str):
    return tuple(quantize_lib.serving_spec(spec, dtype)
                 for spec in self._table_specs())

  # --- per-call checks ----------------------------------------------------------

  def _read(self, batch) -> inputs_lib.BatchInputs:
    return inputs_lib.read_batch(self, batch)

  def layouts(self, batch_or_routing) -> tuple[layout_lib.StackLayout, ...]:
    """The static layout of every stack for a batch (or for the batch a
    `Routing` was made from): where each feature's ids sit per rank, the
    unique buffer of each stack and each table's region in it. What the
    per-rank code is traced with; host-side, nothing is traced."""
    if isinstance(batch_or_routing, Routing):
      return self._layouts(batch_or_routing.shapes,
                           batch_or_routing.implicit_weights)
    inputs = self._read(batch_or_routing)
    return self._layouts(inputs.shapes(), inputs.implicit)

  def _layouts(self, shapes: tuple[tuple[str, tuple[int, ...]], ...],
               implicit_weights: tuple[str, ...] = (), serving: bool = False
               ) -> tuple[layout_lib.StackLayout, ...]:
    """The per-stack layout of a batch with these ids shapes and implicit
    weights (cached: built once per batch shape); of the serving plan
    (host-tier stacks served whole) if `serving`."""
    key = (shapes, implicit_weights, serving)
    if key not in self._layouts_cache:
      self._layouts_cache[key] = layout_lib.stack_layouts(
          self, dict(shapes), implicit_weights,
          self.serving_plan if serving else None)
    return self._layouts_cache[key]

  def _placed(self, values: Mapping[str, jax.Array]) -> tuple[jax.Array, ...]:
    return tuple(exchange.place(values[name], self.token_sharding())
                 for name in self.features)

  def _check_state(self, state) -> None:
    state_lib.check_state(self.plan, state, self.backend)

  def _check_runs(self, *args) -> None:
    """A Pallas backend of an accelerator on concrete CPU arrays: one clear
    error before tracing (`validation.check_runs_on`)."""
    validation.check_runs_on(self.backend, self.platform, args[:-1],
                             f"collection {args[-1]}")

  def _tables(self, state: CollectionState) -> tuple[jax.Array, ...]:
    self._check_state(state)
    return exchange.place_state(
        tuple(state.stacks[s.name].table for s in self.plan.stacks),
        self._table_specs(), self.mesh, "state table")

  def _stack_states(self, state: CollectionState):
    self._check_state(state)
    specs = self._state_specs()
    return exchange.place_state(
        tuple(state.stacks[s.name]._replace(cache_entries=None)
              for s in self.plan.stacks),
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
    their table; `apply_gradients` is the sparse path. A state from `init`
    or `state_from_*` holds a bf16 table as its uint16 bits on the xla
    backend (`placement.storage_dtype`; float0 cotangent): differentiate a
    state of bf16 stack tables instead (the layers' params).

    `state` may be a `ServingState` (`quantize`): the rows are then read
    from the serving copy, dequantized inside the gather and the pool (an
    int8 state's embeddings are float32, pooled in f32; a bf16 / f16
    state's are in that dtype). Its embeddings may feed a differentiated
    model (gradients w.r.t. the dense params flow as usual), and the
    lookup is differentiable w.r.t. the copies in `serving.stacks` too,
    by the same dense cotangent of the rows read: a cast copy's is that
    cotangent; an int8 copy's uint8 codes get none (float0: pass
    `allow_int=True` to `jax.grad`), each row's scale `sum(codes[r] *
    ct[r])` and bias `sum(ct[r])`. `serving.layouts` are ints:
    differentiate w.r.t. `serving.stacks`.
    """
    self._check_runs(state, batch, "lookup")
    if isinstance(state, ServingState):
      return self._serve(state, batch)
    inputs = self._read(batch)
    layouts = self._layouts(inputs.shapes(), inputs.implicit)
    self._check_cached(state, batch, inputs, "lookup")
    outs = per_rank.collection_lookup(
        self, layouts, self._table_specs(), self._tables(state),
        self._placed(inputs.ids),
        self._placed_weights(inputs.weights), self._cache_maps(state, inputs))
    return dict(zip(self.features, outs))

  def _check_cached(self, state, batch, inputs, what: str) -> None:
    """Outside jit, a host-tier table's rows of `batch` are in its cache
    (inside jit, uncached rows are counted in the update's overflow)."""
    if self.host_tables and not any(isinstance(x, jax.core.Tracer)
                                    for x in inputs.ids.values()):
      self._check_state(state)
      host_tier.check_cached(self, state, batch, f"collection {what}")

  def prefetch(self, state: CollectionState, batch, *,
               in_flight: int | None = None, train: bool = True):
    """Host-side: `(state, {table: host_tier.CacheStats})` with every row of
    `batch` that a host-tier table's features read in its device cache
    (docs/host_tier.md), before `lookup`, `lookup_and_route`, `route` or
    `apply_gradients` of that batch (the Trainer calls it).

    The rows of the `in_flight` batches prefetched before (default: the
    state's host tier's, 0 or the pipelined Trainer's 2) stay in the cache:
    their updates are still to be applied. `train=False` (a batch only
    looked up, e.g. in evaluation): its rows are not marked changed and do
    not count as in flight. Donates `state` (use the one returned). A
    cache too small for the rows needed at once is an InputError, before
    anything changes. Without host-tier tables: `(state, {})`.
    """
    if not self.host_tables:
      return state, {}
    self._check_state(state)
    return state.host.prefetch(state, host_batches.batch_rows(self, batch),
                               in_flight, train)

  def _serve(self, state: ServingState, batch) -> dict[str, jax.Array]:
    """`lookup` of a serving state: the same per-rank lookup and dense
    cotangents, over the serving copies (a host-tier table's served whole,
    as a device table)."""
    state_lib.check_serving(self.serving_plan, state)
    inputs = self._read(batch)
    layouts = self._layouts(inputs.shapes(), inputs.implicit, serving=True)
    specs = self._serving_specs(state.dtype)
    tables = exchange.place_state(
        tuple(state.stacks[s.name] for s in self.plan.stacks), specs,
        self.mesh, "serving state")
    outs = per_rank.collection_lookup(
        self, layouts, specs, tables, self._placed(inputs.ids),
        self._placed_weights(inputs.weights), None)
    return dict(zip(self.features, outs))

  def lookup_and_route(self, state: CollectionState, batch
                       ) -> tuple[dict[str, jax.Array], Routing]:
    """The embeddings and the routing their update needs, from one all-gather
    of the ids per stack (what the `Trainer` calls). With dedup="slot_map"
    the routing carries the state's slot maps on to `apply_gradients`,
    which puts them back into the state (donated: no copy)."""
    self._check_runs(state, batch, "lookup_and_route")
    inputs = self._read(batch)
    layouts = self._layouts(inputs.shapes(), inputs.implicit)
    self._check_cached(state, batch, inputs, "lookup_and_route")
    fn = functools.partial(per_rank.lookup_per_rank, self.backend,
                           self.kernel_config, self._order(), layouts,
                           route=True)
    cache_maps = self._cache_maps(state, inputs)
    outs, routings = exchange.shard(
        layouts[0].ctx, fn,
        in_specs=(self._table_specs(), self._feature_specs(),
                  self._pooled_specs(), self._cache_map_specs(cache_maps),
                  self._map_specs()),
        out_specs=(self._feature_specs(),
                   self._routing_specs(self._routes_by_slot(layouts))),
    )(self._tables(state), self._placed(inputs.ids),
      self._placed_weights(inputs.weights), cache_maps, self._maps(state))
    return dict(zip(self.features, outs)), self._routing(routings, inputs)

  def route(self, batch, state: CollectionState | None = None) -> Routing:
    """The routing of a batch alone (its ids' all-gather and dedup); with
    dedup="slot_map" through the slot maps of `state` (None: fresh ones).
    A host-tier table routes through its cache: `state` is required."""
    inputs = self._read(batch)
    layouts = self._layouts(inputs.shapes(), inputs.implicit)
    if self.host_tables and state is None:
      raise InputError(
          f"pallas_emb collection route needs the state: host-tier tables "
          f"{list(self.host_tables)} route through their caches.")
    self._check_cached(state, batch, inputs, "route")
    fn = functools.partial(per_rank.route_per_rank, self._order(), layouts)
    cache_maps = self._cache_maps(state, inputs)
    routings = exchange.shard(
        layouts[0].ctx, fn,
        in_specs=(self._feature_specs(), self._pooled_specs(),
                  self._map_specs(), self._cache_map_specs(cache_maps)),
        out_specs=self._routing_specs())(
            self._placed(inputs.ids), self._placed_weights(inputs.weights),
            self._maps(state), cache_maps)
    return self._routing(routings, inputs)

  def _routing(self, routings, inputs: inputs_lib.BatchInputs) -> Routing:
    return Routing(dict(zip((s.name for s in self.plan.stacks), routings)),
                   inputs.shapes(), inputs.implicit, self.plan.fingerprint)

  def _order(self):
    """(feature names, pooled feature names), the orders of the inputs."""
    return (tuple(self.features),
            tuple(n for n, f in self.features.items() if f.combiner))

  def _table_specs(self):
    return tuple(placement_lib.table_spec(s, self.table_axis)
                 for s in self.plan.stacks)

  def _feature_specs(self):
    return tuple(self._token_spec() for _ in self.features)

  def _pooled_specs(self):
    return tuple(self._token_spec() for _ in self._order()[1])

  def _placed_weights(self, weights) -> tuple[jax.Array, ...]:
    return tuple(exchange.place(weights[name], self.token_sharding())
                 for name in self._order()[1])

  def _routing_specs(self, by_slot=None):
    """The routings' specs; `by_slot`: per stack, whether its routing
    carries its entries in slot order (`stack.routes_by_slot`)."""
    tokens = self._token_spec()
    by_slot = by_slot or (False,) * len(self.plan.stacks)
    return tuple(
        row_lib.RowRouting(tokens, tokens, tokens, tokens, tokens, P(), P())
        if s.placement in ("row", "table") else
        stack_lib.StackRouting(P(), tokens, tokens, P(), P(),
                               P() if s.slot_map else None,
                               (tokens,) * 3 if slotted else None)
        for s, slotted in zip(self.plan.stacks, by_slot))

  def _routes_by_slot(self, layouts) -> tuple[bool, ...]:
    """Per stack, whether a lookup's routing carries its entries in slot
    order."""
    return tuple(stack_lib.routes_by_slot(layout, self.backend,
                                          s.slot_map or None)
                 for s, layout in zip(self.plan.stacks, layouts))

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
    self._check_state(state)
    self._check_runs(state, emb_grads, "apply_gradients")
    routing = (batch_or_routing if isinstance(batch_or_routing, Routing)
               else self.route(batch_or_routing, state))
    state_lib.check_routing(self.plan, self.features, routing)
    layouts = self._layouts(routing.shapes, routing.implicit_weights)
    grads = inputs_lib.read_grads(self, emb_grads, dict(routing.shapes))
    # The slot maps bypass the update: a routing's (reset by its route)
    # goes back into the state, else the state's stays.
    maps = [routing.stacks[s.name].slot_map if s.slot_map and
            routing.stacks[s.name].slot_map is not None else
            state.stacks[s.name].slot_map for s in self.plan.stacks]
    without = state_lib.without_slot_maps
    specs = without(self._state_specs().stacks[s.name]
                    for s in self.plan.stacks)
    given = tuple(routing.stacks[s.name] for s in self.plan.stacks)
    all_specs = self._routing_specs(tuple(
        getattr(r, "by_slot", None) is not None for r in given))
    routing_specs = without(all_specs)
    fn = functools.partial(per_rank.apply_per_rank, self.backend,
                           self.kernel_config, tuple(self.features), layouts)
    stack_states = without(self._stack_states(state))
    routings = without(exchange.place_state(given, all_specs, self.mesh,
                                            "routing"))
    new_states, stats = exchange.shard(
        layouts[0].ctx, fn,
        in_specs=(specs, routing_specs, self._feature_specs(), P()),
        out_specs=(specs,
                   tuple(update_lib.UPDATE_STATS_SPEC for _ in self.plan.stacks)),
    )(stack_states, routings, self._placed(grads),
      jnp.asarray(pending, bool))
    names = [s.name for s in self.plan.stacks]
    new_states = [s._replace(slot_map=m, cache_map=state.stacks[n].cache_map,
                             cache_entries=state.stacks[n].cache_entries)
                  for s, m, n in zip(new_states, maps, names)]
    return (CollectionState(dict(zip(names, new_states)),
                            self.plan.fingerprint, state.host),
            dict(zip(names, stats)))

  # --- unique buffers from the stream ------------------------------------------

  def distinct_rows(self, batch: Mapping[str, Any]) -> dict[str, int]:
    """Host-side: `{table: distinct rows one batch trains}`, counted as
    the stack's dedup counts them (ids wrapped once; padding, ids outside
    the table and weight-0 entries take no slot). Reads the ids back."""
    return fitting.distinct_rows(self, batch)

  def fit_max_unique(self, batches: Sequence[Mapping[str, Any]], *,
                     headroom: float = 1.25) -> EmbeddingCollection:
    """This collection with each table's `max_unique` fit to a sample of
    the stream: `headroom` x the most distinct rows of the table in one of
    `batches`, rounded up to a multiple of 8 (a table that had a cap keeps
    the smaller one).

    A stack's unique buffer holds its tables' caps summed; without caps it
    is sized for the worst case (every id distinct): the step's temporaries
    follow it. Same plan, so the state carries over. A later batch with
    more distinct rows than a cap loses those rows' gradients and says so:
    check the stats with `raise_if_overflow`.
    """
    return fitting.fit_caps(self, "max_unique", self.distinct_rows, batches,
                            headroom, ("column", "replicated"))

  def fit_max_ids_per_partition(self, batches, *, headroom: float = 1.25
                                ) -> EmbeddingCollection:
    """`fit_max_unique` for row- and table-placed tables: each one's
    `max_ids_per_partition` fit to `headroom` x the most distinct rows of
    the table one rank sent one owner in one of `batches` (a multiple of
    8; a smaller cap stays).

    Without caps each rank's bucket per owner holds all of its ids, so
    every owner receives W x a rank's ids, the work of column's
    all-gather; on well-spread ids a fitted cap is about headroom / W of
    that. A later batch over a cap serves those rows as zeros and does not
    train them: check the stats with `raise_if_overflow`."""
    return fitting.fit_caps(self, "max_ids_per_partition",
                            lambda b: row_lib.ids_per_partition(self, b),
                            batches, headroom, ("row", "table"))

  def raise_if_overflow(self, stats: Mapping[str, update_lib.UpdateStats]
                        ) -> None:
    """Host-side: raises if a table's batch had more distinct rows than its
    `TableSpec.max_unique` (or, row and table placements, more for one
    owner than `max_ids_per_partition`): the only ways a buffer
    overflows. The error names every stack that overflowed."""
    over = []
    for stack in self.plan.stacks:
      overflow = int(jax.device_get(stats[stack.name].num_overflow))
      if overflow:
        owners = stack.placement in ("row", "table")
        field = "max_ids_per_partition" if owners else "max_unique"
        capped = [t for t in stack.tables
                  if getattr(self.tables[t], field) is not None]
        over.append(
            f"{stack.name}: tables {capped} had {overflow} more distinct ids "
            f"in one batch than their {field} caps hold; those ids' "
            "gradients were not applied"
            f"{' and their rows were served as zeros' if owners else ''}. "
            f"Raise or drop {field} of these tables (fit_{field} with more "
            "headroom)."
            + (f" Host-tier table {stack.tables[0]!r}: the count includes "
               "ids whose rows were not in its device cache (prefetch each "
               "batch before its lookup: coll.prefetch, or the Trainer)."
               if stack.host else ""))
    if over:  # every overflowing stack, one sentence each
      raise UniqueOverflowError("pallas_emb " + " ".join(over))


def table_key(key: jax.Array, name: str) -> jax.Array:
  """The key a table's initializer gets: `key` folded with its name."""
  return jax.random.fold_in(key, zlib.crc32(name.encode()))
