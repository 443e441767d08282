"""The `xla` backend: each kernel's operation in jnp, tuned for XLA:CPU.

Same signatures and results as the oracles in `reference.py` (bit for bit
where the arithmetic is the same; the row norms' sums meet in another
order), written around what XLA:CPU does badly: a row reduce that cannot
fuse its squares, a bf16 table (scattered through an f32 round trip of the
whole table, gathered through a convert of all of it), a scatter whose
values do not read the array it writes (then copied).

A bf16 table may come as its uint16 bits (`common.BF16_BITS`), which is how
a collection state holds it on this backend (`placement.storage_dtype`):
then only gathered rows are bitcast and the update scatters uint16 rows in
place, so a bf16 step touches O(U * S) of the table as an f32 one does.
A bf16 table passed as bf16 (the single-table API, the layers' params)
still works, at the cost of table-sized passes on CPU.
`tests/xla_backend_test.py` holds each one equal to its oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_emb.kernels import common
from pallas_emb.kernels import reference
# The same as their oracles: nothing about them is slow on XLA:CPU.
from pallas_emb.kernels.reference import gather_dequantized  # pylint: disable=unused-import
from pallas_emb.kernels.reference import pool_dequantized  # pylint: disable=unused-import
from pallas_emb.kernels.reference import kept_segments


def gather_rows(table, ids):
  """`reference.gather_rows`; a uint16 table's rows come back as bf16."""
  return common.logical_rows(reference.gather_rows(table, ids))


def segment_sum_rows(grads: jax.Array, segment_ids: jax.Array,
                     num_segments: int, *, round_dtype
                     ) -> tuple[jax.Array, jax.Array]:
  """`reference.segment_sum_rows`, the row norms by halving adds.

  XLA:CPU hands a row reduce to a library call that cannot fuse the
  squares, which then take a `[U, S]` buffer (`common.row_square_sums`).
  """
  accum = jax.ops.segment_sum(grads.astype(jnp.float32),
                              kept_segments(segment_ids, num_segments),
                              num_segments=num_segments, mode="drop")
  return accum, common.row_square_sums(accum, round_dtype)


def sparse_update(rule, table, row_state, element_state, unique_tokens,
                  grad_accum, row_sq, apply, step, scalars, *,
                  emb_width=None):
  """`reference.sparse_update` without table or state copies on XLA:CPU.

  Skipped slots (apply false, fill values, tokens outside the table, rows
  without gradient unless `rule.updates_zero_rows`) scatter to row V, which
  `mode="drop"` drops, so under donation XLA updates the buffers in place.
  Every state scatter writes `where(ok, new, old)` of the gathered rows:
  the same values (skipped slots are dropped anyway), but the scatter then
  depends on the gather, which orders the gather first; otherwise XLA copies
  an array whose new values do not read it (an int32 `last_step`). A
  uint16 table (a bf16 table's bits) gets the new rows' bits, in place. A
  bf16 table is scattered through a uint16 view: XLA:CPU would otherwise
  convert the whole table to f32 and back for the scatter; it still runs
  the view's two same-width `bitcast-convert`s as loops over the table
  (jax 0.10), which is why a collection state holds bf16 as uint16.
  """
  touched = reference.touched_rows(
      rule, table, row_state, element_state, unique_tokens, grad_accum,
      row_sq, apply, step, scalars, emb_width=emb_width)
  ok, dest = touched.ok, touched.dest

  def scatter(array, name):
    keep = ok if array.ndim == 1 else ok[:, None]
    return array.at[dest].set(
        jnp.where(keep, touched.new[name].astype(array.dtype),
                  touched.old[name]), mode="drop")

  row_state = tuple(scatter(a, n) for n, a in zip(rule.row_slots, row_state))
  element_state = tuple(scatter(a, n)
                        for n, a in zip(rule.element_slots, element_state))
  new_rows = touched.new["table"].astype(common.logical_dtype(table.dtype))
  if table.dtype in (jnp.float32, common.BF16_BITS):
    table = table.at[dest].set(common.stored_rows(new_rows, table.dtype),
                               mode="drop")
  else:
    bits = jnp.dtype(f"uint{8 * table.dtype.itemsize}")
    table = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(table, bits).at[dest].set(
            jax.lax.bitcast_convert_type(new_rows, bits), mode="drop"),
        table.dtype)
  return table, row_state, element_state


def pool_rows(table, rows, weights, bag_starts, *, max_len: int,
              out_dtype=None):
  """`reference.pool_rows` without a whole-table convert of a bf16 table.

  XLA:CPU gathers a bf16 table through an f32 convert of all of it; in the
  loop that convert is shared and hoisted (a table-sized pass per step), so
  a non-f32 table's entry rows are gathered (and made f32, exactly) once,
  before the loop: an `[E, S]` f32 buffer. The same sums in the same order.
  A uint16 table (bf16 bits) has no such convert: it is pooled as an f32
  one, its gathered rows bitcast and converted.
  """
  if table.dtype in (jnp.float32, common.BF16_BITS):
    return reference.pool_rows(table, rows, weights, bag_starts,
                               max_len=max_len, out_dtype=out_dtype)
  out_dtype = out_dtype or table.dtype
  vocab_rows, width = table.shape
  num_bags = bag_starts.shape[0] - 1
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), out_dtype)
  entry_rows = jnp.take(table, common.wrap_and_clamp(rows, vocab_rows),
                        axis=0).astype(jnp.float32)
  values = lambda entry: jnp.take(entry_rows, entry, axis=0, mode="clip")
  return reference._pool_entries(values, weights, bag_starts, width,  # pylint: disable=protected-access
                                 max_len).astype(out_dtype)
