"""Plain-jnp twins of the Pallas kernels: the `xla` backend.

Each function has the signature and semantics of its kernel; the tests check
every kernel against its twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_emb.kernels import common


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Twin of `gather.gather_rows`."""
  ids = common.wrap_and_clamp(ids, table.shape[0])
  return jnp.take(table, ids, axis=0, mode="clip", unique_indices=False)


def segment_sum_rows(grads: jax.Array, segment_ids: jax.Array,
                     num_segments: int, *, round_dtype
                     ) -> tuple[jax.Array, jax.Array]:
  """Twin of `segment_sum.segment_sum_rows`: a scatter-add, no sort.

  Dropped ids (outside `[0, U)`) are mapped to U, which the scatter drops as
  out of range. The summation order differs from the kernel's, so the two
  agree to f32 rounding (exactly when no segment has two rows).
  """
  accum = jax.ops.segment_sum(grads.astype(jnp.float32),
                              kept_segments(segment_ids, num_segments),
                              num_segments=num_segments, mode="drop")
  return accum, common.row_square_sums(accum, round_dtype)


def kept_segments(segment_ids: jax.Array, num_segments: int) -> jax.Array:
  """Segment ids outside `[0, U)` mapped to U, which a scatter with
  `mode="drop"` drops (a negative id would wrap)."""
  valid = (segment_ids >= 0) & (segment_ids < num_segments)
  return jnp.where(valid, segment_ids, num_segments)


def sparse_update(rule, table, row_state, element_state, unique_tokens,
                  grad_accum, row_sq, apply, step, scalars, *,
                  emb_width=None):
  """Twin of `sparse_update.sparse_update`: gather the touched rows, update
  them with the rule's functions, scatter.

  Skipped slots (apply false, fill values, tokens outside the table, rows
  without gradient unless `rule.updates_zero_rows`) scatter to row V, which
  `mode="drop"` drops, so under donation XLA updates the buffers in place.
  Every state scatter writes `where(ok, new, old)` of the gathered rows:
  the same values (skipped slots are dropped anyway), but the scatter then
  depends on the gather, which orders the gather first; otherwise XLA copies
  an array whose new values do not read it (an int32 `last_step`). A bf16
  table is scattered through a uint16 view: XLA:CPU would otherwise convert
  the whole table to f32 and back for the scatter (an f32 temporary twice
  the table's size). Known limit (jax 0.10): XLA:CPU still runs the two
  same-width `bitcast-convert`s as loops over the table, so a bf16 step
  costs two table-sized passes on CPU where an f32 table costs O(U * S);
  GPU and the Pallas kernel are not affected.
  """
  row_state, element_state = tuple(row_state), tuple(element_state)
  scalars = tuple(jnp.asarray(s, jnp.float32) for s in scalars)
  vocab_rows, _ = table.shape
  row_sq = common.check_update_args(
      rule, table, row_state, element_state, unique_tokens, grad_accum,
      row_sq, scalars)
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  ok = (jnp.asarray(apply, jnp.bool_) & (tokens >= 0)
        & (tokens < vocab_rows))
  if not rule.updates_zero_rows:
    ok = ok & (row_sq > 0)
  rows = jnp.where(ok, tokens, 0)
  dest = jnp.where(ok, tokens, vocab_rows)

  row = {name: a[rows] for name, a in zip(rule.row_slots, row_state)}
  new_row, coeffs = rule.row_update(row, row_sq, step, scalars, emb_width)
  element = {name: a[rows] for name, a in zip(rule.element_slots,
                                               element_state)}
  new_rows, new_element = rule.column_update(
      tuple(c[:, None] for c in coeffs), table[rows].astype(jnp.float32),
      grad_accum, element, scalars, table.dtype)

  def scatter(array, name, new, old):
    keep = ok if old.ndim == 1 else ok[:, None]
    return array.at[dest].set(
        jnp.where(keep, new[name].astype(array.dtype), old), mode="drop")

  row_state = tuple(scatter(a, n, new_row, row[n])
                    for n, a in zip(rule.row_slots, row_state))
  element_state = tuple(scatter(a, n, new_element, element[n])
                        for n, a in zip(rule.element_slots, element_state))
  new_rows = new_rows.astype(table.dtype)
  if table.dtype == jnp.float32:
    table = table.at[dest].set(new_rows, mode="drop")
  else:
    bits = jnp.dtype(f"uint{8 * table.dtype.itemsize}")
    table = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(table, bits).at[dest].set(
            jax.lax.bitcast_convert_type(new_rows, bits), mode="drop"),
        table.dtype)
  return table, row_state, element_state


def pool_rows(table, rows, weights, bag_starts, *, max_len: int):
  """Twin of `pool.pool_rows`: the same sums in the same order.

  One gather of `[M, S]` rows per entry position `k < max_len`, added in
  order, so it equals the kernel bit for bit. A non-f32 table's entry rows
  are gathered (and made f32, exactly) once, before the loop: an `[E, S]`
  f32 buffer.
  """
  vocab_rows, width = table.shape
  num_bags = bag_starts.shape[0] - 1
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), table.dtype)
  rows = common.wrap_and_clamp(rows, vocab_rows)
  # XLA:CPU gathers a bf16 table through an f32 convert of all of it; in
  # the loop that convert is shared and hoisted (a table-sized pass per
  # step), so a non-f32 table's entry rows are gathered once, outside.
  if table.dtype == jnp.float32:
    values = lambda entry: jnp.take(
        table, jnp.take(rows, entry, mode="clip"), axis=0, mode="clip")
  else:
    entry_rows = jnp.take(table, rows, axis=0).astype(jnp.float32)
    values = lambda entry: jnp.take(entry_rows, entry, axis=0, mode="clip")
  return _pool_entries(values, weights, bag_starts, width,
                       max_len).astype(table.dtype)


def _pool_entries(values, weights, bag_starts, width: int, max_len: int
                  ) -> jax.Array:
  """f32 `[M, S]`: per bag, `weights[e] * values(e)` summed over its entries
  in order, one gather of `[M, S]` rows per entry position `k < max_len`
  (`values(entries)`: f32 `[M, S]` rows); a masked lane adds 0, as the
  kernels' (their loads give 0)."""
  start, end = bag_starts[:-1], bag_starts[1:]
  weights = weights.astype(jnp.float32)

  def add_entry(k, acc):
    entry = start + k
    ok = entry < end
    entry = jnp.where(ok, entry, 0)
    product = common.unfused_product(
        jnp.take(weights, entry, mode="clip")[:, None], values(entry))
    return acc + jnp.where(ok[:, None], product, 0.0)

  # Partly unrolled: fewer loop trips, each fusing several gathers.
  return lax.fori_loop(0, max_len, add_entry,
                       jnp.zeros((start.shape[0], width), jnp.float32),
                       unroll=min(max_len, 8))


def gather_dequantized(codes, scale, bias, ids) -> jax.Array:
  """Twin of `quantized_gather.gather_dequantized`.

  `[N, S]` f32 rows `codes[r] * scale[r] + bias[r]`, r the id wrapped once
  and clamped into the table, for a `[V, S]` uint8 column shard.
  """
  return _dequantized_rows(codes, scale, bias,
                           common.wrap_and_clamp(ids, codes.shape[0]))


def _dequantized_rows(codes, scale, bias, rows) -> jax.Array:
  """f32 `[N, S]` rows `rows` (in range) of a row-wise int8 shard."""
  return common.dequantize(jnp.take(codes, rows, axis=0, mode="clip"),
                           jnp.take(scale, rows, mode="clip")[:, None],
                           jnp.take(bias, rows, mode="clip")[:, None])


def pool_dequantized(codes, scale, bias, rows, weights, bag_starts, *,
                     max_len: int) -> jax.Array:
  """Twin of `quantized_gather.pool_dequantized`: the same sums in the same
  order (one gather per entry position `k < max_len`, added in order), so
  it equals the kernel bit for bit."""
  vocab_rows, width = codes.shape
  num_bags = bag_starts.shape[0] - 1
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), jnp.float32)
  rows = common.wrap_and_clamp(rows, vocab_rows)

  values = lambda entry: _dequantized_rows(
      codes, scale, bias, jnp.take(rows, entry, mode="clip"))
  return _pool_entries(values, weights, bag_starts, width, max_len)
