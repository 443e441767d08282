"""Where a stack's rows live: its physical array and its logical tables.

`stacking.py` says which placement each stack has; this module turns a stack's
logical tables (and their optimizer state) into its physical array and
back, and gives the sharding of each. Checkpoints and `table_arrays` see
only logical tables, so a state moves between placements through them.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from pallas_emb import exchange
from pallas_emb.kernels import common
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.stacking import StackPlan

COLUMN = "column"
ROW = "row"
TABLE = "table"
REPLICATED = "replicated"


MOSAIC = ("mosaic_tpu", "mosaic_tpu_interpret")


def stored_layout(backend: str) -> bool:
  """Whether a state of `backend` holds its tables in the Mosaic backend's
  stored layout (`kernels/mosaic_tpu/stored.py`: rows of 32-bit words
  padded to whole 128-lane rows, bf16 packed two columns a word; the
  element-wise optimizer state in the gradients' layout)."""
  return backend in MOSAIC


def storage_dtype(stack: StackPlan, backend: str) -> np.dtype:
  """The dtype a collection state holds the stack's table in: the stack's
  own, except a bf16 table on the xla backend, held as its uint16 bits
  (`kernels.common.BF16_BITS`: XLA:CPU scatters uint16 rows in place, but
  runs a bf16 scatter, or a bitcast of the table, over every row), and a
  bf16 table on the Mosaic backend, held as uint32 words of two columns.
  `table_arrays`, checkpoints, the layers and `quantize` see bf16."""
  if stored_layout(backend):
    return stored.stored_dtype(stack.dtype)
  if backend == "xla" and stack.dtype == np.dtype(jnp.bfloat16):
    return np.dtype(common.BF16_BITS)
  return stack.dtype


def shard_width(stack: StackPlan) -> int:
  """Columns of the stack each rank holds."""
  return stack.emb_width // (stack.ranks if stack.placement == COLUMN else 1)


def _column_blocks(stack: StackPlan) -> int:
  return stack.ranks if stack.placement == COLUMN else 1


def storage_width(stack: StackPlan, backend: str) -> int:
  """Columns of the stack's physical table as a state holds it: each
  rank's columns padded in the stored layout on the Mosaic backend."""
  if not stored_layout(backend):
    return stack.emb_width
  return _column_blocks(stack) * stored.stored_width(shard_width(stack),
                                                     stack.dtype)


def element_width(stack: StackPlan, backend: str) -> int:
  """Columns of an element-wise optimizer state array of the stack."""
  if not stored_layout(backend):
    return stack.emb_width
  return _column_blocks(stack) * stored.grad_width(shard_width(stack),
                                                   stack.dtype)


def _per_rank(stack: StackPlan, fn, x):
  """`fn` (on the last axis) applied to each rank's block of columns of
  `x` `[rows, W * cols]` (W: the column ranks)."""
  blocks = _column_blocks(stack)
  if blocks == 1:
    return fn(x)
  out = fn(x.reshape(x.shape[0], blocks, -1))
  return out.reshape(x.shape[0], -1)


def _table_to_stored(stack, x):
  return _per_rank(stack, stored.to_stored, x)


def _table_from_stored(stack, x):
  return _per_rank(stack, lambda b: stored.from_stored(
      b, shard_width(stack), stack.dtype), x)


def _element_to_stored(stack, x):
  return _per_rank(stack, lambda b: stored.to_grads(b, stack.dtype), x)


def _element_from_stored(stack, x):
  return _per_rank(stack, lambda b: stored.from_grads(
      b, shard_width(stack), stack.dtype), x)


def as_storage(stack: StackPlan, backend: str, table):
  """A stack's physical table as its state holds it (another dtype is left
  as it is, for `check_state` to name)."""
  if np.dtype(table.dtype) != stack.dtype:
    return table
  if stored_layout(backend):
    return _convert(_table_to_stored, stack, table)
  if storage_dtype(stack, backend) == stack.dtype:
    return table
  return _bitcast(table, to_bits=True)


def as_logical(stack: StackPlan, table):
  """A state's stack table as the logical `[total_rows, emb_width]` array
  of its dtype (bf16 for uint16 bits; the stored layout unpacked)."""
  if table.dtype == common.BF16_BITS:
    return _bitcast(table, to_bits=False)
  if table.dtype == stored.WORD or table.shape[1] != stack.emb_width:
    return _convert(_table_from_stored, stack, table)
  return table


def state_as_storage(stack: StackPlan, backend: str, opt_state):
  """An optimizer state of logical element-wise arrays as a state of
  `backend` holds it (the gradients' layout on the Mosaic backend)."""
  if opt_state is None or not stored_layout(backend):
    return opt_state
  return _map_element_slots(stack, opt_state, functools.partial(
      _convert, _element_to_stored, stack))


def state_as_logical(stack: StackPlan, backend: str, opt_state):
  """The inverse of `state_as_storage`. By the backend, not the shapes: a
  bf16 table of 128 columns has a gradient layout of 128 columns too."""
  if opt_state is None or not stored_layout(backend):
    return opt_state
  return _map_element_slots(stack, opt_state, functools.partial(
      _convert, _element_from_stored, stack))


def _map_element_slots(stack, opt_state, fn):
  opt = stack.optimizer
  arrays = {s.name: getattr(opt_state, s.name) for s in opt.slots()}
  for slot in opt.slots():
    if slot.kind == "element":
      arrays[slot.name] = fn(arrays[slot.name])
  return _state(opt, arrays, opt_state.step)


def _convert(fn, stack, x):
  """`fn(stack, x)`, keeping `x`'s sharding (traced: inline)."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return fn(stack, x)
  return jitted(fn, stack, x.sharding)(x)


def _bitcast(x, to_bits: bool):
  """The whole-table bitcast, outside the step, keeping `x`'s sharding."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return _bitcast_fn(to_bits)(x)
  return _jitted_bitcast(to_bits, x.sharding)(x)


def _bitcast_fn(to_bits: bool):
  if to_bits:
    return functools.partial(common.stored_rows,
                             storage_dtype=common.BF16_BITS)
  return common.logical_rows


@functools.lru_cache(maxsize=64)
def _jitted_bitcast(to_bits: bool, sharding):
  return jax.jit(_bitcast_fn(to_bits), out_shardings=sharding)


def _state(opt, arrays, step):
  """`opt`'s state NamedTuple of these slot arrays and step."""
  return opt._state(arrays, step)  # pylint: disable=protected-access


def table_spec(stack: StackPlan, table_axis) -> P:
  """The PartitionSpec of a stack's physical table."""
  if stack.placement == COLUMN:
    return P(None, table_axis)
  if stack.placement == REPLICATED:
    return P()
  return P(table_axis)  # row, table: rows over the ranks


def state_specs(stack: StackPlan, table_axis):
  """The PartitionSpecs of a stack's optimizer state (None: no optimizer).

  Column: row-wise state replicated, element-wise like the table. Row and
  table: every slot's rows with the table's rows (row-wise state is never
  replicated). Replicated: everything on every rank.
  """
  opt = stack.optimizer
  if opt is None:
    return None
  spec = table_spec(stack, table_axis)
  if stack.placement == COLUMN:
    return opt.state_specs(spec)
  return _state(opt, {s.name: spec for s in opt.slots()}, P())


def fresh_state(stack: StackPlan, mesh, table_axis, backend: str = "xla"):
  """A stack's initial optimizer state on its shardings, as a state of
  `backend` holds it."""
  opt = stack.optimizer
  if opt is None:
    return None
  table = NamedSharding(mesh, table_spec(stack, table_axis))
  replicated = NamedSharding(mesh, P())
  width = element_width(stack, backend)
  if stack.placement == COLUMN:
    return opt.init_state(stack.total_rows, replicated, table,
                          emb_width=width)
  arrays = {}
  for slot in opt.slots():  # every slot's rows where the table's are
    shape = (stack.total_rows,) + (
        (width,) if slot.kind == "element" else ())
    # `place`: under a user's jit (`jax.jit(coll.init)`), `device=` alone
    # left the state replicated on every rank.
    arrays[slot.name] = exchange.place(
        jnp.full(shape, slot.init, slot.dtype, device=table), table)
  return _state(opt, arrays, jnp.zeros((), jnp.int32, device=replicated))


def to_physical(stack: StackPlan, parts: Sequence[jax.Array]) -> jax.Array:
  """The stack's tables (or one state array of each, `[rows, ...]`, in
  `stack.tables` order) laid out as its physical array (traceable)."""
  if stack.placement == TABLE:
    pieces, end = [], 0
    for part, offset in zip(parts, stack.row_offsets):
      if offset > end:
        pieces.append(jnp.zeros((offset - end,) + part.shape[1:],
                                part.dtype))
      pieces.append(part)
      end = offset + part.shape[0]
    if stack.total_rows > end:
      pieces.append(jnp.zeros((stack.total_rows - end,)
                              + parts[0].shape[1:], parts[0].dtype))
    return jnp.concatenate(pieces)
  x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
  if stack.placement != ROW:
    return x
  w, local = stack.ranks, stack.local_rows
  x = jnp.pad(x, [(0, w * local - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  # Stacked row g = l * W + r goes to rank r, local row l.
  return x.reshape((local, w) + x.shape[1:]).swapaxes(0, 1).reshape(
      x.shape)


def from_physical(stack: StackPlan, x: jax.Array) -> list[jax.Array]:
  """The inverse of `to_physical`: one array per table (traceable)."""
  if stack.placement == ROW:
    w, local = stack.ranks, stack.local_rows
    x = x.reshape((w, local) + x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
  return [x[offset:offset + rows]
          for offset, rows in zip(stack.row_offsets, stack.vocab_rows)]


def _slot_names(stack: StackPlan) -> tuple[str, ...]:
  return tuple(s.name for s in stack.optimizer.slots())


def state_to_physical(stack: StackPlan, states: Sequence[Any]):
  """The stack's optimizer state from its tables' states (traceable)."""
  opt = stack.optimizer
  arrays = {name: to_physical(stack, [getattr(s, name) for s in states])
            for name in _slot_names(stack)}
  step = jnp.max(jnp.stack([jnp.asarray(s.step) for s in states]))
  return _state(opt, arrays, step)


def state_from_physical(stack: StackPlan, state) -> list[Any]:
  """Per table of the stack, the optimizer state of its rows (traceable)."""
  opt = stack.optimizer
  names = _slot_names(stack)
  per_slot = {name: from_physical(stack, getattr(state, name))
              for name in names}
  return [_state(opt, {name: per_slot[name][i] for name in names},
                 state.step) for i in range(len(stack.tables))]


def _unsharded(x):
  """`x` with no sharding in its type. On a mesh of Explicit axes (what
  `jax.make_mesh` gives) the type carries the sharding, and reshaping or
  slicing a sharded dimension is a type error; the conversions run at the
  edges (init, `table_arrays`, checkpoints), not in the step."""
  if not isinstance(x, (jax.Array, jax.core.Tracer)):
    return x
  sharding = jax.typeof(x).sharding
  if all(s is None for s in sharding.spec):
    return x
  return jax.sharding.reshard(x, NamedSharding(sharding.mesh, P()))


@functools.lru_cache(maxsize=256)
def jitted(fn, stack: StackPlan, out_shardings):
  """`fn(stack, x)` (one of the conversions above) jitted onto
  `out_shardings`, compiled once per stack, on meshes of Auto or Explicit
  axes."""
  def convert(x):
    return fn(stack, jax.tree.map(_unsharded, x))
  return jax.jit(convert, out_shardings=out_shardings)


def concat_rows(arrays, sharding) -> jax.Array:
  """`arrays` stacked by rows, placed with `sharding`."""
  if len(arrays) == 1:
    return jax.device_put(arrays[0], sharding)
  return jax.jit(lambda *a: jnp.concatenate(a, axis=0),
                 out_shardings=sharding)(*arrays)
