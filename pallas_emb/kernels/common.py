"""Small pieces shared by the kernels and their jnp twins."""

from __future__ import annotations

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
