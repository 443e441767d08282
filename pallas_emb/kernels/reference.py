"""Plain-jnp oracles of the Pallas kernels: what each kernel computes.

Each function has its kernel's signature and semantics, written as plainly
as jnp allows; the kernels are tested against them (bit for bit in
interpret mode where the order of the arithmetic is the same). The `xla`
backend runs `xla.py`, the same operations tuned for XLA:CPU and tested
equal to these.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_emb.kernels import common


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Oracle of `gather.gather_rows`: `table[wrap_and_clamp(ids)]`."""
  ids = common.wrap_and_clamp(ids, table.shape[0])
  return jnp.take(table, ids, axis=0, mode="clip", unique_indices=False)


def kept_segments(segment_ids: jax.Array, num_segments: int) -> jax.Array:
  """Segment ids outside `[0, U)` mapped to U, which a scatter with
  `mode="drop"` drops (a negative id would wrap)."""
  valid = (segment_ids >= 0) & (segment_ids < num_segments)
  return jnp.where(valid, segment_ids, num_segments)


def segment_sum_rows(grads: jax.Array, segment_ids: jax.Array,
                     num_segments: int, *, round_dtype
                     ) -> tuple[jax.Array, jax.Array]:
  """Oracle of `segment_sum.segment_sum_rows`: f32 sums per segment (ids
  outside `[0, U)` dropped) and `row_sq[u] = sum_c round(sum[u, c])**2`,
  the total in slot U. The kernel sums in another order: they agree to f32
  rounding (exactly when no segment has two rows)."""
  accum = jax.ops.segment_sum(grads.astype(jnp.float32),
                              kept_segments(segment_ids, num_segments),
                              num_segments=num_segments, mode="drop")
  row_sq = jnp.sum(jnp.square(common.round_to(accum, round_dtype)), axis=1)
  return accum, jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])


class TouchedRows(NamedTuple):
  """The rows a sparse update touches, read and updated (not yet written).

  ok: bool `[U]`, the slots that are updated; dest: `[U]` their rows, V (out
  of range) for the others; old / new: `{state name: [U] or [U, S]}` and
  the table's rows (`"table"`, new values in f32).
  """
  ok: jax.Array
  dest: jax.Array
  old: dict
  new: dict


class TouchedRowState(NamedTuple):
  """The row-wise part of a sparse update (see `touched_row_state`).

  ok: bool `[U]`, the slots that are updated; rows: `[U]` their rows (0 for
  the others); dest: `[U]` their rows, V (out of range) for the others;
  old / new: `{row slot: [U]}`; coeffs: the rule's f32 `[U]` per-row
  coefficients for `column_update`.
  """
  ok: jax.Array
  rows: jax.Array
  dest: jax.Array
  old: dict
  new: dict
  coeffs: tuple


def touched_row_state(rule, vocab_rows: int, row_state, unique_tokens,
                      row_sq, apply, step, scalars, *,
                      emb_width=None) -> TouchedRowState:
  """Which slots a sparse update touches, and its row-wise part for them.

  A slot is skipped when the update is not applied, its token (wrapped
  once) is outside the table (fill values), or, unless
  `rule.updates_zero_rows`, its row got no gradient.
  """
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  ok = (jnp.asarray(apply, jnp.bool_) & (tokens >= 0)
        & (tokens < vocab_rows))
  if not rule.updates_zero_rows:
    ok = ok & (row_sq > 0)
  rows = jnp.where(ok, tokens, 0)
  old = {name: a[rows] for name, a in zip(rule.row_slots, row_state)}
  new, coeffs = rule.row_update(old, row_sq, step, scalars, emb_width)
  return TouchedRowState(ok, rows, jnp.where(ok, tokens, vocab_rows), old,
                         dict(new), tuple(coeffs))


def touched_rows(rule, table, row_state, element_state, unique_tokens,
                 grad_accum, row_sq, apply, step, scalars, *,
                 emb_width=None) -> TouchedRows:
  """Gathers the touched rows and runs the rule's math on them (the slots
  skipped: `touched_row_state`)."""
  row_state, element_state = tuple(row_state), tuple(element_state)
  scalars = tuple(jnp.asarray(s, jnp.float32) for s in scalars)
  vocab_rows, _ = table.shape
  row_sq = common.check_update_args(
      rule, table, row_state, element_state, unique_tokens, grad_accum,
      row_sq, scalars)
  part = touched_row_state(rule, vocab_rows, row_state, unique_tokens,
                           row_sq, apply, step, scalars, emb_width=emb_width)
  old = dict(part.old)
  old.update({name: a[part.rows] for name, a in zip(rule.element_slots,
                                                    element_state)})
  old["table"] = common.logical_rows(common.take_rows(table, part.rows))
  new = dict(part.new)
  new["table"], new_element = rule.column_update(
      tuple(c[:, None] for c in part.coeffs),
      old["table"].astype(jnp.float32), grad_accum,
      {n: old[n] for n in rule.element_slots}, scalars,
      common.logical_dtype(table.dtype))
  new.update(new_element)
  return TouchedRows(part.ok, part.dest, old, new)


def sparse_update(rule, table, row_state, element_state, unique_tokens,
                  grad_accum, row_sq, apply, step, scalars, *,
                  emb_width=None):
  """Oracle of `sparse_update.sparse_update`: gather the touched rows,
  update them with the rule's functions, scatter them back (skipped slots
  to row V, which `mode="drop"` drops)."""
  touched = touched_rows(rule, table, row_state, element_state,
                         unique_tokens, grad_accum, row_sq, apply, step,
                         scalars, emb_width=emb_width)

  def scatter(array, name):
    return array.at[touched.dest].set(touched.new[name].astype(array.dtype),
                                      mode="drop")

  return (scatter(table, "table"),
          tuple(scatter(a, n) for n, a in zip(rule.row_slots, row_state)),
          tuple(scatter(a, n) for n, a in zip(rule.element_slots,
                                              element_state)))


def pool_rows(table, rows, weights, bag_starts, *, max_len: int,
              out_dtype=None):
  """Oracle of `pool.pool_rows`: per bag, `sum_k weight_k * table[row_k]`
  accumulated in f32 in entry order, rounded once to `out_dtype` (default:
  the table dtype).

  The same sums in the same order as the kernel (one entry position at a
  time; a masked lane adds 0), so the two agree bit for bit.
  """
  out_dtype = out_dtype or common.logical_dtype(table.dtype)
  vocab_rows, width = table.shape
  num_bags = bag_starts.shape[0] - 1
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), out_dtype)
  rows = common.wrap_and_clamp(rows, vocab_rows)
  values = lambda entry: common.logical_rows(jnp.take(
      table, jnp.take(rows, entry, mode="clip"), axis=0,
      mode="clip")).astype(jnp.float32)
  return _pool_entries(values, weights, bag_starts, width,
                       max_len).astype(out_dtype)


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
  """Oracle of `quantized_gather.gather_dequantized`.

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
  """Oracle of `quantized_gather.pool_dequantized`: the same sums in the same
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
