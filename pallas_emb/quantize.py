"""Serving tables: row-wise int8, bfloat16 or float16 copies of a table.

`quantize_rows(table, "int8")` stores each row in FBGEMM's fused 8-bit
row-wise format semantics: from the row's min and max, with every operation
rounded to f32,

    span  = max - min
    scale = span * f32(1 / 255)                          (per row)
    bias  = min                                          (per row)
    q     = round((x - bias) * (255 / span))             (uint8, ties to
                                                          even; 0 if span 0)

and a row is read back as `x' = q * scale + bias` (`dequantize_rows`). With
u = 2**-24 (f32's unit roundoff) every element satisfies

    |x' - x| <= scale / 2 + 16 * u * max(|min|, |max|)

(the rounding to a code, plus the f32 roundings of the subtraction, the
reciprocal, the products and the sum: 13 u in all, rounded up). A constant
row has scale 0, all codes 0 and reads back exactly `bias`. FBGEMM's
scale is `span / 255` and its inverse `255 / (span + 1e-8)`: its scale can
differ from ours in the last bit and its codes by one where a value sits on
a rounding tie (or for spans near 1e-8); bias and the read-back formula are
the same, so a table quantized by either reads back the same way.

"bfloat16" and "float16" are plain casts (round to nearest even).

Tables are `[V, D]` global arrays of any placement: the min and max are
over the full row (for a column-sharded table XLA reduces across the column
shards), the codes keep the table's sharding and `scale` and `bias` (`[V]`)
lie with the table's rows (`rows_spec`): replicated for column and
replicated tables, over the ranks for row and table ones.

A row- or table-placed int8 table sends an owner's rows to the readers as
FBGEMM's fused rows (`fuse`): the codes, then scale and bias as 8 bytes, one
uint8 array of `D + 8` columns, a quarter of f32 rows' bytes; the reader
dequantizes them inside its gather and pool.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_emb.errors import InputError
from pallas_emb.kernels import common

INT8 = "int8"
SERVING_DTYPES = (INT8, "bfloat16", "float16")
# Codes span [0, 255]: 255 steps of `scale` from the row's min to its max.
_LEVELS = 255


class QuantizedRows(NamedTuple):
  """An int8 serving table: codes and the per-row affine map back to f32."""
  codes: jax.Array  # uint8 [V, D]
  scale: jax.Array  # f32 [V]
  bias: jax.Array   # f32 [V]


def check_serving_dtype(dtype) -> str:
  """The serving dtype's name; InputError if it is not one we serve."""
  name = dtype if isinstance(dtype, str) else None
  if name is None:
    try:
      name = np.dtype(dtype).name
    except TypeError:
      name = repr(dtype)
  if name not in SERVING_DTYPES:
    raise InputError(
        f"pallas_emb quantize_rows dtype={dtype!r} is not a serving dtype; "
        f"expected one of {SERVING_DTYPES}.")
  return name


def rows_spec(table_spec: P) -> P:
  """The PartitionSpec of a serving table's `scale` and `bias`: the rows'
  partition of the table's (`table_spec`)."""
  return P(table_spec[0]) if len(table_spec) else P()


def serving_spec(table_spec: P, dtype: str):
  """The PartitionSpec(s) of a serving copy of a table placed as
  `table_spec`: `QuantizedRows` of them for int8, else the table's."""
  if dtype != INT8:
    return table_spec
  return QuantizedRows(table_spec, rows_spec(table_spec),
                       rows_spec(table_spec))


def fuse(rows: QuantizedRows) -> jax.Array:
  """uint8 `[N, D + 8]`: each row's codes, then its scale and bias bytes."""
  tail = lax.bitcast_convert_type(jnp.stack([rows.scale, rows.bias], -1),
                                  jnp.uint8).reshape(-1, 8)
  return jnp.concatenate([rows.codes, tail], axis=1)


def unfuse(fused: jax.Array) -> QuantizedRows:
  """The inverse of `fuse` (an all-zero row reads back as zeros)."""
  tail = lax.bitcast_convert_type(fused[:, -8:].reshape(-1, 2, 4),
                                  jnp.float32)
  return QuantizedRows(fused[:, :-8], tail[:, 0], tail[:, 1])


def _check_table(table) -> None:
  shape, dtype = np.shape(table), getattr(table, "dtype", None)
  if len(shape) != 2 or dtype is None or not jnp.issubdtype(dtype,
                                                             jnp.floating):
    raise InputError(
        f"pallas_emb quantize_rows table is "
        f"{getattr(dtype, 'name', type(table).__name__)}{list(shape)}; "
        "expected a 2-D float table [vocab_rows, emb_width].")


def _quantize_int8(table: jax.Array) -> QuantizedRows:
  x = table.astype(jnp.float32)
  lo = jnp.min(x, axis=1)
  span = jnp.max(x, axis=1) - lo
  # Written as the products XLA would turn the divisions into anyway (it
  # rewrites a division by a constant or a broadcast into a product with
  # the reciprocal): this way the arithmetic is what the code says.
  scale = span * jnp.float32(1 / _LEVELS)
  # A constant row (span 0) gets inverse 0: all codes 0, read back as bias.
  inverse = jnp.where(span > 0, jnp.float32(_LEVELS) / span, 0)
  codes = jnp.round((x - lo[:, None]) * inverse[:, None])
  # f32 rounding can put the row's max a hair above 255, never to 255.5.
  codes = jnp.clip(codes, 0, _LEVELS).astype(jnp.uint8)
  return QuantizedRows(codes, scale, lo)


def quantize_rows(table: jax.Array, dtype: str):
  """A serving copy of `table` ([V, D], f32 or bf16); see the module doc.

  Returns `QuantizedRows` for "int8", else the table cast to `dtype`. Works
  under jit (then a non-finite row reads back as NaN: its min, max or range
  is not finite). Called on a concrete array, the codes keep its
  sharding, `scale` and `bias` lie with its rows (`rows_spec`), and a table
  with a non-finite value, or a row whose max - min overflows f32, is
  rejected with InputError.
  """
  name = check_serving_dtype(dtype)
  _check_table(table)
  if name != INT8:
    return jnp.asarray(table).astype(name)
  if isinstance(table, jax.core.Tracer):
    return _quantize_int8(table)
  table = jnp.asarray(table)
  sharding = table.sharding
  if isinstance(sharding, NamedSharding):
    rows = NamedSharding(sharding.mesh, rows_spec(sharding.spec))
    out = jax.jit(_quantize_int8, out_shardings=QuantizedRows(
        sharding, rows, rows))(table)
  else:
    out = jax.jit(_quantize_int8)(table)
  _check_finite(table, out)
  return out


def _check_finite(table: jax.Array, out: QuantizedRows) -> None:
  bad = ~(jnp.isfinite(out.scale) & jnp.isfinite(out.bias))
  count = int(jnp.sum(bad))
  if not count:
    return
  row = int(jnp.argmax(bad))
  values = bool(jnp.all(jnp.isfinite(table[row])))
  why = ("its max - min overflows float32" if values else
         "it holds a NaN or an infinity")
  raise InputError(
      f"pallas_emb quantize_rows: {count} table rows cannot be quantized "
      f"to int8 (first: row {row}, {why}); expected finite rows whose "
      "max - min is a finite float32. Fix or clip those rows first.")


def dequantize_rows(rows: QuantizedRows) -> jax.Array:
  """The f32 `[V, D]` table a `QuantizedRows` reads back as."""
  return common.dequantize(rows.codes, rows.scale[:, None],
                           rows.bias[:, None])
