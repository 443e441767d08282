"""Small pieces shared by the kernels and their jnp twins."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

# Triton addresses a flat view with int32 offsets.
MAX_FLAT_SIZE = 2**31 - 1


def wrap_and_clamp(ids: jax.Array, vocab_rows: int) -> jax.Array:
  """DESIGN §3: a negative id is wrapped once, then clamped into the table."""
  ids = jnp.where(ids < 0, ids + vocab_rows, ids)
  return jnp.clip(ids, 0, vocab_rows - 1)


def wrap_once(ids: jax.Array, vocab_rows: int) -> jax.Array:
  """DESIGN §4: a negative unique token is wrapped once (not clamped)."""
  return jnp.where(ids < 0, ids + vocab_rows, ids)


def check_flat_size(array, what: str) -> None:
  if array.size > MAX_FLAT_SIZE:
    raise ValueError(
        f"pallas_emb {what} has {array.size} elements per rank, more than the "
        f"{MAX_FLAT_SIZE} a Pallas kernel can address with int32 offsets. "
        "Shard the table over more ranks, or use backend='xla'.")


def round_to(x: jax.Array, dtype) -> jax.Array:
  """Rounds an f32 value to `dtype` and back (identity for f32)."""
  if jnp.dtype(dtype) == jnp.float32:
    return x
  return x.astype(dtype).astype(jnp.float32)


def check_adagrad_args(table, row_state, last_step, unique_tokens, grad_accum,
                       row_sq, hparams) -> jax.Array:
  """Shape/dtype checks shared by the Adagrad kernel and its twin.

  Returns `row_sq` as `[U]`: a trailing total slot (the `[U + 1]` output of
  the segment sum) is dropped.
  """
  chex.assert_rank(table, 2)
  vocab_rows, width = table.shape
  if table.dtype not in (jnp.float32, jnp.bfloat16):
    raise TypeError(f"pallas_emb adagrad_apply expects an f32 or bf16 table, "
                    f"got {table.dtype}.")
  chex.assert_type([row_state, grad_accum, row_sq],
                   [jnp.float32, jnp.float32, jnp.float32])
  chex.assert_type(unique_tokens, jnp.int32)
  chex.assert_shape(row_state, (vocab_rows,))
  chex.assert_rank(unique_tokens, 1)
  (num_unique,) = unique_tokens.shape
  chex.assert_shape(grad_accum, (num_unique, width))
  if row_sq.shape == (num_unique + 1,):
    row_sq = row_sq[:num_unique]
  chex.assert_shape(row_sq, (num_unique,))
  if hparams.lazy:
    if last_step is None:
      raise ValueError("pallas_emb adagrad_apply: lazy hparams need a "
                       "last_step array, got None.")
    chex.assert_type(last_step, jnp.int32)
    chex.assert_shape(last_step, (vocab_rows,))
  elif last_step is not None:
    raise ValueError("pallas_emb adagrad_apply: eager hparams (lazy=False) "
                     "take last_step=None; pass lazy=True to use it.")
  return row_sq


def unfused_product(x: jax.Array, y: jax.Array) -> jax.Array:
  """`x * y` rounded to f32 on its own, never contracted into an FMA.

  XLA:CPU always lets LLVM contract `a * b + c` into a fused multiply-add
  (and NVPTX does too), and which product gets fused depends on how the
  surrounding program was fused: the last bit would then differ between the
  twin, the interpret-mode kernel and the same twin inside a larger jit. A
  select on the product (NaN canonicalisation, otherwise the identity) is
  opaque to the contraction, so every backend rounds the product itself.
  """
  p = x * y
  return jnp.where(jnp.isnan(p), jnp.float32(jnp.nan), p)


def adagrad_row_update(row_state, last_step, row_sq, step, learning_rate,
                       hparams):
  """Per-row part of DESIGN §4.5: `(accum, wd, lr_scale)`, all f32.

  Shared by the kernel body and its twin so both evaluate the same
  expressions in the same order. `last_step` is None in eager mode.
  """
  f32 = jnp.float32
  has_grad = row_sq > 0
  if hparams.lazy:
    delta = jnp.maximum(step - last_step, 0).astype(f32)
    factor = jnp.exp(f32(-hparams.accum_decay_rate) * delta)
    wd = jnp.where(has_grad, jnp.exp(f32(-hparams.weight_decay_rate) * delta),
                   f32(1))
  else:
    factor = f32(hparams.decay_factor)
    wd = jnp.where(has_grad, f32(hparams.weight_decay_factor), f32(1))
  accum = (unfused_product(row_state, factor)
           + unfused_product(row_sq, f32(hparams.inv_width)))
  lr_scale = -learning_rate / (jnp.sqrt(accum) + f32(hparams.eps))
  return accum, wd, lr_scale


def adagrad_new_values(values, wd, lr_scale, grad, dtype) -> jax.Array:
  """`R(R(values * wd) + R(lr_scale * R(grad)))` in f32, as `dtype`.

  R rounds to the table dtype; `values` and `grad` are f32.
  """
  decayed = round_to(unfused_product(values, wd), dtype)
  delta = round_to(unfused_product(lr_scale, round_to(grad, dtype)), dtype)
  return (decayed + delta).astype(dtype)


def row_square_sums(grad_accum: jax.Array, round_dtype) -> jax.Array:
  """`[U + 1]`: per row `sum_c round(g)**2`, the total in the last slot."""
  row_sq = jnp.sum(jnp.square(round_to(grad_accum, round_dtype)), axis=1)
  return jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])
