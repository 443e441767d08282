"""A column or replicated stack's gradients, brought to its unique slots.

Each rank's features' gradients travel back through ONE all-to-all
(`routed_rows`); the sums per unique slot are then the xla backend's
scatter-adds (`routed_entry_grads` for `kernels.xla.segment_sum_rows`, or
`grad_sums_by_position` for pooled bags), or the Mosaic backend's kernel
(`mosaic_grad_sums`), which adds each entry's routed row into its slot
with no per-entry gradient rows.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import update as update_lib
from pallas_emb.dedup import FILL_VALUE
from pallas_emb.kernels import common
from pallas_emb.kernels.mosaic_tpu import segment_sum
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.layout import StackLayout
from pallas_emb.placement import REPLICATED


def routed_rows(layout: StackLayout, grads: Sequence[jax.Array]) -> jax.Array:
  """`[W, rows per rank, S]`: this rank's columns of the gradient of every
  row the communicator exchanged (ONE all-to-all, in the table's dtype)."""
  local = local_rows(grads)
  if layout.placement == REPLICATED:
    # Every replica sums every rank's full-width gradients itself.
    return exchange.all_gather_ids(layout.ctx, local).reshape(
        layout.ctx.group_size, local.shape[0], -1)
  return exchange.route_gradients(layout.ctx, local).reshape(
      layout.ctx.group_size, layout.sequence_entries + layout.pooled_bags, -1)


def local_rows(grads: Sequence[jax.Array]) -> jax.Array:
  """This rank's features' gradients as rows `[T, D]`, in their dtype (the
  table's): made f32 where they are summed or scaled by entry weights."""
  flat = [g.reshape(-1, g.shape[-1]) for g in grads]
  return jnp.concatenate(flat) if len(flat) > 1 else flat[0]


def _per_pooled_feature(layout: StackLayout, bags: jax.Array,
                        weights_all: jax.Array):
  """Per pooled feature: `(feature, its bags [W, n, S], its entries'
  weights [W, n, L])`, from all pooled bags and entry weights."""
  w = layout.ctx.group_size
  bag = entry = 0
  for f in layout.pooled:
    n, length = f.local_examples, f.bag_len
    yield (f, bags[:, bag:bag + n],
           weights_all[:, entry:entry + n * length].reshape(w, n, length))
    bag += n
    entry += n * length


def routed_entry_grads(layout: StackLayout, grads: Sequence[jax.Array],
                       weights_all: jax.Array) -> jax.Array:
  """`[W * E, S]`: this rank's columns of the gradient of every entry of the
  communicator, in the all-gathered order (what the segment sum reads).

  The features' gradients travel back through ONE all-to-all (a pooled
  feature's one row per example); a pooled example's gradient then reaches
  each of its entries scaled by the entry's combiner weight.
  """
  routed = routed_rows(layout, grads)
  if not layout.pooled:
    return routed.reshape(-1, routed.shape[-1])
  bags = routed[:, layout.sequence_entries:]
  per_entry = jnp.take(bags, jnp.asarray(layout.entry_bags()), axis=1)
  # Rounded on its own: never contracted into the segment sum's adds.
  per_entry = common.unfused_product(per_entry, weights_all[:, :, None])
  return jnp.concatenate([routed[:, :layout.sequence_entries], per_entry],
                         axis=1).reshape(-1, routed.shape[-1])


def grad_sums_by_position(layout: StackLayout, grads: Sequence[jax.Array],
                          weights_all: jax.Array, segments: jax.Array,
                          num_unique: int, round_dtype, zero=None
                          ) -> tuple[jax.Array, jax.Array]:
  """The xla backend's segment sums of a stack with pooled features.

  What `segment_sum_rows(routed_entry_grads(...), segments)` computes,
  without the `[W * E, S]` per-entry gradient: each bag position k of a
  pooled feature scatter-adds `bag gradient * weight[:, k]` (`[W * n, S]`)
  straight into the sums, so a bag of L ids costs L scatters of one row per
  bag instead of a buffer L times the bags' size. The adds meet each slot
  in another order than the entry order (f32 rounding of the sums).
  `zero`: as `kernels.xla.zero_sums`.
  """
  w = layout.ctx.group_size
  routed = routed_rows(layout, grads)
  width = routed.shape[-1]
  segments = segments.reshape(w, layout.entries)
  slots = lambda s: kernels.xla.kept_segments(s, num_unique)
  accum = kernels.xla.zero_sums(num_unique, width, zero)
  if layout.sequence:
    accum = kernels.xla.scatter_add_rows(
        accum, slots(segments[:, :layout.sequence_entries]).reshape(-1),
        routed[:, :layout.sequence_entries].reshape(-1, width))
  entry = layout.sequence_entries
  for f, bags, weights in _per_pooled_feature(
      layout, routed[:, layout.sequence_entries:], weights_all):
    n, length = f.local_examples, f.bag_len
    seg = segments[:, entry:entry + n * length].reshape(w, n, length)
    entry += n * length

    # Made once: a reshape inside the loop is a copy per position.
    rows = bags.reshape(-1, width)

    def add(k, acc, f=f, rows=rows, seg=seg, weights=weights):
      at_k = lambda a: lax.dynamic_index_in_dim(a, k, 2, keepdims=False)
      keys = slots(at_k(seg))
      return kernels.xla.scatter_add_rows(
          acc, keys.reshape(-1), rows,
          None if f.unit_weights else at_k(weights).reshape(-1))

    accum = lax.fori_loop(0, length, add, accum, unroll=min(length, 4))
  return accum, kernels.xla.row_square_sums(
      accum, round_dtype, slots(segments).reshape(-1))


def mosaic_grad_sums(layout: StackLayout, backend: str, table, routing,
                     grads, weights_all):
  """The Mosaic backend's gradient sums of a stack with a stored table:
  f32 `[U, G]` in the stored layout's gradient columns
  (`stored.to_grads`), and the row norms `[U + 1]` of their logical
  columns. Each sequence id's gradient row and each bag's (scaled by the
  entry's combiner weight) is added to its slot by the kernel, in entry
  order: no per-entry gradient rows. `routing`: the stack's
  `stack.StackRouting` (its entries in slot order, where it carries them,
  spare the kernel a sort)."""
  ctx = layout.ctx
  dtype = stored.logical_dtype(table)
  routed = routed_rows(layout, grads)  # [W, T, S]
  rows = stored.to_grads(routed.reshape(-1, routed.shape[-1]), dtype)
  unique = routing.unique_tokens
  num_unique = unique.shape[0]
  used = jnp.max(jnp.where(unique != FILL_VALUE,
                           jnp.arange(1, num_unique + 1), 0), initial=0)
  if routing.by_slot is not None and segment_sum.fits_sorted(*rows.shape):
    slots, sorted_rows, weights = routing.by_slot
    grad_accum = kernels.grad_sums(rows, sorted_rows, slots, weights,
                                   num_unique, used, backend=backend,
                                   slot_sorted=True)
  else:
    grad_accum = kernels.grad_sums(rows, entry_rows(layout), routing.segments,
                                   entry_weights(layout, weights_all),
                                   num_unique, used, backend=backend)
  if ctx.replica_axis:  # the replicas' sums are added whole
    grad_accum = jnp.where((jnp.arange(num_unique) < used)[:, None],
                           grad_accum, 0.0)
  row_sq = update_lib.logical_row_sums(grad_accum, ctx.shard_width, dtype,
                                       used)
  return grad_accum, row_sq


def entry_rows(layout: StackLayout) -> np.ndarray:
  """Per entry of the communicator (the all-gathered order `[W, E]`,
  flat): the routed row it reads (its own for a sequence id, its bag's
  for a pooled entry; never decreasing). Static."""
  w = layout.ctx.group_size
  seq = layout.sequence_entries
  rows_per_rank = seq + layout.pooled_bags
  local = np.concatenate([np.arange(seq, dtype=np.int32),
                          seq + layout.entry_bags()]) if layout.pooled else (
                              np.arange(seq, dtype=np.int32))
  rows = (np.arange(w, dtype=np.int32)[:, None] * rows_per_rank
          + local[None, :]).reshape(-1)
  return rows.astype(np.int32)


def entry_weights(layout: StackLayout, weights_all) -> jax.Array:
  """f32 per entry of the communicator (the order of `entry_rows`): 1 for
  a sequence id, its combiner weight for a pooled entry."""
  w = layout.ctx.group_size
  if not layout.pooled:
    return jnp.ones((w * layout.sequence_entries,), jnp.float32)
  return jnp.concatenate(
      [jnp.ones((w, layout.sequence_entries), jnp.float32),
       weights_all.reshape(w, -1).astype(jnp.float32)], axis=1).reshape(-1)
