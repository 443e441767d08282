"""Row DMAs between a stored table in HBM and VMEM tiles: the Mosaic
kernels' one way of touching a table.

Every row of a stored table (`stored.py`) is whole 32-bit tile rows, so a
row is one aligned DMA. What a v5e measured (`bench/tpu_parts.py`): the
DMA engine takes a one-row copy about every 14 ns when the copies are
started by an unrolled loop and waited for all at once, twice that when
each start is a dynamic loop trip and each copy is waited for on its own;
XLA's own gather moves a row in about 12 ns. A kernel therefore starts a
tile's copies branch-free (a skipped row copies nothing only where it must:
a write), waits once for the whole tile (DMA semaphores count bytes), and
double-buffers tiles across grid steps so one tile's copies are in flight
while the previous one is computed on.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Row copies started per loop trip (the loop over a tile is unrolled by it).
UNROLL = 8
# Row tiles are a multiple of this (a whole unrolled trip, and of the
# (16, 128) tile of a bf16 tile in VMEM).
ROW_ALIGN = 16
# A kernel's VMEM: what it asks Mosaic for (v5e and v6e have 128 MiB, v4
# 32 MiB of which a kernel gets 16 by default) and what its tiles may take.
VMEM_LIMIT = 64 << 20
TILE_BUDGET = 16 << 20


def block_rows(num_rows: int, row_bytes: int, *, copies: int = 1,
               most: int = 512) -> int:
  """Rows of a tile: a power of two, a multiple of `ROW_ALIGN`, at most
  `most`, `copies` tiles of it within `TILE_BUDGET / 4`, and no larger than
  `num_rows` needs."""
  fits = max(ROW_ALIGN, TILE_BUDGET // 4 // (row_bytes * copies))
  rows = ROW_ALIGN
  while rows * 2 <= min(fits, most) and rows < num_rows:
    rows *= 2
  return rows


def padded(x: jax.Array, size: int, fill) -> jax.Array:
  """`x` padded along axis 0 with `fill` to `size` rows."""
  extra = size - x.shape[0]
  if extra == 0:
    return x
  pad = [(0, extra)] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, pad, constant_values=fill)


def interpret_params(interpret: bool):
  """The `interpret` argument of a Mosaic pallas_call."""
  return pltpu.InterpretParams() if interpret else False


def compiler_params(*semantics: str):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=VMEM_LIMIT)


def update_in_place(kernel, grid_spec, prefetch, inputs, states, *,
                    interpret: bool, name: str):
  """`kernel` over a sequential grid (`grid_spec`, one scalar prefetch
  operand), its operands `prefetch, *inputs, *states`, writing `states`
  in place (aliased): the new states."""
  return pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states),
      grid_spec=grid_spec,
      input_output_aliases={1 + len(inputs) + i: i
                            for i in range(len(states))},
      compiler_params=compiler_params("arbitrary"),
      interpret=interpret_params(interpret),
      name=name,
  )(prefetch, *inputs, *states)


def smem_blocks(ids: jax.Array, rows: int) -> jax.Array:
  """`[B * rows]` ids as `[B, 1, rows]`, the layout `smem_block` reads."""
  return ids.reshape(-1, 1, rows)


def smem_block(rows: int, ahead: int = 0, num_blocks: int | None = None
               ) -> pl.BlockSpec:
  """Program i's `[1, rows]` ids of `smem_blocks(ids, rows)`, in SMEM; with
  `ahead=1`, program i + 1's (the last program's own at the end)."""
  if ahead:
    last = num_blocks - 1
    index = lambda i, *_: (jnp.minimum(i + ahead, last), 0, 0)
  else:
    index = lambda i, *_: (i, 0, 0)
  return pl.BlockSpec((None, 1, rows), index, memory_space=pltpu.SMEM)


def start_reads(ids_ref, table, tile, sem, *, num: int):
  """Starts the copies `table[ids_ref[0, r]] -> tile[r]`, r < num (ids
  must be rows of the table: a padding row reads row 0)."""
  def body(j, carry):
    for u in range(UNROLL):
      r = j * UNROLL + u
      pltpu.make_async_copy(table.at[pl.ds(ids_ref[0, r], 1)],
                            tile.at[pl.ds(r, 1)], sem).start()
    return carry
  lax.fori_loop(0, num // UNROLL, body, 0)


def wait_tile(table, tile, sem):
  """Waits for every row copy into (or out of) `tile` on `sem`: one wait
  for the whole tile's bytes."""
  pltpu.make_async_copy(table.at[pl.ds(0, tile.shape[0])], tile, sem).wait()


def double_buffered_reads(ids_ref, next_ref, table, tile, sem, *, num: int):
  """Over a 1-D grid: program i's `num` rows (`ids_ref`) into `tile[i % 2]`,
  started by program i - 1 (program 0 starts its own), while program i
  starts program i + 1's (`next_ref`) into the other slot. Returns program
  i's slot, its rows arrived."""
  i, n = pl.program_id(0), pl.num_programs(0)
  slot = i % 2

  @pl.when(i == 0)
  def _():
    start_reads(ids_ref, table, tile.at[0], sem.at[0], num=num)

  @pl.when(i + 1 < n)
  def _():
    start_reads(next_ref, table, tile.at[1 - slot], sem.at[1 - slot],
                num=num)

  wait_tile(table, tile.at[slot], sem.at[slot])
  return slot


def start_writes(ids_ref, tile, table, sem, *, num: int) -> jax.Array:
  """Starts the copies `tile[r] -> table[ids_ref[0, r]]` for r < num whose
  id is >= 0; returns how many were started (int32)."""
  def body(j, started):
    for u in range(UNROLL):
      r = j * UNROLL + u
      row = ids_ref[0, r]
      copy = pltpu.make_async_copy(tile.at[pl.ds(r, 1)],
                                   table.at[pl.ds(jnp.maximum(row, 0), 1)],
                                   sem)
      pl.when(row >= 0)(copy.start)
      started = started + (row >= 0).astype(jnp.int32)
    return started
  return lax.fori_loop(0, num // UNROLL, body, jnp.int32(0))


def wait_rows(tile, table, sem, count):
  """Waits for `count` one-row copies out of `tile` on `sem`."""
  one = pltpu.make_async_copy(tile.at[pl.ds(0, 1)], table.at[pl.ds(0, 1)],
                              sem)
  lax.fori_loop(0, count, lambda _, c: (one.wait(), c)[1], 0)
