"""A host-tier table's device state and what is read out of its host
memory: a fresh state (an empty cache and the host store, `collection_state`),
the logical arrays as read-only views (`logical_arrays`) and the quantized
serving copy (`quantize`). The prefetch that fills the cache is
`host_tier.py`'s (docs/host_tier.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_emb import host_memory
from pallas_emb import placement as placement_lib
from pallas_emb import quantize as quantize_lib
from pallas_emb.errors import InputError
from pallas_emb.host_tier import HostStack
from pallas_emb.host_tier import HostTier
from pallas_emb.state import CollectionState
from pallas_emb.state import StackState


# --- building a host-tier state ----------------------------------------------


def empty_cache(coll, stack, step=None) -> StackState:
  """A host-tier stack's device state: an empty cache, its map all -1, the
  optimizer's step counter (`step`, else 0)."""
  sharding = coll.stack_sharding(stack)
  storage = placement_lib.storage_dtype(stack, coll.backend)
  width = placement_lib.storage_width(stack, coll.backend)
  table = jax.jit(lambda: jnp.zeros((stack.total_rows, width), storage),
                  out_shardings=sharding)()
  opt_state = placement_lib.fresh_state(stack, coll.mesh, coll.table_axis,
                                        coll.backend)
  if opt_state is not None and step is not None:
    # A copy: the state is donated, the given step may live on elsewhere.
    opt_state = opt_state._replace(step=jax.device_put(
        np.array(jax.device_get(step), np.int32),
        NamedSharding(coll.mesh, P())))
  cache_map = jax.jit(lambda: jnp.full((stack.logical_rows,), -1, jnp.int32),
                      out_shardings=NamedSharding(coll.mesh, P()))()
  slot_map = coll._fresh_map(stack)  # pylint: disable=protected-access
  return StackState(table, opt_state, slot_map, cache_map)


def host_stack(coll, stack, table, opt_state=None, *, copy=True):
  """`(HostStack, StackState)` of a host-tier stack from its logical table
  and optimizer state (numpy or jax arrays; None: fresh state). With
  `copy=False` numpy arrays of the right dtype become the host memory
  as they are (no second copy of a huge table)."""
  spec = coll.tables[stack.tables[0]]
  table = host_memory.as_host_array(spec, "rows", table, spec.dtype, copy)
  if opt_state is None or spec.optimizer is None:
    slots, step = host_memory.init_slots(spec), None
  else:
    slots = {s.name: host_memory.as_host_array(
        spec, s.name, getattr(opt_state, s.name), s.dtype, copy)
             for s in spec.optimizer.slots()}
    step = opt_state.step
  return HostStack(coll, stack, table, slots), empty_cache(coll, stack, step)


def collection_state(coll, device_stacks, tables, opt_states=None, *,
                     copy=True):
  """A collection state: `device_stacks` (stack name -> StackState) and
  the host-tier stacks from their logical `tables` (and `opt_states`,
  stack name -> array; see `host_stack`)."""
  stacks, hosts = dict(device_stacks), {}
  for s in coll.plan.stacks:
    if s.host:
      hosts[s.name], stacks[s.name] = host_stack(
          coll, s, tables[s.name], (opt_states or {}).get(s.name), copy=copy)
  return CollectionState({s.name: stacks[s.name] for s in coll.plan.stacks},
                         coll.plan.fingerprint, HostTier(hosts))


def logical_arrays(coll, state, stack):
  """`(table, optimizer state)` of a host-tier stack from host memory
  (flushed first): read-only views of the host arrays, not copies."""
  host = state.host.stacks[stack.name]
  host.flush(state.stacks[stack.name], state.host.in_flight)
  opt = stack.optimizer
  slots = {n: _read_only(x) for n, x in host.slots.items()}
  step = None if opt is None else state.stacks[stack.name].opt_state.step
  # pylint: disable-next=protected-access
  opt_state = None if opt is None else opt._state(slots, step)
  return _read_only(host.table), opt_state


def _read_only(x: np.ndarray) -> np.ndarray:
  view = x.view()
  view.flags.writeable = False
  return view


def quantize(coll, state, stack, dtype: str):
  """A serving copy of a host-tier stack, quantized chunk by chunk from
  host memory on the host's CPU device (the same function as a device
  table's), laid out as a device stack of its rows and put on the
  devices."""
  host = state.host.stacks[stack.name]
  host.flush(state.stacks[stack.name], state.host.in_flight)
  table = host.table
  rows, width = table.shape
  parts = []
  step = host_memory.chunk_rows(width, table.dtype.itemsize)
  with jax.default_device(host_memory.cpu_device()):
    for start in range(0, rows, step):
      chunk = jax.device_put(table[start:start + step],
                             host_memory.cpu_device())
      try:
        out = quantize_lib.quantize_rows(chunk, dtype)
      except InputError as e:
        raise InputError(f"pallas_emb host-tier table {host.name!r} rows "
                         f"[{start}, {start + chunk.shape[0]}): {e}") from e
      parts.append(jax.tree.map(np.asarray, out))
  joined = jax.tree.map(lambda *x: np.concatenate(x), *parts)
  serving = dataclasses.replace(stack, cache_rows=0)
  spec = quantize_lib.serving_spec(coll.stack_sharding(serving).spec, dtype)
  return jax.tree.map(
      lambda x, s: jax.device_put(_physical(serving, x),
                                  NamedSharding(coll.mesh, s)),
      joined, spec, is_leaf=lambda x: isinstance(x, np.ndarray))


def _physical(stack, x: np.ndarray) -> np.ndarray:
  """`placement.to_physical` of one logical array, in numpy (row
  placement: rank r's block holds rows r, r + W, ...)."""
  if stack.placement != "row" or stack.ranks == 1:
    return x
  w, local = stack.ranks, stack.local_rows
  padded = np.zeros((w * local,) + x.shape[1:], x.dtype)
  padded[:x.shape[0]] = x
  return padded.reshape((local, w) + x.shape[1:]).swapaxes(0, 1).reshape(
      padded.shape)

