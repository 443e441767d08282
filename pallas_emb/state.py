"""What a collection carries between steps: its state and a batch's routing;
and the read-only serving copy of its tables.

Pytrees of arrays. Each carries the fingerprint of the plan that made it,
so handing a state or a routing to another collection (other tables, another
order, other shapes) is an error before anything is traced, not the wrong
rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple
import weakref

import jax
import numpy as np

from pallas_emb import placement
from pallas_emb import quantize
from pallas_emb.dedup import empty_slot_map
from pallas_emb.errors import InputError
from pallas_emb.quantize import QuantizedRows
from pallas_emb.stack import StackRouting


class StackState(NamedTuple):
  """The physical array of one stack and its optimizer state.

  `slot_map`: the int32 `[total_rows]` map of a stack that dedups through
  one (`StackPlan.slot_map`), every entry at `dedup.MAP_SENTINEL` between
  steps, on every rank; None otherwise. Not saved nor shown: it follows
  from the rows (`coll.init`, `state_from_arrays` and restores rebuild it;
  a state without one gets a fresh one at its next route).

  A host-tier stack (`StackPlan.host`): `table` and `opt_state`'s slots are
  its device cache (`StackPlan.total_rows` rows; the step counter is the
  optimizer's, as for any stack), and `cache_map` the int32 `[logical
  rows]` map from each row of the table to its cache row (-1: not in the
  cache), on every rank; None for a device stack. `host_tier.py` keeps
  the table's rows and state in host memory. `cache_entries`: the last
  prefetched batch's entries translated on the host, `{feature: (cache
  row, logical row)}` for each feature of the stack, flat int32 arrays
  over the token axes (`host_tier.HostStack.entries`), which spare the step the
  map's gather of every entry; None before a prefetch and for a device
  stack.
  """
  table: jax.Array
  opt_state: Any
  slot_map: jax.Array | None = None
  cache_map: jax.Array | None = None
  cache_entries: dict | None = None


@dataclasses.dataclass(frozen=True)
class CollectionState:
  """Everything a collection trains: stack name -> StackState.

  `fingerprint` (static) names the plan the state was made for
  (`CollectionPlan.fingerprint`); None for a state built by hand, which is
  checked by its stack names and shapes only. `host` (static, compared by
  identity) is the `host_tier.HostTier` holding the host-tier stacks' rows
  in host memory, None without such stacks: the state's caches and maps
  follow it, so a state is used once (`coll.prefetch` and every step
  donate it).
  """
  stacks: dict[str, StackState]
  fingerprint: str | None = None
  host: Any = None


class _WeakHost:
  """A state's host tier as its pytree's static data holds it: weakly.

  jit keeps the static data of every argument it compiled for, for the life
  of its cache; a strong reference there would keep every host-tier table
  a state ever had in host memory after the last state using it is gone.
  The state itself holds the tier strongly. One handle per tier, so that
  static data compares as the tier (by identity).
  """
  __slots__ = ("_ref", "__weakref__")

  def __init__(self, host):
    self._ref = weakref.ref(host)

  @classmethod
  def of(cls, host) -> "_WeakHost | None":
    if host is None:
      return None
    handle = getattr(host, "_pytree_handle", None)
    if handle is None:
      handle = host._pytree_handle = cls(host)  # pylint: disable=protected-access
    return handle

  def get(self):
    host = self._ref()
    if host is None:
      raise InputError(
          "pallas_emb: a collection state with host-tier tables was rebuilt "
          "from its pytree structure after every state holding its host "
          "memory was gone; expected a state (or a structure taken from "
          "one) that is still alive: keep the state, or restore it from a "
          "checkpoint.")
    return host


jax.tree_util.register_pytree_with_keys(
    CollectionState,
    lambda state: (((jax.tree_util.GetAttrKey("stacks"), state.stacks),),
                   (state.fingerprint, _WeakHost.of(state.host))),
    lambda aux, children: CollectionState(
        children[0], aux[0], None if aux[1] is None else aux[1].get()),
    flatten_func=lambda state: ((state.stacks,), (
        state.fingerprint, _WeakHost.of(state.host))))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["stacks"],
                   meta_fields=["shapes", "implicit_weights", "fingerprint"])
@dataclasses.dataclass(frozen=True)
class Routing:
  """A looked-up batch's routing, kept for its update (one per stack).

  `shapes` (static) are the ids' shapes per feature, so the update knows
  the batch layout without the batch; `implicit_weights` (static) the
  pooled features whose weights were ones or a lengths mask, so that the
  update can skip the weights where every training entry weighs 1;
  `fingerprint` (static) the plan it was made for. Static fields are not
  saved in a checkpoint; a restored routing takes them from the restore
  target, so build that target from batches of the same kind (plain ids or
  lengths vs per-id weights) as the saved run's.
  """
  stacks: dict[str, StackRouting]
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  implicit_weights: tuple[str, ...] = ()
  fingerprint: str | None = None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["stacks", "layouts"],
                   meta_fields=["dtype", "fingerprint"])
@dataclasses.dataclass(frozen=True)
class ServingState:
  """A read-only serving copy of a collection's tables (`coll.quantize`).

  `stacks`: stack name -> `QuantizedRows` (dtype "int8": uint8 codes with
  the stack table's sharding, f32 scale and bias per row, with its rows) or
  the stack's table cast to `dtype` ("bfloat16", "float16"). No optimizer
  state: `coll.lookup` reads it, nothing trains it. `dtype` and
  `fingerprint` (static, as `CollectionState`'s) are not saved in a
  checkpoint; `checkpoint.restore_serving` takes them from the collection.
  `layouts` (`serving_layouts`) names the rank count of its row and table
  stacks in a checkpoint's keys.
  """
  stacks: dict[str, QuantizedRows | jax.Array]
  dtype: str
  fingerprint: str | None = None
  layouts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def serving_layouts(plan) -> dict[str, np.ndarray]:
  """`{"<stack>_ranks<W>": W}` for each row or table stack of `plan`.

  Their rows' places in the physical array depend on the rank count W
  (`stacking.py`), so a serving checkpoint of them is only valid over W
  ranks: with W in its keys, a restore over other ranks is refused before
  anything is read. Column and replicated stacks are laid out the same
  over any W (no entry).
  """
  return {f"{s.name}_ranks{s.ranks}": np.asarray(s.ranks, np.int32)
          for s in plan.stacks if s.placement in ("row", "table")}


def check_servable(plan, tables, dtype: str) -> None:
  """One InputError naming every logical table row that a serving copy in
  `dtype` of the stacks' physical `tables` (`{stack name: array}`) cannot
  hold (`quantize.unservable_rows`); nothing if there is none."""
  found = []
  for stack in plan.stacks:
    if stack.name not in tables:  # a host-tier stack: checked by chunks
      continue
    rows = quantize.unservable_rows(tables[stack.name], dtype)
    if not rows:
      continue
    # Each table's physical rows, in its logical order.
    parts = placement.from_physical(stack, np.arange(stack.total_rows))
    for table, physical in zip(stack.tables, parts):
      logical = {problem: np.flatnonzero(np.isin(physical, bad))
                 for problem, bad in rows.items()}
      logical = {k: v for k, v in logical.items() if v.size}
      if logical:
        found.append((f"table {table!r} ", logical))
  quantize.raise_if_unservable(dtype, found, "collection quantize")


def fresh_slot_map(stack, sharding):
  """A stack's empty slot map, placed (None for a stack that sorts)."""
  if not stack.slot_map:
    return None
  return jax.jit(empty_slot_map, static_argnums=0,
                 out_shardings=sharding)(stack.total_rows)


def route_maps(plan, state: CollectionState | None) -> tuple:
  """Per stack of `plan`: the slot map its route reads (the state's; an
  empty one if the state has none), None for a stack that sorts."""
  maps = []
  for s in plan.stacks:
    m = state.stacks[s.name].slot_map if state is not None else None
    maps.append(None if not s.slot_map else
                empty_slot_map(s.total_rows) if m is None else m)
  return tuple(maps)


def without_slot_maps(parts) -> tuple:
  """Stack states or routings (or their specs) without their slot maps (and
  a stack state without its cache map and entries)."""
  return tuple(p._replace(**{f: None for f in ("slot_map", "cache_map",
                                               "cache_entries")
                             if hasattr(p, f)})
               if hasattr(p, "slot_map") else p for p in parts)


def move_slot_maps(state: CollectionState, routing: Routing
                   ) -> tuple[CollectionState, Routing]:
  """The routing's slot maps moved back into the state (what the pipelined
  Trainer does right after a route: the next route reads them from the
  state, and the routing it keeps in flight holds none)."""
  stacks, routes = dict(state.stacks), dict(routing.stacks)
  for name, r in routing.stacks.items():
    if getattr(r, "slot_map", None) is not None:
      stacks[name] = stacks[name]._replace(slot_map=r.slot_map)
      routes[name] = r._replace(slot_map=None)
  return (dataclasses.replace(state, stacks=stacks),
          dataclasses.replace(routing, stacks=routes))


def check_state(plan, state, backend: str) -> None:
  """A training state of `plan`'s collection on `backend`: its stacks,
  shapes and table dtypes (a stack's own, or the storage dtype that
  `placement.storage_dtype` gives it on that backend)."""
  if isinstance(state, ServingState):
    raise InputError(
        "pallas_emb collection state is a ServingState (the read-only "
        "serving copy coll.quantize returns), which only coll.lookup "
        "reads; expected the CollectionState that coll.init(key) returns "
        "for training, routing and table access.")
  if not isinstance(state, CollectionState):
    raise InputError(
        f"pallas_emb collection state is a {type(state).__name__}; expected "
        "the CollectionState that coll.init(key) returns.")
  _check_stack_names(plan, state.stacks, "state", (
      " (a state of another collection? restore it through "
      "table_arrays/state_from_arrays)."))
  _check_fingerprint(plan, state.fingerprint, "state")
  for stack in plan.stacks:
    table = state.stacks[stack.name].table
    shape = (stack.total_rows, stack.emb_width)
    stored = placement.storage_dtype(stack, backend)
    stored_shape = (stack.total_rows, placement.storage_width(stack, backend))
    if ((tuple(table.shape), np.dtype(table.dtype)) not in (
        (shape, stack.dtype), (stored_shape, stored))):
      bits = (f" (held as {stored.name}{list(stored_shape)} on the "
              f"{backend} backend)" if (stored, stored_shape) != (
                  stack.dtype, shape) else "")
      raise InputError(
          f"pallas_emb collection state {stack.name} table is "
          f"{np.dtype(table.dtype).name}{list(table.shape)}; the plan says "
          f"{stack.dtype.name}{list(shape)}{bits}.")
    _check_slot_map(stack, state.stacks[stack.name].slot_map)
    _check_cache_map(stack, state.stacks[stack.name].cache_map, state.host)


def _check_cache_map(stack, cache_map, host) -> None:
  """A host-tier stack has its cache map and host store; no other does."""
  got = (None if cache_map is None else
         f"{np.dtype(cache_map.dtype).name}{list(cache_map.shape)}")
  want = f"int32[{stack.logical_rows}]" if stack.host else None
  if got != want:
    raise InputError(
        f"pallas_emb collection state {stack.name} cache_map is {got}; the "
        f"plan says {want}"
        f"{' (a host-tier stack)' if stack.host else ''}. Pass the state "
        "this collection returned.")
  if stack.host and (host is None or stack.name not in host.stacks):
    raise InputError(
        f"pallas_emb collection state has no host store of host-tier stack "
        f"{stack.name}; pass the state coll.init or coll.state_from_arrays "
        "returned (a host-tier state cannot be built from its device "
        "arrays alone).")


def _check_slot_map(stack, slot_map) -> None:
  if slot_map is None:
    return
  got = f"{np.dtype(slot_map.dtype).name}{list(slot_map.shape)}"
  if not stack.slot_map or got != f"int32[{stack.total_rows}]":
    want = (f"int32[{stack.total_rows}]" if stack.slot_map else
            "None (this collection dedups it by a sort)")
    raise InputError(
        f"pallas_emb collection state {stack.name} slot_map is {got}; the "
        f"plan says {want}. Pass the state this collection returned, or "
        "rebuild it with coll.state_from_arrays.")


def _check_stack_names(plan, stacks, what: str, fix: str) -> None:
  expected = sorted(s.name for s in plan.stacks)
  if sorted(stacks) != expected:
    raise InputError(
        f"pallas_emb collection {what} has stacks {sorted(stacks)}; this "
        f"collection's plan has {expected}{fix}")


def check_serving(plan, state: ServingState) -> None:
  """A serving state of this collection: its stacks, dtype and shapes."""
  _check_stack_names(plan, state.stacks, "serving state", (
      ". Pass the ServingState this collection's quantize returned."))
  _check_fingerprint(plan, state.fingerprint, "serving state")
  if state.dtype not in quantize.SERVING_DTYPES:
    raise InputError(
        f"pallas_emb collection serving state dtype={state.dtype!r}; "
        f"expected one of {quantize.SERVING_DTYPES} (coll.quantize).")
  for stack in plan.stacks:
    shape = (stack.total_rows, stack.emb_width)
    rows = state.stacks[stack.name]
    if state.dtype == quantize.INT8:
      want = quantize.QuantizedRows(
          ("uint8", shape), ("float32", shape[:1]), ("float32", shape[:1]))
      got = (tuple((np.dtype(x.dtype).name, tuple(x.shape)) for x in rows)
             if isinstance(rows, quantize.QuantizedRows) else None)
    else:
      want = (state.dtype, shape)
      got = (None if isinstance(rows, quantize.QuantizedRows) else
             (np.dtype(rows.dtype).name, tuple(rows.shape)))
    if got != tuple(want):
      raise InputError(
          f"pallas_emb collection serving state {stack.name} is {got}; the "
          f"plan and dtype {state.dtype!r} say {tuple(want)}. Pass the "
          "ServingState this collection's quantize returned.")


def _check_fingerprint(plan, fingerprint, what: str) -> None:
  if fingerprint is not None and fingerprint != plan.fingerprint:
    raise InputError(
        f"pallas_emb collection {what} was made by another collection (plan "
        f"fingerprint {fingerprint}; this collection's is "
        f"{plan.fingerprint}: other tables, order, shapes or "
        f"optimizers). Use the {what} this collection returned; move a state "
        "between collections through table_arrays / state_from_arrays.")


def check_routing(plan, features, routing: Routing) -> None:
  """A routing of `plan`'s collection, whose features are `features`."""
  _check_fingerprint(plan, routing.fingerprint, "routing")
  _check_stack_names(plan, routing.stacks, "routing", (
      ". Pass the routing this collection's lookup_and_route returned."))
  names = sorted(name for name, _ in routing.shapes)
  if names != sorted(features):
    raise InputError(
        f"pallas_emb collection routing covers features {names}; this "
        f"collection has {sorted(features)}. Pass the routing this "
        "collection's lookup_and_route returned.")


def check_names(mapping, expected, what) -> None:
  """`mapping` has exactly the tables `expected` (`what` names it)."""
  if set(mapping) != set(expected):
    raise InputError(
        f"pallas_emb collection {what} has {sorted(mapping)}; expected "
        f"exactly the tables {sorted(expected)}.")
