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

What a serving copy cannot hold is an error, before it is served
(`unservable_rows`): an int8 row with a NaN or an infinity (its min or max
would be one), or whose max - min overflows f32; a finite value that a cast
turns into an infinity (float16 above 65504; bfloat16, from f32, above
about 3.3962e38). A NaN or an infinity in a table cast to bfloat16 or
float16 stays what it is. Non-finite values are found by an `isfinite`
reduction over each row, not through its min and max: XLA:CPU's min and
max over a column-sharded row drop a NaN.

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

import functools
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
  # A row with a NaN or an infinity gets a NaN bias (so it reads back as
  # NaN): its min and max alone may not say so on a sharded row.
  finite = jnp.all(jnp.isfinite(x), axis=1)
  lo = jnp.where(finite, jnp.min(x, axis=1), jnp.nan)
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


def quantize_rows(table: jax.Array, dtype: str, *, check: bool = True):
  """A serving copy of `table` ([V, D], f32 or bf16); see the module doc.

  Returns `QuantizedRows` for "int8", else the table cast to `dtype`. Works
  under jit (then nothing is checked, and a row with a NaN or an infinity,
  or whose max - min overflows, reads back as NaN from int8). Called on a
  concrete array, the codes keep its sharding, `scale` and `bias` lie with
  its rows (`rows_spec`), and with `check` a table with rows that the
  copy cannot hold (`unservable_rows`) is rejected with one InputError
  naming every such row.
  """
  name = check_serving_dtype(dtype)
  _check_table(table)
  if isinstance(table, jax.core.Tracer):
    return _quantize_int8(table) if name == INT8 else table.astype(name)
  table = jnp.asarray(table)
  if check:
    raise_if_unservable(name, [("", unservable_rows(table, name))],
                        "quantize_rows")
  if name != INT8:
    return table.astype(name)
  sharding = table.sharding
  if isinstance(sharding, NamedSharding):
    rows = NamedSharding(sharding.mesh, rows_spec(sharding.spec))
    return jax.jit(_quantize_int8, out_shardings=QuantizedRows(
        sharding, rows, rows))(table)
  return jax.jit(_quantize_int8)(table)


# --- what a serving copy cannot hold ------------------------------------------

NON_FINITE = "a NaN or an infinity"
SPAN_OVERFLOW = "max - min overflows float32"


def _beyond_range(dtype: str) -> str:
  return (f"a finite value beyond {dtype}'s range (largest "
          f"{float(jnp.finfo(dtype).max):.5g}), which the cast makes "
          "infinite")


def _row_flags(table: jax.Array, dtype: str) -> jax.Array:
  """int8 `[V]`: 0 for a servable row, else 1 + the index of its problem
  in `_problems(dtype)`. Reductions of `isfinite`, never of min / max
  alone (a sharded min or max drops a NaN on XLA:CPU)."""
  x = table.astype(jnp.float32)
  finite = jnp.all(jnp.isfinite(x), axis=1)
  if dtype == INT8:
    span = jnp.max(x, axis=1) - jnp.min(x, axis=1)
    return jnp.where(~finite, 1, jnp.where(jnp.isfinite(span), 0, 2)
                     ).astype(jnp.int8)
  cast = table.astype(dtype)
  widened = jnp.any(jnp.isfinite(table) & ~jnp.isfinite(cast), axis=1)
  return widened.astype(jnp.int8)


def _problems(dtype: str) -> tuple[str, ...]:
  return ((NON_FINITE, SPAN_OVERFLOW) if dtype == INT8 else
          (_beyond_range(dtype),))


def unservable_rows(table: jax.Array, dtype: str) -> dict[str, np.ndarray]:
  """Host-side, for a concrete `[V, D]` table (any sharding, Auto or
  Explicit mesh): `{problem: sorted row indices}` of the rows a serving
  copy in `dtype` would not hold (module doc); empty if there are none.

  One reduction per row, read back as `[V]` flags; a serving conversion
  runs it, a training step never does.
  """
  dtype = check_serving_dtype(dtype)
  if dtype != INT8 and np.dtype(table.dtype) == jnp.dtype(dtype):
    return {}  # a cast to the table's own dtype changes nothing
  sharding = getattr(table, "sharding", None)
  out = (NamedSharding(sharding.mesh, P())
         if isinstance(sharding, NamedSharding) else None)
  flags = np.asarray(jax.device_get(_jitted_flags(dtype, out)(table)))
  found = {}
  for i, problem in enumerate(_problems(dtype)):
    rows = np.flatnonzero(flags == i + 1)
    if rows.size:
      found[problem] = rows
  return found


@functools.lru_cache(maxsize=32)
def _jitted_flags(dtype: str, out_sharding):
  return jax.jit(functools.partial(_row_flags, dtype=dtype),
                 out_shardings=out_sharding)


def rows_text(rows: np.ndarray, limit: int = 10) -> str:
  """"row 7", or "rows [3, 7, 9]" (the first `limit`, then how many more)."""
  rows = [int(r) for r in rows]
  if len(rows) == 1:
    return f"row {rows[0]}"
  more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
  return f"rows {rows[:limit]}{more}"


def raise_if_unservable(dtype: str, found, where: str) -> None:
  """One InputError naming every row of `found`, a list of `(name, {problem:
  rows})` (name: what holds the rows, e.g. "table 'items' ", or "")."""
  parts, count = [], 0
  for name, problems in found:
    for problem, rows in problems.items():
      parts.append(f"{name}{rows_text(rows)}: {problem}")
      count += len(rows)
  if not parts:
    return
  want = ("finite rows whose max - min is a finite float32"
          if dtype == INT8 else f"values within {dtype}'s range")
  other = ", or serve bfloat16" if dtype == "float16" else ""
  raise InputError(
      f"pallas_emb {where}: {count} table row{'s' if count > 1 else ''} "
      f"cannot be served as {dtype} ({'; '.join(parts)}); expected {want}. "
      f"Fix or clip those rows first{other}.")


def dequantize_rows(rows: QuantizedRows) -> jax.Array:
  """The f32 `[V, D]` table a `QuantizedRows` reads back as."""
  return common.dequantize(rows.codes, rows.scale[:, None],
                           rows.bias[:, None])
