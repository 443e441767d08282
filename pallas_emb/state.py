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

import jax

from pallas_emb.quantize import QuantizedRows
from pallas_emb.stack import StackRouting


class StackState(NamedTuple):
  """The physical array of one stack and its optimizer state."""
  table: jax.Array
  opt_state: Any


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["stacks"], meta_fields=["fingerprint"])
@dataclasses.dataclass(frozen=True)
class CollectionState:
  """Everything a collection trains: stack name -> StackState.

  `fingerprint` (static) names the plan the state was made for
  (`CollectionPlan.fingerprint`); None for a state built by hand, which is
  checked by its stack names and shapes only.
  """
  stacks: dict[str, StackState]
  fingerprint: str | None = None


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
                   data_fields=["stacks"], meta_fields=["dtype", "fingerprint"])
@dataclasses.dataclass(frozen=True)
class ServingState:
  """A read-only serving copy of a collection's tables (`coll.quantize`).

  `stacks`: stack name -> `QuantizedRows` (dtype "int8": uint8 codes with
  the table's column sharding, f32 scale and bias per row, replicated) or
  the stack's table cast to `dtype` ("bfloat16", "float16"). No optimizer
  state: `coll.lookup` reads it, nothing trains it. `dtype` and
  `fingerprint` (static, as `CollectionState`'s) are not saved in a
  checkpoint; `checkpoint.restore_serving` takes them from the collection.
  """
  stacks: dict[str, QuantizedRows | jax.Array]
  dtype: str
  fingerprint: str | None = None
