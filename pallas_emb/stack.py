"""The per-rank dataflow of one stack of a collection.

Everything here runs on one rank inside the collection's `shard_map`, on
the static `layout.StackLayout` of the batch. Each entry travels as one
int32 *key*: `k >= 0` is the stacked row it looks up and trains, `k < 0`
encodes the row `~k` that it looks up but never trains (padding, ids
outside their table after one wrap, weight 0). The keys and the pooled
entries' weights share ONE all-gather per stack; the looked-up rows of
every feature share ONE all-to-all; the update dedups the communicator's
keys once and applies the stack's optimizer once.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import ordering
from pallas_emb import stack_grads
from pallas_emb import update as update_lib
from pallas_emb.dedup import FILL_VALUE
from pallas_emb.dedup import unique_and_segments
from pallas_emb.dedup import unique_by_slot_map
from pallas_emb.errors import InputError
from pallas_emb.kernels import common
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.layout import FeatureLayout
from pallas_emb.layout import StackLayout
from pallas_emb.quantize import QuantizedRows

REPLICATED = "replicated"


class StackRouting(NamedTuple):
  """How one batch's ids of a stack map onto unique rows.

  unique_tokens: int32 `[U]` sorted unique stacked rows, FILL_VALUE padded;
    replicated (first-occurrence order when routed through a slot map).
  segments: int32, per rank `[W * E]`: the unique slot of every entry of the
    communicator (the all-gathered order), -1 for none.
  weights: f32, per rank `[W * pooled entries]`: the combiner weight of
    every pooled entry of the communicator (empty without pooled features).
  num_distinct, num_overflow: int32 scalars (see `dedup`).
  slot_map: the stack's slot map after this route (all MAP_SENTINEL again),
    replicated, on its way back into the state; None for the sort dedup.
  by_slot: per rank, the entries of the communicator in slot order (each
    slot's in entry order): `(slots, routed rows, weights)` as the Mosaic
    gradient sums read them, `U` for no slot; the dedup's sort carries
    them (`routes_by_slot`), which spares the gradient sums a sort of
    their own. None elsewhere.
  """
  unique_tokens: jax.Array
  segments: jax.Array
  weights: jax.Array
  num_distinct: jax.Array
  num_overflow: jax.Array
  slot_map: jax.Array | None = None
  by_slot: tuple[jax.Array, jax.Array, jax.Array] | None = None


# --- keys and weights ------------------------------------------------------------


def resolve_ids(ids: jax.Array, vocab_rows: int, padding_id: int | None):
  """The one rule for what an id does, on every path (lookup, pooling, the
  sparse update, the dense gradient, the host-side counts).

  Returns `(rows, trains, padding)` per id: the row it reads (wrapped once
  if negative, then clamped into the table); whether it is padding (it
  reaches the padding row, `padding_id`'s own, after that wrap and clamp);
  whether it trains (inside the table after the wrap, and not padding).
  The padding row never trains, whatever id reaches it (0, -vocab_rows
  or, with padding_id=vocab_rows-1, -1); it is read like any row.
  """
  wrapped = common.wrap_once(ids, vocab_rows)
  rows = jnp.clip(wrapped, 0, vocab_rows - 1)
  trains = (wrapped >= 0) & (wrapped < vocab_rows)
  if padding_id is None:
    return rows, trains, jnp.zeros(rows.shape, bool)
  padding = rows == padding_id % vocab_rows  # in [-vocab_rows, vocab_rows)
  return rows, trains & ~padding, padding


def entry_keys(feature: FeatureLayout, ids: jax.Array,
               weights: jax.Array | None):
  """A feature's entries as keys (see the module docstring); `weights`: the
  pooled entries' weights (0: the entry does not train)."""
  rows, trains, _ = resolve_ids(ids.reshape(-1), feature.vocab_rows,
                                feature.padding_id)
  row = feature.row_offset + rows
  if weights is not None:
    trains &= weights.reshape(-1) != 0
  return jnp.where(trains, row, ~row)


def combiner_weights(feature: FeatureLayout, ids: jax.Array,
                     weights: jax.Array) -> jax.Array:
  """Per entry of `[B, L]` bags: the weight its row enters the pool with.

  `sum`: w; `mean`: w / sum(w); `sqrtn`: w / sqrt(sum(w^2)) (TF's
  embedding_lookup_sparse). Padding (`resolve_ids`) weighs 0; an empty
  bag pools to zeros.
  """
  w = weights.astype(jnp.float32)
  if feature.padding_id is not None:
    _, _, padding = resolve_ids(ids, feature.vocab_rows, feature.padding_id)
    w = jnp.where(padding, 0.0, w)
  if feature.combiner == "sum":
    return w
  total = (jnp.sum(w, axis=1, keepdims=True) if feature.combiner == "mean"
           else jnp.sqrt(jnp.sum(w * w, axis=1, keepdims=True)))
  # XLA rewrites a division by a broadcast (or by a sqrt) into a product
  # with a reciprocal (or rsqrt), whose last bit differs from TF's and from
  # platform to platform; behind the barrier the division is IEEE-exact.
  total = lax.optimization_barrier(
      jnp.broadcast_to(jnp.where(total != 0, total, 1.0), w.shape))
  return jnp.where(w != 0, w / total, 0.0)


def local_entries(layout: StackLayout, ids: Sequence[jax.Array],
                  weights: Sequence[jax.Array]) -> jax.Array:
  """int32 `[E + pooled entries]`: this rank's keys, then its pooled
  entries' weights as bits (what one collective carries).

  `ids`: this rank's ids per feature (the layout's order); `weights`: the
  combiner weights of its pooled features.
  """
  w_by_name = dict(zip((f.name for f in layout.pooled), weights))
  # A host-tier stack's entries arrive as keys of its cache rows already
  # (`per_rank.cache_keys`: `entry_keys`, then the cache map).
  parts = [x.reshape(-1) if f.cached
           else entry_keys(f, x, w_by_name.get(f.name))
           for f, x in zip(layout.features, ids)]
  wbits = [lax.bitcast_convert_type(w_by_name[f.name].reshape(-1),
                                    jnp.int32) for f in layout.pooled]
  return jnp.concatenate(parts + wbits) if len(parts + wbits) > 1 else (
      parts[0])


def split_entries(layout: StackLayout, entries: jax.Array):
  """`[..., E + pooled entries]` -> `(keys [..., E], weights [..., pooled
  entries])`, the inverse of `local_entries`."""
  return (entries[..., :layout.entries],
          lax.bitcast_convert_type(entries[..., layout.entries:],
                                   jnp.float32))


def gather_entries(layout: StackLayout, ids: Sequence[jax.Array],
                   weights: Sequence[jax.Array]):
  """One all-gather of the stack's keys (and pooled weights).

  Returns `(keys_all [W, E], weights_all [W, pooled entries])`.
  """
  gathered = exchange.all_gather_ids(
      layout.ctx, local_entries(layout, ids, weights)).reshape(
          layout.ctx.group_size, -1)
  return split_entries(layout, gathered)


def rows_of(keys: jax.Array) -> jax.Array:
  """The row each key looks up."""
  return jnp.where(keys < 0, ~keys, keys)


# --- lookup ----------------------------------------------------------------------


def serve(layout: StackLayout, backend: str, table, keys_all, weights_all,
          kernel_config=None) -> list[jax.Array]:
  """This rank's embeddings of every feature (the layout's order).

  Gathers this rank's columns of every sequence id and pools them for every
  bag of the communicator, then ONE all-to-all brings each rank the full
  rows of its own examples.
  """
  return exchange_served(layout, gather_served(layout, backend, table, keys_all,
                                             weights_all, kernel_config))


def serve_and_route(layout: StackLayout, backend: str, table, keys_all,
                    weights_all, kernel_config=None, slot_map=None
                    ) -> tuple[list[jax.Array], StackRouting]:
  """`serve` and `route` of one batch, the routing ordered after the gather.

  The update that reads this routing writes the table in place, so the
  routing depends on the first served row of each part (sequence rows,
  pooled rows) through `ordering.after`: no table copy even when the
  gradients do not read the embeddings.
  """
  served = gather_served(layout, backend, table, keys_all, weights_all,
                         kernel_config)
  routing = route(layout, keys_all, weights_all, slot_map,
                  by_slot=routes_by_slot(layout, backend, slot_map))
  return exchange_served(layout, served), routing._replace(
      unique_tokens=_after_served(layout, routing.unique_tokens, served))


def _after_served(layout: StackLayout, unique, served) -> jax.Array:
  """`unique`, made to depend on the first served row of each part
  (sequence rows, pooled rows) of `served` `[W, rows, S]`."""
  starts = (([0] if layout.sequence else []) +
            ([layout.sequence_entries] if layout.pooled else []))
  return ordering.after(unique, *(served[0, start] for start in starts))


def gather_served(layout: StackLayout, backend: str, table, keys_all,
                  weights_all, kernel_config=None) -> jax.Array:
  """`[W, rows per rank, S]`: this rank's columns of every row it serves.

  `table` is the stack's table, or its row-wise int8 serving copy
  (`QuantizedRows`): then each row is dequantized inside the gather and the
  pool, and the served rows are f32.
  """
  ctx = layout.ctx
  w = ctx.group_size
  rows = rows_of(keys_all)
  config = kernel_config or kernels.KernelConfig()
  if isinstance(table, QuantizedRows):
    gather = lambda ids: kernels.gather_dequantized(
        *table, ids, backend=backend, config=config.quantized)
    pool = lambda *args, **kw: kernels.pool_dequantized(
        *table, *args, **kw, backend=backend, config=config.quantized)
  else:
    width = ctx.shard_width  # the table may be stored with padded rows
    gather = lambda ids: kernels.gather_rows(table, ids, backend=backend,
                                             config=config.gather,
                                             width=width)
    pool = lambda *args, **kw: kernels.pool_rows(
        table, *args, **kw, backend=backend, config=config.pool,
        width=width)
  served = []
  if layout.sequence:
    seq = rows[:, :layout.sequence_entries].reshape(-1)
    served.append(gather(seq).reshape(w, layout.sequence_entries, -1))
  if layout.pooled:
    pooled = pool(rows[:, layout.sequence_entries:].reshape(-1),
                  weights_all.reshape(-1), layout.bag_starts(),
                  max_len=layout.max_bag_len)
    served.append(pooled.reshape(w, layout.pooled_bags, -1))
  return jnp.concatenate(served, axis=1) if len(served) > 1 else served[0]


def exchange_served(layout: StackLayout, served: jax.Array) -> list[jax.Array]:
  """ONE all-to-all of the served rows -> this rank's rows per feature."""
  mine = exchange.exchange_rows(layout.ctx,
                                served.reshape(-1, served.shape[-1]))
  return split_rows(layout, mine)


def split_rows(layout: StackLayout, rows: jax.Array) -> list[jax.Array]:
  """This rank's exchanged rows `[T, D]` -> one array per feature."""
  out, start = [], 0
  for f in layout.features:
    shape = (f.local_examples,) + (() if f.pooled else f.shape[1:])
    out.append(rows[start:start + f.local_rows].reshape(
        shape + rows.shape[-1:]))
    start += f.local_rows
  return out


# --- gradients (their sums per slot: `stack_grads.py`) ------------------------


def routes_by_slot(layout: StackLayout, backend: str | None,
                   slot_map=None) -> bool:
  """Whether the stack's routing carries its entries in slot order
  (`StackRouting.by_slot`): a sort dedup on the Mosaic backend, of a
  column stack without replicas (whose entries are this rank's alone)."""
  return (backend in update_lib.MOSAIC and slot_map is None
          and layout.placement != REPLICATED and not layout.ctx.replica_axis)


def route(layout: StackLayout, keys_all, weights_all,
          slot_map=None, by_slot: bool = False) -> StackRouting:
  """Dedup of the communicator's keys (global over replicas); through
  `slot_map` (the stack's, from its state) if given, else by a sort.
  `by_slot`: the sort carries the entries' routed rows and weights too
  (`routes_by_slot`)."""
  keys = jnp.where(keys_all < 0, FILL_VALUE, keys_all).reshape(-1)
  along = ()
  if by_slot:
    along = (jnp.asarray(stack_grads.entry_rows(layout)),
             stack_grads.entry_weights(layout, weights_all))
  *dedup, slot_map = dedup_over_replicas(
      layout.ctx, keys, layout.ctx.num_unique, layout.regions, slot_map,
      sort_along=along)
  unique, segments, distinct, overflow, *sorted_entries = dedup
  return StackRouting(unique, segments, weights_all.reshape(-1), distinct,
                      overflow, slot_map,
                      sorted_entries[0] if sorted_entries else None)


def dedup_over_replicas(ctx, keys: jax.Array, num_unique: int, regions=(),
                        slot_map=None, sort_along=()):
  """`unique_and_segments` of `keys` `[N]` (FILL_VALUE: none) over every
  replica: the unique rows are the same on every replica (so each applies
  the same update to the same slots), the segments this replica's `[N]`.
  With `slot_map`: `unique_by_slot_map` instead (the same slots in
  first-occurrence order); returns the map after the dedup last (None
  without one). Every replica dedups the same keys, so the maps agree."""
  n = keys.shape[0]
  if ctx.replica_axis:
    keys = lax.all_gather(keys, exchange.axis_name(ctx.replica_axis),
                          axis=0, tiled=True)
  by_slot = ()
  if slot_map is None:
    unique, segments, distinct, overflow, *by_slot = unique_and_segments(
        keys, num_unique, regions=regions, on_cpu=on_cpu(ctx),
        on_tpu=on_tpu(ctx), sort_along=sort_along)
  else:
    unique, segments, distinct, overflow, slot_map = unique_by_slot_map(
        keys, num_unique, slot_map, regions=regions)
  if ctx.replica_axis:
    replica = lax.axis_index(exchange.axis_name(ctx.replica_axis))
    segments = lax.dynamic_slice_in_dim(segments, replica * n, n)
  return (unique, segments, distinct, overflow, *by_slot, slot_map)


def on_cpu(ctx) -> bool:
  """Whether the layout's devices are CPUs (picks the dedup formulation)."""
  return ctx.mesh.devices.flat[0].platform == "cpu"


def on_tpu(ctx) -> bool:
  """Whether the layout's devices are TPUs (the dedup without scatters)."""
  return ctx.mesh.devices.flat[0].platform == "tpu"


# The xla backend's update on CPU runs at the smallest of these sizes of
# the unique buffer that holds the batch's rows: the buffer is sized for
# every id distinct, a batch fills a prefix of it (`dedup`), and the
# update's `[U, S]` sums, zero-filled every step, cost by U. Halvings of
# the buffer down to MIN_TIER_SLOTS, at most MAX_TIERS sizes, picked in the
# step (every size is compiled; see `update`). Tests lower MIN_TIER_SLOTS.
MIN_TIER_SLOTS = 4096
MAX_TIERS = 5


def slot_tiers(num_slots: int) -> tuple[int, ...]:
  """The sizes the update may run at, largest (the buffer) first."""
  tiers = [num_slots]
  while len(tiers) < MAX_TIERS and (tiers[-1] + 1) // 2 >= MIN_TIER_SLOTS:
    tiers.append((tiers[-1] + 1) // 2)
  return tuple(tiers)


def update(layout: StackLayout, backend: str, table, opt_state,
           routing: StackRouting, grads, pending, kernel_config=None):
  """The stack's fused sparse update from its features' gradients.

  The unique buffer's size is the routing's (`unique_tokens`), which may
  differ from the layout's (the single-table API's `num_unique`). On the
  xla backend on CPU the update runs on the buffer's prefix up to its last
  row, rounded up to a `slot_tiers` size: the same results, every slot
  past it being FILL_VALUE (unique rows are the same on every rank, so
  every rank picks the same size).
  """
  if layout.optimizer is None:
    raise InputError(
        f"pallas_emb {layout.name} has no optimizer (its TableSpecs say "
        "optimizer=None: looked up only); give its tables a sparse "
        "optimizer to train them.")
  unique = routing.unique_tokens
  # Measured on XLA:CPU only; accelerators run the whole buffer.
  tiers = (slot_tiers(unique.shape[0])
           if backend == "xla" and on_cpu(layout.ctx) else ())

  def update_prefix(slots, table, opt_state, zero=None):
    prefix = routing._replace(unique_tokens=unique[:slots])
    return _update(layout, backend, table, opt_state, prefix, grads,
                   pending, kernel_config, zero)

  if len(tiers) < 2:
    return update_prefix(unique.shape[0], table, opt_state)
  extent = jnp.max(jnp.where(unique != FILL_VALUE,
                             jnp.arange(1, unique.shape[0] + 1), 0))
  pick = sum((extent <= t).astype(jnp.int32) for t in tiers[1:])
  # One loop per size, run once (the picked one) or not at all: XLA:CPU
  # updates a while loop's table in place, where a `lax.switch` copies it.
  # The sums start from a zero made of the loop's counter, so XLA does not
  # hoist their zero-fill out of the loop (`kernels.xla.zero_sums`).
  stats = update_lib.UpdateStats(jnp.float32(0), *[jnp.int32(0)] * 3)
  for i, slots in enumerate(tiers):
    table, opt_state, stats = lax.fori_loop(
        0, (pick == i).astype(jnp.int32),
        lambda j, carry, slots=slots: update_prefix(
            slots, *carry[:2], zero=j.astype(jnp.float32) * 0),
        (table, opt_state, stats))
  return table, opt_state, stats


def _update(layout: StackLayout, backend: str, table, opt_state,
            routing: StackRouting, grads, pending, kernel_config, zero=None):
  weights_all = routing.weights.reshape(layout.ctx.group_size, -1)
  norms = (update_lib.NONE if layout.placement == REPLICATED
           else update_lib.COLUMNS)
  num_unique = routing.unique_tokens.shape[0]
  round_dtype = common.logical_dtype(table.dtype)
  if (backend in update_lib.MOSAIC
      and stored.is_stored(table, layout.ctx.shard_width)):
    grad_accum, row_sq = stack_grads.mosaic_grad_sums(
        layout, backend, table, routing, grads, weights_all)
    return update_lib.update_from_sums(
        layout.ctx, layout.optimizer, backend, table, opt_state, grad_accum,
        row_sq, routing.unique_tokens, pending, routing.num_overflow,
        kernel_config, norms, stored_grads=True,
        # The dedup's buffer ascends; a slot map's is in first-seen order.
        sorted_tokens=routing.slot_map is None)
  if backend != "xla":
    return update_lib.update_from_routed(
        layout.ctx, layout.optimizer, backend, table, opt_state,
        stack_grads.routed_entry_grads(layout, grads, weights_all),
        routing.segments, routing.unique_tokens, pending,
        routing.num_overflow, kernel_config, norms)
  if layout.pooled:
    grad_accum, row_sq = stack_grads.grad_sums_by_position(
        layout, grads, weights_all, routing.segments, num_unique,
        round_dtype, zero)
  else:
    grad_accum, row_sq = kernels.xla.segment_sum_rows(
        stack_grads.routed_entry_grads(layout, grads, weights_all),
        routing.segments, num_unique, round_dtype=round_dtype, zero=zero)
  return update_lib.update_from_sums(
      layout.ctx, layout.optimizer, backend, table, opt_state, grad_accum,
      row_sq, routing.unique_tokens, pending, routing.num_overflow,
      kernel_config, norms)


def dense_grad(layout: StackLayout, table, keys_all, weights_all, cotangents):
  """The dense scatter-add cotangent of the stack's table (plain jax.grad).

  Entries that never train (padding, ids outside their table) add nothing,
  as in the sparse update: the dense and the sparse path train the same
  rows. Summed over replicas, in the table's dtype.
  """
  routed = stack_grads.routed_entry_grads(layout, cotangents, weights_all)
  if routed.shape[-1] != table.shape[1]:  # a stored f32 table: padded rows
    routed = stored.to_grads(routed, jnp.float32)
  keys = keys_all.reshape(-1)
  dense = jnp.zeros(table.shape, jnp.float32).at[
      jnp.where(keys >= 0, keys, table.shape[0])].add(
          routed.astype(jnp.float32), mode="drop")
  if layout.ctx.replica_axis:
    dense = lax.psum(dense, layout.ctx.replica_axis)
  return dense.astype(common.logical_dtype(table.dtype))


# --- the per-rank entry points of a column or replicated stack --------------------
# (`row.py` has the same four for row and table placements.)


def lookup_stack(layout: StackLayout, backend: str, table, ids, weights,
                 kernel_config=None, with_routing=False, slot_map=None):
  """The stack's embeddings (the layout's order) [+ its routing, deduped
  through `slot_map` if given].

  Column: one all-gather of the keys, this rank's columns of every row,
  one all-to-all. Replicated: every rank holds the whole table, so a
  lookup reads its own rows (no collective); only the routing all-gathers
  the keys, so that every replica applies the same update.
  """
  if layout.placement != REPLICATED:
    keys_all, weights_all = gather_entries(layout, ids, weights)
    if with_routing:
      return serve_and_route(layout, backend, table, keys_all, weights_all,
                             kernel_config, slot_map)
    return serve(layout, backend, table, keys_all, weights_all,
                 kernel_config)
  entries = local_entries(layout, ids, weights)
  mine = dataclasses.replace(layout, ctx=dataclasses.replace(
      layout.ctx, group_size=1))
  served = gather_served(mine, backend, table,
                         *split_entries(layout, entries[None]),
                         kernel_config)
  embs = split_rows(layout, served[0])
  if not with_routing:
    return embs
  gathered = exchange.all_gather_ids(layout.ctx, entries).reshape(
      layout.ctx.group_size, -1)
  routing = route(layout, *split_entries(layout, gathered), slot_map)
  return embs, routing._replace(unique_tokens=_after_served(
      layout, routing.unique_tokens, served))


def route_stack(layout: StackLayout, ids, weights,
                slot_map=None) -> StackRouting:
  return route(layout, *gather_entries(layout, ids, weights), slot_map)


def dense_grad_stack(layout: StackLayout, table, ids, weights, cotangents):
  return dense_grad(layout, table, *gather_entries(layout, ids, weights),
                    cotangents)
