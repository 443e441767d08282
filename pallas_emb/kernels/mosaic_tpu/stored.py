"""How the Mosaic backend stores a table: rows of 32-bit words, padded to
whole 128-lane rows.

A TPU keeps a 2-D array in HBM in (8, 128) tiles of 32-bit words. A
`[V, 64]` f32 table pads each row to 128 lanes anyway, and XLA relays such
a table out of its tiling around every gather and scatter; a bf16 row is
half of a packed sublane, which no DMA can address on its own. Stored as
`[V, P]` words (P a multiple of 128), every row is whole tile rows: one
aligned DMA, a gather with no relayout, the same bytes in HBM as the
`[V, 64]` f32 array took. bf16 columns are packed two to a word (column
2j in the low half, 2j + 1 in the high half), so a bf16 row is half the
words of an f32 one.

A collection state on the Mosaic backend holds its tables (and the
element-wise optimizer state, always f32) this way; the logical
`[rows, width]` view is made at `table_arrays`, `optimizer_arrays`,
checkpoints and serving only. The rows stay the first dimension, so
slicing and stacking tables by rows works on either view.

Gradients in this layout (`to_grads`) are f32, for bf16 the columns of
each word side by side: `[low halves | high halves]`, each padded to H
lanes (`high_offset`). H is P/2 where the words fit in it (a bf16 table of
at most 128 columns: one 128-lane gradient row, the f32 table's bytes),
else P. The update unpacks a word tile into two f32 tiles and meets the
gradient's high half by a rotation of the lanes by H (`split_grads`; a
rotation by half the lanes is the same either way), or, with H = P, where
it is.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_emb.kernels import common

LANES = 128
WORD = jnp.uint32  # a bf16 table's stored dtype: two columns per word
# How `to_stored` and `from_stored` pair a bf16 table's columns into words:
# "pairs" bitcasts a `[..., words, 2]` view of the columns' 16-bit
# integers; "matmul" moves each column's 16 bits as an integer-valued f32
# through 0/1 matrices (exact at HIGHEST precision: every output is one
# product by 1); "auto" (the default) picks per platform as the program is
# lowered: "matmul" on a TPU, "pairs" elsewhere. On a v5e, for a
# `[10M, 64]` table (`python -m bench.tpu_convert --rows=10000000`),
# XLA compiled "matmul" in 4.65 s (to_stored) and 2.37 s (from_stored)
# against 97.0 and 84.0 s for "pairs", whose pair axis the chip lays out
# in tiles of its own, and ran them in 28.7 and 24.8 ms against 60.4 and
# 29.5 ms. On a 2-core CPU "matmul" runs 6x slower (1.56 s against 0.24
# s at 1M rows).
BF16_CONVERT = "auto"


def _is_bf16(dtype) -> bool:
  return jnp.dtype(dtype) == jnp.bfloat16


def words(width: int, dtype) -> int:
  """32-bit words of one row of `width` columns of `dtype`."""
  return (width + 1) // 2 if _is_bf16(dtype) else width


def stored_width(width: int, dtype) -> int:
  """Words of a stored row: `words`, padded to whole 128-lane rows."""
  return -(-words(width, dtype) // LANES) * LANES


def stored_dtype(dtype) -> np.dtype:
  """The stored array's dtype: f32 as itself, bf16 as uint32 words."""
  return np.dtype(WORD) if _is_bf16(dtype) else np.dtype(dtype)


def high_offset(width: int, dtype) -> int:
  """The column of a bf16 gradient row (`to_grads`) where its high halves
  (the odd columns) start: half the stored width if the words fit there,
  else the stored width."""
  padded = stored_width(width, dtype)
  return padded // 2 if words(width, dtype) <= padded // 2 else padded


def grad_width(width: int, dtype) -> int:
  """Columns of a gradient in this layout (`to_grads`)."""
  if not _is_bf16(dtype):
    return stored_width(width, dtype)
  return 2 * high_offset(width, dtype)


def split_grads(grads, words_width: int, roll=None):
  """A bf16 gradient (or element-wise state) tile `[R, G]` as two `[R, P]`
  tiles lane-aligned with `unpack`'s halves of `[R, P]` words
  (`words_width` = P): the low halves where they are, the high halves
  moved by `high_offset` lanes (`roll(x, shift, axis)`: `pltpu.roll` in a
  kernel, `jnp.roll` in XLA). Lanes past the words hold the other half's
  columns or padding: `join_grads` keeps only each half's own."""
  offset = grads.shape[1] // 2
  if offset == words_width:
    return grads[:, :offset], grads[:, offset:]
  roll = roll or jnp.roll
  return grads, roll(grads, offset, 1)


def join_grads(low, high, grads_width: int, roll=None):
  """The inverse of `split_grads`: two `[R, P]` f32 tiles (lanes aligned
  with the words) as one `[R, G]` gradient-layout tile."""
  offset = grads_width // 2
  if offset == low.shape[1]:
    return jnp.concatenate([low, high], axis=1)
  roll = roll or jnp.roll
  lane = lax.broadcasted_iota(jnp.int32, low.shape, 1)
  return jnp.where(lane < offset, low, roll(high, offset, 1))


def logical_dtype(table) -> np.dtype:
  """The dtype of the columns of a stored (or logical) table."""
  return np.dtype(common.logical_dtype(table.dtype))


def is_stored(array, width: int) -> bool:
  """Whether `array` `[rows, *]` is a stored table of `width` columns (an
  f32 table of whole 128-lane rows is its own stored form)."""
  if array.dtype == WORD:
    return array.shape[-1] == stored_width(width, jnp.bfloat16)
  return (array.dtype == jnp.float32
          and array.shape[-1] == stored_width(width, jnp.float32))


def _pad_columns(x: jax.Array, columns: int) -> jax.Array:
  extra = columns - x.shape[-1]
  if not extra:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def to_stored(x: jax.Array) -> jax.Array:
  """A logical f32 or bf16 table (or rows) `[..., width]` as stored."""
  width = x.shape[-1]
  if not _is_bf16(x.dtype):
    if x.dtype != jnp.float32:
      raise TypeError(f"pallas_emb stored tables are f32 or bf16, got "
                      f"{x.dtype}.")
    return _pad_columns(x, stored_width(width, x.dtype))
  return _by_pairing(_words_by_matmul, _words_by_pairs, x)


def _by_pairing(matmul, pairs, x):
  """`matmul(x)` or `pairs(x)` as `BF16_CONVERT` says ("auto": per the
  platform the program is lowered for)."""
  if BF16_CONVERT == "matmul":
    return matmul(x)
  if BF16_CONVERT == "pairs":
    return pairs(x)
  if BF16_CONVERT != "auto":
    raise ValueError(f"pallas_emb: stored.BF16_CONVERT={BF16_CONVERT!r}; "
                     "expected 'auto', 'matmul' or 'pairs'.")
  return lax.platform_dependent(x, tpu=matmul, default=pairs)


def _words_by_matmul(x):
  width = x.shape[-1]
  bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.float32)
  low, high = (_take_columns(bits, _pairing(width, h).T).astype(WORD)
               for h in (0, 1))
  return low | (high << 16)


def _words_by_pairs(x):
  # Padded as integers: XLA:CPU pads a bf16 array by way of f32, which
  # turns every NaN into the one quiet NaN.
  width = x.shape[-1]
  bits = _pad_columns(lax.bitcast_convert_type(x, jnp.uint16),
                      2 * words(width, x.dtype))
  pairs = lax.bitcast_convert_type(bits.reshape(bits.shape[:-1] + (-1, 2)),
                                   WORD)
  return _pad_columns(pairs, stored_width(width, jnp.bfloat16))


def from_stored(x: jax.Array, width: int, dtype) -> jax.Array:
  """The logical `[..., width]` table (or rows) of `dtype` of stored `x`."""
  if not _is_bf16(dtype):
    return x[..., :width].astype(dtype)
  return _by_pairing(functools.partial(_columns_by_matmul, width=width),
                     functools.partial(_columns_by_pairs, width=width), x)


def _columns_by_matmul(x, width):
  x = x[..., :stored_width(width, jnp.bfloat16)]
  halves = jnp.concatenate([(x & 0xFFFF).astype(jnp.float32),
                            (x >> 16).astype(jnp.float32)], axis=-1)
  pairing = np.concatenate([_pairing(width, 0), _pairing(width, 1)])
  bits = _take_columns(halves, pairing).astype(jnp.uint16)
  return lax.bitcast_convert_type(bits, jnp.bfloat16)


def _columns_by_pairs(x, width):
  pairs = lax.bitcast_convert_type(x[..., :words(width, jnp.bfloat16)],
                                   jnp.uint16)
  return lax.bitcast_convert_type(
      pairs.reshape(x.shape[:-1] + (-1,))[..., :width], jnp.bfloat16)


def _pairing(width: int, half: int) -> np.ndarray:
  """`[P, width]` 0/1: word j's `half` (0 low, 1 high) is column
  `2 j + half`."""
  m = np.zeros((stored_width(width, jnp.bfloat16), width), np.float32)
  columns = np.arange(half, width, 2)
  m[columns // 2, columns] = 1
  return m


def _take_columns(x: jax.Array, matrix: np.ndarray) -> jax.Array:
  """`x @ matrix` for a 0/1 `matrix` whose columns hold one 1 at most:
  integers below 2**24 come through exactly."""
  return jnp.matmul(x, jnp.asarray(matrix), precision=lax.Precision.HIGHEST)


def unpack(word_tile: jax.Array) -> tuple[jax.Array, jax.Array]:
  """uint32 words -> `(low halves, high halves)` as f32 (exact: a bf16 is
  the upper half of its f32). Traceable in a kernel and in XLA."""
  low = lax.bitcast_convert_type(word_tile << 16, jnp.float32)
  high = lax.bitcast_convert_type(word_tile & jnp.uint32(0xFFFF0000),
                                  jnp.float32)
  return low, high


def pack(low: jax.Array, high: jax.Array) -> jax.Array:
  """f32 values -> words of their bf16 roundings (`common.narrow`'s)."""
  return common.bf16_bits(low) | (common.bf16_bits(high) << 16)


def to_grads(x: jax.Array, dtype) -> jax.Array:
  """f32 `[..., width]` values (gradients of a `dtype` table) in the stored
  layout's column order: f32 padded to the stored width; for bf16 the even
  columns, then the odd ones, each padded to `high_offset` columns."""
  width = x.shape[-1]
  x = x.astype(jnp.float32)
  if not _is_bf16(dtype):
    return _pad_columns(x, stored_width(width, dtype))
  half = high_offset(width, dtype)
  x = _pad_columns(x, 2 * words(width, dtype))
  # Column pairs, their two members swapped to the front: on a v5e this
  # beat two strided lane slices (`x[..., 0::2]`, `x[..., 1::2]`; 0.13 ms
  # each for 16,384 rows of 64) by 0.12 ms a bf16 sequence step.
  pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
  halves = _pad_columns(jnp.swapaxes(pairs, -1, -2), half)
  return halves.reshape(x.shape[:-1] + (2 * half,))


def from_grads(x: jax.Array, width: int, dtype) -> jax.Array:
  """The inverse of `to_grads`: f32 `[..., width]` in column order."""
  if not _is_bf16(dtype):
    return x[..., :width]
  offset = high_offset(width, dtype)
  half = words(width, dtype)
  both = jnp.stack([x[..., :half], x[..., offset:offset + half]], axis=-1)
  return both.reshape(x.shape[:-1] + (2 * half,))[..., :width]

def rule_on_tiles(rule, coeffs, old, grad, element, scalars, roll):
  """`rule.column_update` on `[R, P]` tiles of a stored table (`old`) and
  its gradients and element-wise states (`[R, G]`, the gradients'
  layout): `(new table tile, {name: new state tile})`. A bf16 table's
  words are unpacked into their low and high halves and packed again
  after the rule: one tile in the gradients' layout where both halves fit
  it (`join_grads`), else each half with its half of the gradient columns
  (`roll` as for `split_grads`)."""
  if old.dtype != WORD:
    return rule.column_update(coeffs, old, grad, element, scalars,
                              jnp.float32)
  offset = grad.shape[1] // 2
  if offset < old.shape[1]:
    # The two halves fit one tile of the gradients' layout (a bf16 table of
    # at most 128 columns): the rule runs once on it, where each half on
    # its own tile did the same lane-wise work twice.
    lane = lax.broadcasted_iota(jnp.int32, old.shape, 1)
    values = join_grads(*unpack(old), grad.shape[1], roll)
    new_values, new_elements = rule.column_update(
        coeffs, values, grad, element, scalars, jnp.bfloat16)
    new_words = pack(new_values, (roll or jnp.roll)(new_values, offset, 1))
    # Past the words the lanes met other columns: those keep their bits.
    return jnp.where(lane < offset, new_words, old), new_elements
  split = lambda x: split_grads(x, old.shape[1], roll)
  grads = split(grad)
  elements = {n: split(e) for n, e in element.items()}
  parts = [rule.column_update(coeffs, values, grads[h],
                              {n: e[h] for n, e in elements.items()},
                              scalars, jnp.bfloat16)
           for h, values in enumerate(unpack(old))]
  return pack(parts[0][0], parts[1][0]), {
      n: jnp.concatenate([parts[0][1][n], parts[1][1][n]], axis=1)
      for n in element}
