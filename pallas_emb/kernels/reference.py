"""Plain-jnp twins of the Pallas kernels: the `xla` backend.

Each function has the signature and semantics of its kernel; the tests check
every kernel against its twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
  valid = (segment_ids >= 0) & (segment_ids < num_segments)
  keys = jnp.where(valid, segment_ids, num_segments)
  accum = jax.ops.segment_sum(grads.astype(jnp.float32), keys,
                              num_segments=num_segments, mode="drop")
  return accum, common.row_square_sums(accum, round_dtype)


def adagrad_apply(table, row_state, last_step, unique_tokens, grad_accum,
                  row_sq, apply, step, learning_rate, *, hparams):
  """Twin of `adagrad.adagrad_apply`: gather the touched rows, update, scatter.

  Skipped slots (apply false, fill values, tokens outside the table) scatter
  to row V, which `mode="drop"` drops, so under donation XLA updates the
  buffers in place. A bf16 table is scattered through a uint16 view: XLA:CPU
  would otherwise convert the whole table to f32 and back for the scatter
  (an f32 temporary twice the table's size). Known limit (jax 0.10): XLA:CPU
  still runs the two same-width `bitcast-convert`s as loops over the table,
  so a bf16 step costs two table-sized passes on CPU where an f32 table
  costs O(U * S); GPU and the Pallas kernel are not affected.
  """
  vocab_rows, _ = table.shape
  row_sq = common.check_adagrad_args(table, row_state, last_step,
                                     unique_tokens, grad_accum, row_sq,
                                     hparams)
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  ok = (jnp.asarray(apply, jnp.bool_) & (tokens >= 0)
        & (tokens < vocab_rows))
  rows = jnp.where(ok, tokens, 0)
  dest = jnp.where(ok, tokens, vocab_rows)

  last = None if last_step is None else last_step[rows]
  accum, wd, lr_scale = common.adagrad_row_update(
      row_state[rows], last, row_sq, step, learning_rate, hparams)
  new_rows = common.adagrad_new_values(
      table[rows].astype(jnp.float32), wd[:, None], lr_scale[:, None],
      grad_accum, table.dtype)

  row_state = row_state.at[dest].set(accum, mode="drop")
  if last_step is not None:
    # The new values must depend on the gathered `last`, or nothing orders
    # the gather before the in-place scatter and XLA copies the array.
    # Slots that are not `ok` scatter to row V and are dropped, so this is
    # exactly `last_step[t] = step`.
    last_step = last_step.at[dest].set(
        jnp.where(ok, jnp.asarray(step, jnp.int32), last), mode="drop")
  if table.dtype == jnp.float32:
    table = table.at[dest].set(new_rows, mode="drop")
  else:
    bits = jnp.dtype(f"uint{8 * table.dtype.itemsize}")
    table = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(table, bits).at[dest].set(
            jax.lax.bitcast_convert_type(new_rows, bits), mode="drop"),
        table.dtype)
  return table, row_state, last_step
