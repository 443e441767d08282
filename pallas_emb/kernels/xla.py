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

A unique buffer is sized for the worst case (a slot per id), and a batch
uses a prefix of it; its row norms and update loop over chunks of it up to
the last used slot, so their work and temporaries follow the distinct rows.

`tests/xla_backend_test.py` holds each function equal to its oracle.
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
                     num_segments: int, *, round_dtype, zero=None
                     ) -> tuple[jax.Array, jax.Array]:
  """`reference.segment_sum_rows`, the row norms by halving adds.

  XLA:CPU hands a row reduce to a library call that cannot fuse the
  squares, which then take a `[U, S]` buffer (`common.row_square_sums`).
  `zero`: the f32 scalar 0 the sums start from (`zero_sums`).
  """
  segments = kept_segments(segment_ids, num_segments)
  accum = scatter_add_rows(zero_sums(num_segments, grads.shape[-1], zero),
                           segments, grads)
  return accum, row_square_sums(accum, round_dtype, segments)


def zero_sums(num_segments: int, width: int, zero=None) -> jax.Array:
  """f32 `[U, S]` zeros for segment sums, broadcast from `zero` (an f32
  0 computed in the step) if given: inside a loop that may run no
  iteration, a broadcast of a constant would be hoisted out of it by XLA
  (and filled every step), one of a loop value stays in."""
  if zero is None:
    return jnp.zeros((num_segments, width), jnp.float32)
  return jnp.broadcast_to(jnp.asarray(zero, jnp.float32),
                          (num_segments, width))


# Slots per iteration of the loops over a unique buffer's used slots
# (`row_square_sums`, `sparse_update`). The buffer is sized for the worst
# case (a slot per id) but a batch uses a prefix of it (its distinct rows):
# the loops stop after the last used slot, so the step's per-slot work and
# temporaries follow the distinct rows, not the buffer. Smaller chunks
# cost more per slot on XLA:CPU (8192: +14% at 10M rows, a buffer of
# 32,632 slots; docs/cpu_performance.md). Tests lower it.
CHUNK_SLOTS = 32768


# Rows per scatter-add when the rows must be made f32 first (bf16
# gradients, or rows scaled by weights): XLA:CPU does not fuse that into
# the scatter, so the f32 rows are made a chunk at a time instead of as a
# copy of the batch (16 MiB for 65,536 bf16 rows of 64). Tests lower it.
CHUNK_ROWS = 8192


def _over_used_chunks(body, length: int, extent, carry, size=None):
  """`body(start, fresh, carry)` per chunk of `size` (CHUNK_SLOTS) of
  `length` slots or rows, up to `extent`. The last chunk starts at most at
  `length - size` (a static size), so it may overlap the one before:
  `fresh` `[size]` marks its entries not yet visited."""
  size = size or CHUNK_SLOTS

  def step(i, carry):
    start = jnp.minimum(i * size, length - size)
    fresh = start + jnp.arange(size, dtype=jnp.int32) >= i * size
    return body(start, fresh, carry)

  return jax.lax.fori_loop(0, (extent + size - 1) // size, step, carry)


def scatter_add_rows(accum: jax.Array, slots: jax.Array, rows: jax.Array,
                     weights: jax.Array | None = None) -> jax.Array:
  """`accum.at[slots].add(rows * weights[:, None], mode="drop")` in f32,
  the products rounded on their own (`common.unfused_product`).

  Rows that must be made f32 (another dtype, or weights) are scattered
  CHUNK_ROWS at a time, in order: each slot meets the same adds in the same
  order, without an f32 copy of all the rows.
  """
  def f32_rows(r, w):
    r = common.f32_from_bf16_bits(r) if r.dtype == common.BF16_BITS else (
        r.astype(jnp.float32))
    return r if w is None else common.unfused_product(r, w[:, None])

  n = rows.shape[0]
  if n <= CHUNK_ROWS or (rows.dtype == jnp.float32 and weights is None):
    return accum.at[slots].add(f32_rows(rows, weights), mode="drop")
  # As bits: XLA would move a bf16 convert out of the loop, onto all rows.
  rows = common.stored_rows(rows, common.BF16_BITS)

  def body(start, fresh, acc):
    chunk = lambda a: jax.lax.dynamic_slice_in_dim(a, start, CHUNK_ROWS)
    # A row of the chunk before (the last chunk may overlap it) is dropped.
    keys = jnp.where(fresh, chunk(slots), accum.shape[0])
    return acc.at[keys].add(
        f32_rows(chunk(rows), None if weights is None else chunk(weights)),
        mode="drop")

  return _over_used_chunks(body, n, n, accum, CHUNK_ROWS)


def row_square_sums(accum: jax.Array, round_dtype,
                    segments: jax.Array) -> jax.Array:
  """`common.row_square_sums` of `accum` `[U, S]`, whose rows past the
  last slot in `segments` (the kept segment ids of its sums) are zero: only
  the used rows are visited. Each row's sum has the same bits; the total
  may meet in another order (f32 rounding)."""
  num_slots = accum.shape[0]
  if num_slots <= CHUNK_SLOTS:
    return common.row_square_sums(accum, round_dtype)
  extent = jnp.max(jnp.where(segments < num_slots, segments + 1, 0),
                   initial=0)

  def body(start, fresh, row_sq):
    del fresh  # A slot's sum is the same each time it is computed.
    chunk = jax.lax.dynamic_slice_in_dim(accum, start, CHUNK_SLOTS)
    sums = common.row_square_sums(chunk, round_dtype)[:CHUNK_SLOTS]
    return jax.lax.dynamic_update_slice_in_dim(row_sq, sums, start, 0)

  row_sq = _over_used_chunks(body, num_slots, extent,
                             jnp.zeros((num_slots,), jnp.float32))
  return jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])


def sparse_update(rule, table, row_state, element_state, unique_tokens,
                  grad_accum, row_sq, apply, step, scalars, *,
                  emb_width=None):
  """`reference.sparse_update` without table or state copies on XLA:CPU;
  a buffer over CHUNK_SLOTS slots is updated a chunk at a time, up to its
  last slot in the table (the same rows get the same bits)."""
  num_slots = unique_tokens.shape[0]
  if num_slots <= CHUNK_SLOTS:
    return _update_slots(rule, table, row_state, element_state,
                         unique_tokens, grad_accum, row_sq, apply, step,
                         scalars, emb_width=emb_width)
  row_sq = common.check_update_args(
      rule, table, tuple(row_state), tuple(element_state), unique_tokens,
      grad_accum, row_sq, scalars)
  vocab_rows = table.shape[0]
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  in_table = jnp.asarray(apply, jnp.bool_) & (tokens >= 0) & (
      tokens < vocab_rows)
  positions = jnp.arange(1, num_slots + 1, dtype=jnp.int32)
  extent = jnp.max(jnp.where(in_table, positions, 0), initial=0)

  def body(start, fresh, arrays):
    chunk = lambda a: jax.lax.dynamic_slice_in_dim(a, start, CHUNK_SLOTS)
    # A slot of the chunk before (the last chunk may overlap it) is skipped.
    chunk_tokens = jnp.where(fresh, chunk(unique_tokens), vocab_rows)
    return _update_slots(rule, *arrays, chunk_tokens, chunk(grad_accum),
                         chunk(row_sq), apply, step, scalars,
                         emb_width=emb_width)

  return _over_used_chunks(
      body, num_slots, extent, (table, tuple(row_state),
                                tuple(element_state)))


def _update_slots(rule, table, row_state, element_state, unique_tokens,
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
  new_rows = common.narrow(touched.new["table"],
                           common.logical_dtype(table.dtype))
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
