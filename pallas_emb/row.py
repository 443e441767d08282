"""The per-rank dataflow of a row- or table-placed stack.

Each rank holds whole rows of the stack (`stacking.py`): a row stack's rank r
the stacked rows g with `g % W == r` (local row `g // W`), a table stack's
rank r the block `[r * block_rows, (r + 1) * block_rows)`. Per rank and
step:

  keys      this rank's entries as keys (`stack.entry_keys`: the same wrap,
            clamp and padding as column)
  dedup     the distinct rows of this rank's own entries
  buckets   each distinct row to its owner's bucket of a static `[W, C]`
            send buffer (C: `layout.capacity`); a row past its bucket's C
            overflows: served as zeros, never trained, counted
  ONE all-to-all of the rows' local ids; the owner gathers `[W * C, D]`
            with the gather kernel; ONE all-to-all brings them back
  serve     sequence entries read their row, pooled bags pool on this rank
  update    the entries' gradients summed per bucket slot (f32), ONE
            all-to-all `[W * C, D]` to the owners; an owner sums a row's
            pieces in sender order (deterministic) and applies the fused
            update to its local rows

An owner's local id travels as `l` if some entry of it trains, `~l` if it
is only looked up, FILL_VALUE for an empty bucket slot.

A stack of pooled features only may instead pool on the owners
(`layout.pool_on_owner`, when that moves fewer bytes: `layout.pooling_bytes`).
The buckets still decide overflow, but each rank sends every owner all its
pooled entries `[W, P]` (local row, or FILL_VALUE where another owner's or
overflowed; the weights' bits after them): a bag's index is its entries'
place. The owner pools them into f32 partial sums `[W * B, D]` per (sender,
bag), ONE all-to-all brings each rank its bags' W partials, summed in rank
order and rounded once. The update sends each bag's gradient to every
owner `[W * B, D]`; the owner scales it per received entry by the entry's
weight and sums a row's entries in (sender, entry) order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import ordering
from pallas_emb import quantize
from pallas_emb import stack
from pallas_emb import stack_grads
from pallas_emb import update as update_lib
from pallas_emb.dedup import FILL_VALUE
from pallas_emb.dedup import unique_and_segments
from pallas_emb.errors import InputError
from pallas_emb.kernels import common
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.layout import StackLayout
from pallas_emb.quantize import QuantizedRows


class RowRouting(NamedTuple):
  """How one batch's entries of a row or table stack reach their owners.

  Per rank: `send_slot` int32 `[E]` each entry's slot in the send buffer
  `[W * C]` (W * C: overflowed, reads a zero row); `train_slot` `[E]` the
  same for entries that train, -1 for the others; `weights` f32 `[pooled
  entries]` the combiner weights; `owner_unique` `[W * C]` the sorted
  distinct local rows this rank owns that the batch trains (FILL_VALUE
  padded) and `owner_segments` `[W * C]` each received slot's place in it
  (-1: none). Pooling on the owners, `weights` and `owner_segments` are
  `[W * P]`, per received entry. `num_distinct`, `num_overflow`: int32
  scalars over the communicator (distinct trained rows; distinct rows that
  overflowed).
  """
  send_slot: jax.Array
  train_slot: jax.Array
  weights: jax.Array
  owner_unique: jax.Array
  owner_segments: jax.Array
  num_distinct: jax.Array
  num_overflow: jax.Array


def _owner_and_local(layout: StackLayout, rows: jax.Array):
  w = layout.ctx.group_size
  if layout.placement == "table":
    return rows // layout.block_rows, rows % layout.block_rows
  return rows % w, rows // w


def _buckets(layout: StackLayout, keys: jax.Array):
  """`(send [W * C] local ids, send_slot [E], train_slot [E], overflow)`
  from this rank's keys `[E]`."""
  ctx = layout.ctx
  w, c, n = ctx.group_size, layout.capacity, keys.shape[0]
  trains = keys >= 0
  unique, segments, _, _ = unique_and_segments(
      stack.rows_of(keys), n, on_cpu=stack.on_cpu(ctx),
      on_tpu=stack.on_tpu(ctx))
  unique_trains = jnp.zeros((n,), jnp.int32).at[segments].max(
      trains.astype(jnp.int32)) > 0
  real = unique != FILL_VALUE
  owner, local = _owner_and_local(layout, unique)
  owner = jnp.where(real, owner, w)
  # A row's place in its owner's bucket: its rank among the distinct rows
  # of the same owner (a stable sort by owner keeps them in row order).
  by_owner, order = lax.sort((owner, lax.iota(jnp.int32, n)), num_keys=1)
  starts = jnp.searchsorted(by_owner, jnp.arange(w + 1, dtype=jnp.int32))
  place = jnp.zeros((n,), jnp.int32).at[order].set(
      lax.iota(jnp.int32, n) - starts[by_owner].astype(jnp.int32),
      unique_indices=True)
  kept = real & (place < c)
  slot = jnp.where(kept, owner * c + place, w * c)
  send = jnp.full((w * c,), FILL_VALUE, jnp.int32).at[slot].set(
      jnp.where(unique_trains, local, ~local), mode="drop")
  send_slot = slot[segments]
  train_slot = jnp.where(trains & (send_slot < w * c), send_slot, -1)
  overflow = jnp.sum(real & ~kept, dtype=jnp.int32)
  return send, send_slot, train_slot, overflow


def _psum(ctx, x, replicas=False):
  """`x` summed over the communicator (and over the replicas)."""
  axes = ((ctx.table_axis if ctx.group_size > 1 else ())
          + (ctx.replica_axis if replicas else ()))
  return lax.psum(x, exchange.axis_name(axes)) if axes else x


def _received_rows(received: jax.Array) -> jax.Array:
  """The local row each received slot reads (0 for an empty slot)."""
  return jnp.where(received == FILL_VALUE, 0,
                   jnp.where(received < 0, ~received, received))


def _owner_routing(layout: StackLayout, received: jax.Array):
  """`(owner_unique, owner_segments, num_distinct)` of the received ids.

  With replicas, the owner's unique rows are those every replica's senders
  ask of it (the same on every replica: `update` then sums the replicas'
  pieces of each slot in replica order, and every copy of the row gets the
  same update)."""
  ctx = layout.ctx
  trains = (received >= 0) & (received != FILL_VALUE)
  unique, segments, distinct, _, _ = stack.dedup_over_replicas(
      ctx, jnp.where(trains, received, FILL_VALUE),
      received.shape[0] * ctx.num_replicas)
  return unique, segments, _psum(ctx, distinct)


def _entries_to_owners(layout: StackLayout, keys, weights, send_slot):
  """int32 `[W * 2P]`: per owner, every pooled entry of this rank (its
  local row l if the entry trains, `~l` if it is only looked up,
  FILL_VALUE where another owner's or overflowed: read as row 0 with
  weight 0), then their weights' bits (0 there)."""
  w, c = layout.ctx.group_size, layout.capacity
  _, local = _owner_and_local(layout, stack.rows_of(keys))
  # An overflowed entry's slot is W * C: owner W, nobody's.
  mine = (send_slot // c)[None, :] == jnp.arange(w, dtype=jnp.int32)[:, None]
  ids = jnp.where(mine, jnp.where(keys >= 0, local, ~local)[None],
                  FILL_VALUE)
  bits = lax.bitcast_convert_type(jnp.where(mine, weights[None], 0.0),
                                  jnp.int32)
  return jnp.concatenate([ids, bits], axis=1).reshape(-1)


def _exchange_keys(layout: StackLayout, ids, weights):
  """This rank's buckets (or, pooling on the owners, its entries) sent to
  their owners: `(routing, received local ids)`."""
  ctx = layout.ctx
  keys, entry_weights = stack.split_entries(
      layout, stack.local_entries(layout, ids, weights))
  send, send_slot, train_slot, overflow = _buckets(layout, keys)
  if layout.pool_on_owner:
    send = _entries_to_owners(layout, keys, entry_weights, send_slot)
  received = exchange.all_to_all(ctx, send)
  if layout.pool_on_owner:
    received = received.reshape(ctx.group_size, 2, -1)
    entry_weights = lax.bitcast_convert_type(received[:, 1],
                                             jnp.float32).reshape(-1)
    received = received[:, 0].reshape(-1)
  unique, segments, distinct = _owner_routing(layout, received)
  return RowRouting(send_slot, train_slot, entry_weights, unique, segments,
                    distinct, _psum(ctx, overflow, replicas=True)), received


def _local_bag_starts(layout: StackLayout) -> np.ndarray:
  lengths = np.concatenate([np.full(f.local_examples, f.bag_len)
                            for f in layout.pooled])
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _sum_in_rank_order(parts: jax.Array) -> jax.Array:
  """`[W, ...]` -> `[...]`: `((parts[0] + parts[1]) + parts[2]) + ...`, the
  same order on every platform (a reduction's order is the compiler's)."""
  return lax.fori_loop(
      1, parts.shape[0],
      lambda r, acc: acc + lax.dynamic_index_in_dim(parts, r, 0, False),
      parts[0], unroll=min(parts.shape[0], 8))


def _serve_on_owner(layout: StackLayout, backend: str, table,
                    routing: RowRouting, received, config):
  """`(embeddings per feature, the owner's partial sums)`: the owner pools
  its entries per (sender, bag) in f32, each rank sums its bags' W
  partials in rank order and rounds once."""
  ctx = layout.ctx
  bags = (_received_rows(received), routing.weights,
          layout.bag_starts())
  if isinstance(table, QuantizedRows):  # a serving copy: f32 out
    partials = kernels.pool_dequantized(
        *table, *bags, max_len=layout.max_bag_len, backend=backend,
        config=config.quantized)
    out_dtype = jnp.float32
  else:
    partials = kernels.pool_rows(
        table, *bags, max_len=layout.max_bag_len, backend=backend,
        config=config.pool, out_dtype=jnp.float32,
        width=layout.ctx.shard_width)
    out_dtype = stored.logical_dtype(table)
  mine = exchange.all_to_all(ctx, partials).reshape(
      ctx.group_size, layout.pooled_bags, -1)
  pooled = _sum_in_rank_order(mine).astype(out_dtype)
  return stack.split_rows(layout, pooled), partials


def _serve(layout: StackLayout, backend: str, table, routing: RowRouting,
           received, kernel_config):
  """`(embeddings per feature, the owner's gathered rows)`.

  `table` may be a row-wise int8 serving copy (`QuantizedRows`): the owner
  then sends fused int8 rows (`quantize.fuse`) and this rank dequantizes
  them inside its gather and pool (f32 out)."""
  config = kernel_config or kernels.KernelConfig()
  if layout.pool_on_owner:
    return _serve_on_owner(layout, backend, table, routing, received, config)
  local = _received_rows(received)
  quantized = isinstance(table, QuantizedRows)
  if quantized:
    gathered = quantize.fuse(QuantizedRows(
        kernels.gather_rows(table.codes, local, backend=backend,
                            config=config.gather),
        jnp.take(table.scale, local), jnp.take(table.bias, local)))
  else:
    gathered = kernels.gather_rows(table, local, backend=backend,
                                   config=config.gather,
                                   width=layout.ctx.shard_width)
  rows = exchange.all_to_all(layout.ctx, gathered)
  # Slot W * C (an overflowed row) reads zeros (fused: codes, scale and
  # bias 0).
  rows = jnp.concatenate([rows, jnp.zeros((1, rows.shape[1]), rows.dtype)])
  seq = layout.sequence_entries
  bags = (routing.send_slot[seq:], routing.weights,
          _local_bag_starts(layout)) if layout.pooled else ()
  served = []
  if quantized:
    rows = quantize.unfuse(rows)
    if layout.sequence:
      served.append(kernels.gather_dequantized(
          *rows, routing.send_slot[:seq], backend=backend,
          config=config.quantized))
    if layout.pooled:
      served.append(kernels.pool_dequantized(
          *rows, *bags, max_len=layout.max_bag_len, backend=backend,
          config=config.quantized))
  else:
    if layout.sequence:
      served.append(jnp.take(rows, routing.send_slot[:seq], axis=0))
    if layout.pooled:
      served.append(kernels.pool_rows(
          rows, *bags, max_len=layout.max_bag_len, backend=backend,
          config=config.pool))
  out = jnp.concatenate(served) if len(served) > 1 else served[0]
  return stack.split_rows(layout, out), gathered


def lookup_stack(layout: StackLayout, backend: str, table, ids, weights,
                 kernel_config=None, with_routing=False):
  """The stack's embeddings (the layout's order) [+ its routing]."""
  routing, received = _exchange_keys(layout, ids, weights)
  embs, gathered = _serve(layout, backend, table, routing, received,
                          kernel_config)
  if not with_routing:
    return embs
  # The update writes the owner's rows in place: after this gather.
  return embs, routing._replace(
      owner_unique=ordering.after(routing.owner_unique, gathered))


def route_stack(layout: StackLayout, ids, weights) -> RowRouting:
  return _exchange_keys(layout, ids, weights)[0]


def _sent_grads(layout: StackLayout, grads, routing: RowRouting, backend,
                round_dtype, kernel_config):
  """f32 `[W * C, D]`: this rank's gradient sums per send-buffer slot,
  delivered to the owners (ONE all-to-all; block w from rank w)."""
  rows = stack_grads.local_rows(grads)
  if layout.pooled:
    seq = layout.sequence_entries
    bags = rows[seq:]
    per_entry = jnp.take(bags, jnp.asarray(layout.entry_bags()), axis=0)
    # Rounded on its own, as column's: never contracted into the sums.
    per_entry = common.unfused_product(per_entry, routing.weights[:, None])
    rows = jnp.concatenate([rows[:seq], per_entry])
  ctx = layout.ctx
  sums, _ = kernels.segment_sum_rows(
      rows, routing.train_slot, ctx.group_size * layout.capacity,
      round_dtype=round_dtype, backend=backend,
      config=kernel_config.segment_sum if kernel_config else None)
  return exchange.all_to_all(ctx, sums)


def _owner_entry_grads(layout: StackLayout, grads, routing: RowRouting):
  """Pooling on the owners: f32 `[W * P, D]`, on the owner, the gradient
  of every received entry: its bag's (ONE all-to-all sends each bag's
  gradient to every owner) times its weight."""
  ctx = layout.ctx
  w = ctx.group_size
  bags = stack_grads.local_rows(grads)
  received = exchange.all_to_all(ctx, jnp.tile(bags, (w, 1)))
  bag_of_entry = (np.arange(w, dtype=np.int32)[:, None] * layout.pooled_bags
                  + layout.entry_bags()[None]).reshape(-1)
  per_entry = jnp.take(received, jnp.asarray(bag_of_entry), axis=0)
  # Rounded on its own, as the other paths': never contracted into sums.
  return common.unfused_product(per_entry, routing.weights[:, None])


def update(layout: StackLayout, backend: str, table, opt_state,
           routing: RowRouting, grads, pending, kernel_config=None):
  """The owner's fused sparse update of its rows from every sender's sums."""
  if layout.optimizer is None:
    raise InputError(
        f"pallas_emb {layout.name} has no optimizer (its TableSpecs say "
        "optimizer=None: looked up only); give its tables a sparse "
        "optimizer to train them.")
  if layout.pool_on_owner:
    received = _owner_entry_grads(layout, grads, routing)
  else:
    received = _sent_grads(layout, grads, routing, backend,
                           stored.logical_dtype(table), kernel_config)
  return update_lib.update_from_routed(
      layout.ctx, layout.optimizer, backend, table, opt_state, received,
      routing.owner_segments, routing.owner_unique, pending,
      routing.num_overflow, kernel_config, norms=update_lib.ROWS)


def dense_grad_stack(layout: StackLayout, table, ids, weights, cotangents):
  """The dense cotangent of this rank's rows (plain jax.grad): every
  sender's sums scatter-added on the owner; entries that never train add
  nothing."""
  routing, received = _exchange_keys(layout, ids, weights)
  sums = (_owner_entry_grads(layout, cotangents, routing)
          if layout.pool_on_owner else
          _sent_grads(layout, cotangents, routing, "xla",
                      common.logical_dtype(table.dtype), None))
  if sums.shape[-1] != table.shape[1]:  # a stored f32 table: padded rows
    sums = stored.to_grads(sums, jnp.float32)
  trains = (received >= 0) & (received != FILL_VALUE)
  dense = jnp.zeros(table.shape, jnp.float32).at[
      jnp.where(trains, received, table.shape[0])].add(sums, mode="drop")
  if layout.ctx.replica_axis:
    dense = lax.psum(dense, layout.ctx.replica_axis)
  return dense.astype(common.logical_dtype(table.dtype))


def ids_per_partition(coll, batch) -> dict[str, int]:
  """Host-side: `{row- or table-placed table: the most distinct rows of it
  that one rank sends one owner in this batch}` (every row an entry reads
  takes a bucket slot, trained or not). Reads the ids back."""
  inputs = coll._read(batch)  # pylint: disable=protected-access
  pairs = {}
  for layout in coll.layouts(batch):
    if layout.placement not in ("row", "table"):
      continue
    w = layout.ctx.group_size
    ranks = w * coll.num_replicas  # the batch's shards
    for f in layout.features:
      keys = np.asarray(jax.device_get(stack.entry_keys(
          f, inputs.ids[f.name], inputs.weights.get(f.name))))
      rows = np.where(keys < 0, ~keys, keys).astype(np.int64).reshape(
          ranks, -1)  # per rank
      owners = (rows // layout.block_rows if layout.placement == "table"
                else rows % w)
      per_rank = pairs.setdefault(coll.features[f.name].table,
                                  [[] for _ in range(ranks)])
      for r in range(ranks):
        per_rank[r].append(rows[r] + owners[r] * 2**32)
  out = {}
  for table, per_rank in pairs.items():
    most = 0
    for parts in per_rank:  # distinct (owner, row) pairs, the most per owner
      pair = np.unique(np.concatenate(parts))
      most = max(most, int(np.bincount(pair >> 32).max()))
    out[table] = most
  return out
