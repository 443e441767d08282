"""Pallas (Triton) kernel: gather rows of a column shard for a list of ids.

The table shard `[vocab_rows, shard_width]` and the output `[num_ids,
shard_width]` are addressed through flat views, so any shard width works.
Program `(i, j)` copies the `[block_rows, block_cols]` tile of rows
`i * block_rows ...` and columns `j * block_cols ...`: wide shards are split
into column blocks (the tile stays in registers), narrow ones get many rows
per block (a warp then covers several rows with 16-byte vector accesses).

Row access pattern: the per-row mask lives on 1-D vectors and
the offsets are `rows[:, None] * width + cols[None, :]`, so Triton sees
`block_cols` contiguous, `width`-aligned elements per row and emits v2/v4
loads and stores. Ids are wrapped and clamped into the table, so every
load is in range; the store is masked per row.

`python -m bench.kernels --sweep --what=gather` sweeps its block sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common

# Tile of 16 KiB (4096 f32 / 8192 bf16 elements) in registers, row segments
# of at most 1 KiB per block, and enough programs to spread over the SMs.
_TILE_BYTES = 16384
_MAX_ROW_BYTES = 1024
_MIN_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class GatherConfig(common.RowTileConfig):
  """Tile of the gather kernel (`common.RowTileConfig`)."""


def resolve_config(config: GatherConfig | None, num_ids: int, width: int,
                   dtype) -> GatherConfig:
  """`config` with every None field filled in by the shape heuristic."""
  config = config or GatherConfig()
  return GatherConfig(*common.fill_tile(
      config.block_rows, config.block_cols, config.num_warps,
      num_rows=num_ids, width=width, itemsize=jnp.dtype(dtype).itemsize,
      tile_bytes=_TILE_BYTES, max_row_bytes=_MAX_ROW_BYTES,
      min_programs=_MIN_PROGRAMS), config.num_stages)


def _gather_kernel(ids_ref, table_ref, out_ref, *, num_ids, vocab_rows,
                   width, block_rows, block_cols, interpret):
  rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  row_ok = rows < num_ids
  # Contiguous and masked: lanes past the end read nothing on a GPU (the
  # interpreter clamps them into range).
  ids = plgpu.load(ids_ref.at[rows], mask=row_ok, other=0)
  ids = common.wrap_and_clamp(ids, vocab_rows)
  cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)
  mask = row_ok[:, None]
  if width % block_cols:
    mask = mask & (cols < width)[None, :]
  # `ids` is in range for every lane (masked lanes load 0), so the load
  # needs no sentinel; a padding column reads the next row and is dropped.
  values = plgpu.load(table_ref.at[ids[:, None] * width + cols[None, :]],
                      mask=mask, other=0)
  dst = jnp.where(row_ok, rows, 0)[:, None] * width + cols[None, :]
  dst = common.store_offsets(dst, mask, num_ids * width, interpret)
  plgpu.store(out_ref.at[dst], values, mask=mask)


def gather_rows(table: jax.Array, ids: jax.Array, *,
                config: GatherConfig | None = None,
                interpret: bool = False) -> jax.Array:
  """`table[wrap_and_clamp(ids)]` for a `[V, S]` table and `[N]` int32 ids."""
  vocab_rows, width = table.shape
  (num_ids,) = ids.shape
  common.check_flat_sizes("gather", **{"table shard": table.shape,
                                       "output": (num_ids, width)})
  if num_ids == 0:
    return jnp.zeros((0, width), table.dtype)
  config = resolve_config(config, num_ids, width, table.dtype)
  kernel = functools.partial(
      _gather_kernel, num_ids=num_ids, vocab_rows=vocab_rows, width=width,
      block_rows=config.block_rows, block_cols=config.block_cols,
      interpret=interpret)
  return common.call_row_tiles(
      kernel, ids, table.reshape(-1), num_rows=num_ids, width=width,
      dtype=table.dtype, block_rows=config.block_rows, config=config,
      name="pallas_emb_gather", interpret=interpret)
