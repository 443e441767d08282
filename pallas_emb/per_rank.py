"""The collection's per-rank code: every stack of a batch, in plan order.

These functions run inside the collection's `shard_map`; each loops over
the stacks' static layouts and calls the dataflow of the stack's placement
once per stack: `stack.py` for column and replicated stacks, `row.py` for
row and table ones (the same four entry points: lookup, route, update,
dense gradient). The inputs arrive in collection order (features as declared,
pooled features' weights after them) and are regrouped per stack here.
`collection_lookup` is the differentiable lookup (dense cotangents), of
a training state's tables or of a serving state's copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pallas_emb import exchange
from pallas_emb import row
from pallas_emb import stack
from pallas_emb.quantize import QuantizedRows
from pallas_emb.state import StackState


def dataflow(layout):
  """The module of the stack's placement's per-rank dataflow."""
  return row if layout.placement in ("row", "table") else stack


def per_stack(coll_order, layouts, all_ids, all_weights):
  """Per stack (in plan order): `(layout, its features' ids, the combiner
  weights of its pooled features)`, from the collection-ordered inputs."""
  order, pooled_order = coll_order
  ids_by = dict(zip(order, all_ids))
  weights_by = dict(zip(pooled_order, all_weights))
  for layout in layouts:
    ids = [ids_by[f.name] for f in layout.features]
    weights = [stack.combiner_weights(f, ids_by[f.name],
                                          weights_by[f.name])
               for f in layout.pooled]
    yield layout, ids, weights


def lookup_per_rank(backend, kernel_config, coll_order, layouts, tables,
                     all_ids, all_weights, maps=None, *, route):
  """Embeddings of every feature (collection order) [+ each stack's routing,
  deduped through its slot map where `maps` (per stack) has one]."""
  outs, routings = {}, []
  for (layout, ids, weights), table, slot_map in zip(
      per_stack(coll_order, layouts, all_ids, all_weights), tables,
      maps or (None,) * len(layouts)):
    embs = dataflow(layout).lookup_stack(layout, backend, table, ids, weights,
                                         kernel_config, with_routing=route,
                                         **_map_arg(slot_map))
    if route:
      embs, routing = embs
      routings.append(routing)
    outs.update(zip((f.name for f in layout.features), embs))
  embeddings = tuple(outs[name] for name in coll_order[0])
  return (embeddings, tuple(routings)) if route else embeddings


def route_per_rank(coll_order, layouts, all_ids, all_weights, maps):
  return tuple(
      dataflow(layout).route_stack(layout, ids, weights, **_map_arg(slot_map))
      for (layout, ids, weights), slot_map in zip(
          per_stack(coll_order, layouts, all_ids, all_weights), maps))


def _map_arg(slot_map):
  """The slot map keyword of a column or replicated stack that has one."""
  return {} if slot_map is None else {"slot_map": slot_map}


def _by_stack(order, layouts, values):
  """Per-feature values (in collection order) grouped per stack."""
  by_name = dict(zip(order, values))
  return [[by_name[f.name] for f in layout.features] for layout in layouts]


def apply_per_rank(backend, kernel_config, order, layouts, states, routings,
                    all_grads, pending):
  new_states, stats = [], []
  for layout, state, routing, grads in zip(
      layouts, states, routings, _by_stack(order, layouts, all_grads)):
    table, opt_state, stack_stats = dataflow(layout).update(
        layout, backend, state.table, state.opt_state, routing, grads, pending,
        kernel_config)
    new_states.append(StackState(table, opt_state))
    stats.append(stack_stats)
  return tuple(new_states), tuple(stats)


def _dense_grads_per_rank(coll_order, layouts, tables, all_ids, all_weights,
                          all_cotangents):
  """The dense scatter-add cotangent of every stack table (of an int8
  serving copy: of the f32 rows it reads back as)."""
  cts = _by_stack(coll_order[0], layouts, all_cotangents)
  return tuple(
      dataflow(layout).dense_grad_stack(layout, _read_back(table), ids,
                                        weights, stack_cts)
      for (layout, ids, weights), table, stack_cts in zip(
          per_stack(coll_order, layouts, all_ids, all_weights), tables, cts))


def _read_back(table):
  """What a stack's dense cotangent is shaped like: the table, or for an
  int8 serving copy the f32 rows it reads back as."""
  if isinstance(table, QuantizedRows):
    return jax.ShapeDtypeStruct(table.codes.shape, jnp.float32)
  return table


# --- the differentiable lookup ----------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def collection_lookup(coll, layouts, table_specs, tables, all_ids,
                      all_weights):
  """Every feature's embeddings from `tables` (a state's stack tables, or a
  serving state's copies: `table_specs` are their PartitionSpecs)."""
  fn = functools.partial(lookup_per_rank, coll.backend, coll.kernel_config,
                         coll._order(), layouts, route=False)
  return exchange.shard(
      layouts[0].ctx, fn,
      in_specs=(table_specs, coll._feature_specs(), coll._pooled_specs()),
      out_specs=coll._feature_specs())(tables, all_ids, all_weights)


def collection_lookup_fwd(coll, layouts, table_specs, tables, all_ids,
                          all_weights):
  return (collection_lookup(coll, layouts, table_specs, tables, all_ids,
                            all_weights), (tables, all_ids, all_weights))


def collection_lookup_bwd(coll, layouts, table_specs, residuals, cotangents):
  tables, all_ids, all_weights = residuals
  fn = functools.partial(_dense_grads_per_rank, coll._order(), layouts)
  dense_specs = tuple(s.codes if isinstance(s, QuantizedRows) else s
                      for s in table_specs)
  dense = exchange.shard(
      layouts[0].ctx, fn,
      in_specs=(table_specs, coll._feature_specs(),
                coll._pooled_specs(), coll._feature_specs()),
      out_specs=dense_specs)(tables, all_ids, all_weights, tuple(cotangents))
  table_cts = tuple(_table_cotangent(coll.mesh, t, spec, ct)
                    for t, spec, ct in zip(tables, table_specs, dense))
  # No cotangent for the ids; the weights' would need the table (unused).
  return table_cts, None, jax.tree.map(jnp.zeros_like, all_weights)


def _table_cotangent(mesh, table, spec, dense):
  """A stack table's cotangent from the dense one of the rows it reads.

  A table held as uint16 bits (`placement.storage_dtype`) is not
  differentiable: float0. An int8 serving copy reads row r back as
  `codes[r] * scale[r] + bias[r]`: its scale's cotangent is
  `sum(codes[r] * dense[r])`, its bias's `sum(dense[r])`, its codes' float0.
  """
  if not isinstance(table, QuantizedRows):
    if jnp.issubdtype(table.dtype, jnp.inexact):
      return dense
    return np.zeros(table.shape, jax.dtypes.float0)
  rows = lambda x: exchange.place(x, NamedSharding(mesh, spec.scale))
  return QuantizedRows(
      np.zeros(table.codes.shape, jax.dtypes.float0),
      rows(jnp.sum(table.codes.astype(jnp.float32) * dense, axis=1)),
      rows(jnp.sum(dense, axis=1)))


collection_lookup.defvjp(collection_lookup_fwd, collection_lookup_bwd)
