"""Row DMAs between a table in HBM and a VMEM tile, the Mosaic kernels'
one way of touching a table.

`copy_rows` starts one async copy per row whose id is >= 0 and then waits
for all of them on one semaphore (every copy has the same size, so the
waits may come in any order). A row whose id is < 0 is not copied.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# One `[block, width]` tile of f32 stays under this many bytes, so the
# tiles of a kernel (double-buffered inputs and outputs, the DMA scratch)
# fit the 16 MiB of VMEM a kernel may use by default on every TPU.
TILE_BYTES = 1 << 20
# Row tiles are a multiple of the sublanes of the narrowest dtype (bf16
# packs 16 rows into a (16, 128) tile).
ROW_ALIGN = 16
MAX_BLOCK_ROWS = 512
# The pooled lookup's tile of entry rows (f32 bytes) may not pass this.
MAX_POOL_TILE_BYTES = 4 << 20


def block_rows(num_rows: int, width: int, *, copies: int = 1) -> int:
  """Rows of a tile: a power of two, a multiple of `ROW_ALIGN`, at most
  `MAX_BLOCK_ROWS`, `copies` f32 tiles of it under `TILE_BYTES`, and no
  larger than `num_rows` needs."""
  fits = max(ROW_ALIGN, TILE_BYTES // (4 * width * copies))
  rows = ROW_ALIGN
  while rows * 2 <= min(fits, MAX_BLOCK_ROWS) and rows < num_rows:
    rows *= 2
  return rows


def padded(x: jax.Array, size: int, fill) -> jax.Array:
  """`x` (1-D or 2-D, along axis 0) padded with `fill` to `size` rows."""
  extra = size - x.shape[0]
  if extra == 0:
    return x
  pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, pad, constant_values=fill)


def interpret_params(interpret: bool):
  """The `interpret` argument of a Mosaic pallas_call."""
  return pltpu.InterpretParams() if interpret else False


def smem_blocks(ids: jax.Array, rows: int) -> jax.Array:
  """`[B * rows]` ids as `[B, 1, rows]`, the layout `smem_block` reads
  (a 2-D block equal to the array's last two dimensions needs no tiling)."""
  return ids.reshape(-1, 1, rows)


def smem_block(rows: int) -> pl.BlockSpec:
  """Program i's `[1, rows]` ids of `smem_blocks(ids, rows)`, in SMEM."""
  return pl.BlockSpec((None, 1, rows), lambda i: (i, 0, 0),
                      memory_space=pltpu.SMEM)


def copy_rows(ids_ref, src, dst, sem, *, num: int, src_is_table: bool):
  """Copies rows between a table (HBM) and a tile (VMEM), then waits.

  `ids_ref[0, r]` (SMEM, `smem_block`) is the table row of tile row `r`,
  for `r < num`; ids < 0 are skipped. `src_is_table`: table -> tile, else
  tile -> table.
  """
  def descriptor(r):
    row = ids_ref[0, r]
    table_at = pl.ds(jnp.maximum(row, 0), 1)
    tile_at = pl.ds(r, 1)
    if src_is_table:
      return row, pltpu.make_async_copy(src.at[table_at], dst.at[tile_at], sem)
    return row, pltpu.make_async_copy(src.at[tile_at], dst.at[table_at], sem)

  def start(r, carry):
    row, copy = descriptor(r)
    pl.when(row >= 0)(copy.start)
    return carry

  def wait(r, carry):
    row, copy = descriptor(r)
    pl.when(row >= 0)(copy.wait)
    return carry

  lax.fori_loop(0, num, start, 0)
  lax.fori_loop(0, num, wait, 0)
