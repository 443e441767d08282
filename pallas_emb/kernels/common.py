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


def _products(fence: bool, *products):
  """The products, materialised before they are added when `fence` is set.

  XLA (and Triton) contract `a * b + c` into a fused multiply-add wherever
  fusion happens to put the two together, which changes the last bit
  depending on the surrounding program. An optimization barrier forces each
  product to be rounded on its own, so the twin, the interpret-mode kernel
  and a plain numpy model agree bit for bit. Triton has no such barrier; the
  GPU kernel leaves `fence` off and may differ from the twin by an ulp.
  """
  if not fence:
    return products
  return tuple(jnp.where(jnp.isnan(p), jnp.float32(jnp.nan), p)
               for p in products)


def adagrad_row_update(row_state, last_step, row_sq, step, learning_rate,
                       hparams, *, fence: bool = True):
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
  decayed, added = _products(fence, row_state * factor,
                             row_sq * f32(hparams.inv_width))
  accum = decayed + added
  lr_scale = -learning_rate / (jnp.sqrt(accum) + f32(hparams.eps))
  return accum, wd, lr_scale


def adagrad_new_values(values, wd, lr_scale, grad, dtype, *,
                       fence: bool = True) -> jax.Array:
  """`R(R(values * wd) + R(lr_scale * R(grad)))` in f32, as `dtype`.

  R rounds to the table dtype; `values` and `grad` are f32. (For a bf16
  table the roundings already separate the products from the sum.)
  """
  fence = fence and jnp.dtype(dtype) == jnp.float32
  decayed, delta = _products(fence, values * wd,
                             lr_scale * round_to(grad, dtype))
  return (round_to(decayed, dtype) + round_to(delta, dtype)).astype(dtype)
