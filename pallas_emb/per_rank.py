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
from jax import lax
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


def _per_stack_cached(coll_order, layouts, all_ids, all_weights,
                      cache_maps):
  """`per_stack`, with a host-tier stack's ids as keys of its cache rows
  (`cache_keys`, through its `(map, entries)` in `cache_maps`) and, last,
  the count of its entries whose row is not cached (None for a device
  stack)."""
  for (layout, ids, weights), cache in zip(
      per_stack(coll_order, layouts, all_ids, all_weights),
      cache_maps or (None,) * len(layouts)):
    missing = None
    if cache is not None:
      ids, missing = cache_keys(layout, ids, weights, *cache)
    yield layout, ids, weights, missing


def _cache_rows(cache_map, rows, entries):
  """Each entry's cache row: the host's translation (`entries`: `(cache
  row, logical row)` of the batch last prefetched), checked entry by entry
  against the logical `rows`; the map's, for every entry, only where one
  differs (another batch of the same shape) or there is none. A gather of
  every entry from the map costs a TPU v5e 4.45 ms for 327,680 entries;
  the check, an element-wise compare."""
  if entries is None:
    return jnp.take(cache_map, rows)
  cache, host_rows = (e.reshape(rows.shape) for e in entries)
  stale = host_rows != rows
  return lax.cond(jnp.any(stale),
                  lambda: jnp.where(stale, jnp.take(cache_map, rows), cache),
                  lambda: cache)


def cache_keys(layout, ids, weights, cache_map, entries=None):
  """A host-tier stack's entries as keys of its cache rows, and how many
  entries of the communicator read a row the cache does not hold (int32).

  `stack.entry_keys` makes each entry's key of its logical row (the id
  rules of every stack: wrap once, clamp, padding, weight 0); the host's
  translation of the prefetched batch (`entries`, per feature), else the
  cache map, turns the row into its cache row (docs/host_tier.md). An
  entry whose row is not cached (its batch was not prefetched:
  `coll.prefetch`) reads cache row 0 and never trains; the routing adds
  it to `num_overflow`, which `raise_if_overflow` (and the Trainer) turn
  into an error.
  """
  w_by_name = dict(zip((f.name for f in layout.pooled), weights))
  out, missing = [], jnp.int32(0)
  for f, x in zip(layout.features, ids):
    keys = stack.entry_keys(f, x, w_by_name.get(f.name))
    cache = _cache_rows(cache_map, stack.rows_of(keys),
                        None if entries is None else entries[f.name])
    absent = cache < 0
    missing += jnp.sum(absent, dtype=jnp.int32)
    cache = jnp.where(absent, 0, cache)
    out.append(jnp.where((keys >= 0) & ~absent, cache, ~cache))
  ctx = layout.ctx
  return out, lax.psum(missing, exchange.axis_name(ctx.table_axis
                                                   + ctx.replica_axis))


def _with_missing(routing, missing):
  """A routing whose overflow count includes the entries read uncached."""
  if missing is None:
    return routing
  return routing._replace(num_overflow=routing.num_overflow + missing)


def lookup_per_rank(backend, kernel_config, coll_order, layouts, tables,
                     all_ids, all_weights, cache_maps=None, maps=None, *,
                     route):
  """Embeddings of every feature (collection order) [+ each stack's routing,
  deduped through its slot map where `maps` (per stack) has one]; a
  host-tier stack's rows through its cache map in `cache_maps`."""
  outs, routings = {}, []
  for (layout, ids, weights, missing), table, slot_map in zip(
      _per_stack_cached(coll_order, layouts, all_ids, all_weights,
                        cache_maps), tables, maps or (None,) * len(layouts)):
    embs = dataflow(layout).lookup_stack(layout, backend, table, ids, weights,
                                         kernel_config, with_routing=route,
                                         **_map_arg(slot_map))
    if route:
      embs, routing = embs
      routings.append(_with_missing(routing, missing))
    outs.update(zip((f.name for f in layout.features), embs))
  embeddings = tuple(outs[name] for name in coll_order[0])
  return (embeddings, tuple(routings)) if route else embeddings


def route_per_rank(coll_order, layouts, all_ids, all_weights, maps,
                   cache_maps=None):
  return tuple(
      _with_missing(dataflow(layout).route_stack(layout, ids, weights,
                                                 **_map_arg(slot_map)),
                    missing)
      for (layout, ids, weights, missing), slot_map in zip(
          _per_stack_cached(coll_order, layouts, all_ids, all_weights,
                            cache_maps), maps))


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
                          all_cotangents, cache_maps=None):
  """The dense scatter-add cotangent of every stack table (of an int8
  serving copy: of the f32 rows it reads back as; of a host-tier stack:
  of its cache)."""
  cts = _by_stack(coll_order[0], layouts, all_cotangents)
  return tuple(
      dataflow(layout).dense_grad_stack(layout, _read_back(table), ids,
                                        weights, stack_cts)
      for (layout, ids, weights, _), table, stack_cts in zip(
          _per_stack_cached(coll_order, layouts, all_ids, all_weights,
                            cache_maps), tables, cts))


def _read_back(table):
  """What a stack's dense cotangent is shaped like: the table, or for an
  int8 serving copy the f32 rows it reads back as."""
  if isinstance(table, QuantizedRows):
    return jax.ShapeDtypeStruct(table.codes.shape, jnp.float32)
  return table


# --- the differentiable lookup ----------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def collection_lookup(coll, layouts, table_specs, tables, all_ids,
                      all_weights, cache_maps):
  """Every feature's embeddings from `tables` (a state's stack tables, or a
  serving state's copies: `table_specs` are their PartitionSpecs); a
  host-tier stack's rows through its cache map in `cache_maps`."""
  fn = functools.partial(lookup_per_rank, coll.backend, coll.kernel_config,
                         coll._order(), layouts, route=False)
  return exchange.shard(
      layouts[0].ctx, fn,
      in_specs=(table_specs, coll._feature_specs(), coll._pooled_specs(),
                _map_specs(coll, cache_maps)),
      out_specs=coll._feature_specs())(tables, all_ids, all_weights,
                                       cache_maps)


def _map_specs(coll, cache_maps):
  """The specs of the cache maps (None: a serving state has none)."""
  return None if cache_maps is None else coll._cache_map_specs(cache_maps)


def collection_lookup_fwd(coll, layouts, table_specs, tables, all_ids,
                          all_weights, cache_maps):
  return (collection_lookup(coll, layouts, table_specs, tables, all_ids,
                            all_weights, cache_maps),
          (tables, all_ids, all_weights, cache_maps))


def collection_lookup_bwd(coll, layouts, table_specs, residuals, cotangents):
  tables, all_ids, all_weights, cache_maps = residuals
  fn = functools.partial(_dense_grads_per_rank, coll._order(), layouts)
  dense_specs = tuple(s.codes if isinstance(s, QuantizedRows) else s
                      for s in table_specs)
  dense = exchange.shard(
      layouts[0].ctx, fn,
      in_specs=(table_specs, coll._feature_specs(),
                coll._pooled_specs(), coll._feature_specs(),
                _map_specs(coll, cache_maps)),
      out_specs=dense_specs)(tables, all_ids, all_weights, tuple(cotangents),
                             cache_maps)
  table_cts = tuple(_table_cotangent(coll.mesh, t, spec, ct)
                    for t, spec, ct in zip(tables, table_specs, dense))
  # No cotangent for the ids, nor for the cache maps; the weights' would
  # need the table (unused).
  return (table_cts, None, jax.tree.map(jnp.zeros_like, all_weights),
          jax.tree.map(lambda m: np.zeros(m.shape, jax.dtypes.float0),
                       cache_maps))


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
