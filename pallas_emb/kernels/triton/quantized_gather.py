"""Pallas (Triton) kernels: gather int8 rows of a column shard, as f32.

For a uint8 code shard `[vocab_rows, shard_width]` with per-row f32 `scale`
and `bias` (`quantize.QuantizedRows`, FBGEMM's fused 8-bit row-wise
semantics) and `[N]` ids:

    out[n] = codes[r] * scale[r] + bias[r]      r = wrap_and_clamp(ids[n])

computed in f32 with the product rounded on its own, so the result equals
the jnp twin (`reference.gather_dequantized`) bit for bit.

The layout is the f32 gather's (`gather.py`): flat views, program `(i, j)`
owns `block_rows` ids and `block_cols` columns, the per-row mask and the
per-row scale / bias are 1-D vectors, the codes are read with offsets
`rows[:, None] * width + cols[None, :]`. A row of codes is a quarter of an
f32 row, so a 16-byte access carries 16 codes: tiles are sized for the f32
output (4 bytes per element), warps so that every thread holds 16 codes.

`pool_dequantized` is the pooled variant (`pool.py`'s layout): one f32
weighted sum of dequantized rows per bag.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common
from pallas_emb.kernels.triton import pool

# The f32 output tile: 4096 elements (16 KiB) in registers, row segments of
# at most 256 columns (1 KiB of output), and enough programs for the SMs.
_TILE_ELEMENTS = 4096
_MAX_ROW_COLS = 256
_MIN_PROGRAMS = 512
# The pooled kernel holds an f32 accumulator next to the dequantized rows.
_POOL_TILE_ELEMENTS = 2048


@dataclasses.dataclass(frozen=True)
class QuantizedGatherConfig(common.RowTileConfig):
  """Tile of the dequantizing gather (`common.RowTileConfig`)."""


def resolve_config(config: QuantizedGatherConfig | None, num_ids: int,
                   width: int, tile_elements: int = _TILE_ELEMENTS
                   ) -> QuantizedGatherConfig:
  """`config` with every None field filled in by the shape heuristic.

  The heuristics count codes (1 byte): the floor of one warp holding 16
  codes per thread and the warps giving each thread 16 codes; the cap is
  the f32 tile.
  """
  config = config or QuantizedGatherConfig()
  return QuantizedGatherConfig(*common.fill_tile(
      config.block_rows, config.block_cols, config.num_warps,
      num_rows=num_ids, width=width, itemsize=1, tile_bytes=tile_elements,
      max_row_bytes=_MAX_ROW_COLS, min_programs=_MIN_PROGRAMS),
                               config.num_stages)


def _kernel(ids_ref, codes_ref, scale_ref, bias_ref, out_ref, *, num_ids,
            vocab_rows, width, block_rows, block_cols, interpret):
  rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  row_ok = rows < num_ids
  ids = plgpu.load(ids_ref.at[rows], mask=row_ok, other=0)
  ids = common.wrap_and_clamp(ids, vocab_rows)
  # `ids` is in range on every lane (masked lanes load 0): no mask needed.
  scale = plgpu.load(scale_ref.at[ids])
  bias = plgpu.load(bias_ref.at[ids])
  cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)
  mask = row_ok[:, None]
  if width % block_cols:
    mask = mask & (cols < width)[None, :]
  codes = plgpu.load(codes_ref.at[ids[:, None] * width + cols[None, :]],
                     mask=mask, other=0)
  values = common.dequantize(codes, scale[:, None], bias[:, None])
  dst = jnp.where(row_ok, rows, 0)[:, None] * width + cols[None, :]
  dst = common.store_offsets(dst, mask, num_ids * width, interpret)
  plgpu.store(out_ref.at[dst], values, mask=mask)


def _check_rows(codes, scale, bias, what: str) -> None:
  vocab_rows = codes.shape[0]
  if codes.dtype != jnp.uint8 or scale.shape != (vocab_rows,) or (
      bias.shape != (vocab_rows,)):
    raise ValueError(
        f"pallas_emb {what}: codes {codes.dtype}{list(codes.shape)}, scale "
        f"{list(scale.shape)}, bias {list(bias.shape)}; expected uint8 "
        "[V, S] codes and [V] scale and bias "
        "(quantize.quantize_rows(table, 'int8')).")


def gather_dequantized(codes: jax.Array, scale: jax.Array, bias: jax.Array,
                       ids: jax.Array, *,
                       config: QuantizedGatherConfig | None = None,
                       interpret: bool = False) -> jax.Array:
  """f32 `[N, S]` rows of a `[V, S]` uint8 shard, dequantized (module doc).

  Args:
    codes: uint8 `[V, S]` column shard of `QuantizedRows.codes`.
    scale: f32 `[V]`, `bias`: f32 `[V]` (the full rows' scale and bias).
    ids: int32 `[N]` (wrapped once, then clamped into the table).
  """
  vocab_rows, width = codes.shape
  (num_ids,) = ids.shape
  _check_rows(codes, scale, bias, "gather_dequantized")
  common.check_flat_sizes("gather_dequantized",
                          **{"code shard": codes.shape,
                             "output": (num_ids, width)})
  if num_ids == 0:
    return jnp.zeros((0, width), jnp.float32)
  config = resolve_config(config, num_ids, width)
  kernel = functools.partial(
      _kernel, num_ids=num_ids, vocab_rows=vocab_rows, width=width,
      block_rows=config.block_rows, block_cols=config.block_cols,
      interpret=interpret)
  return common.call_row_tiles(
      kernel, ids, codes.reshape(-1), scale.astype(jnp.float32),
      bias.astype(jnp.float32), num_rows=num_ids, width=width,
      dtype=jnp.float32, block_rows=config.block_rows, config=config,
      name="pallas_emb_quantized_gather", interpret=interpret)


# --------------------------------------------------------------------------
# Pooled: one weighted sum of dequantized rows per bag
# --------------------------------------------------------------------------


def _pool_kernel(starts_ref, rows_ref, weights_ref, codes_ref, scale_ref,
                 bias_ref, out_ref, **static):
  width = static["width"]

  def load_values(rows, cols, mask):
    codes = plgpu.load(codes_ref.at[rows[:, None] * width + cols[None, :]],
                       mask=mask, other=0)
    values = common.dequantize(codes, plgpu.load(scale_ref.at[rows])[:, None],
                               plgpu.load(bias_ref.at[rows])[:, None])
    # A masked lane adds 0, whatever row 0's scale and bias are.
    return jnp.where(mask, values, 0.0)

  pool.pool_bags(starts_ref, rows_ref, weights_ref, out_ref, load_values,
                 **static)


def pool_dequantized(codes: jax.Array, scale: jax.Array, bias: jax.Array,
                     rows: jax.Array, weights: jax.Array,
                     bag_starts: jax.Array, *, max_len: int,
                     config: QuantizedGatherConfig | None = None,
                     interpret: bool = False) -> jax.Array:
  """f32 `[M, S]` weighted sums of dequantized rows of CSR bags.

  `out[m] = sum_e weights[e] * (codes[r] * scale[r] + bias[r])` over the
  entries `e` of bag m in ascending order (`r = wrap_and_clamp(rows[e])`),
  accumulated in f32 with every product rounded on its own, like
  `pool.pool_rows` of an f32 table; the tile is `block_rows` bags by
  `block_cols` columns. Arguments as `gather_dequantized` and
  `pool.pool_rows` (`bag_starts` int32 `[M + 1]`, non-decreasing).
  """
  vocab_rows, width = codes.shape
  (num_bags,) = bag_starts.shape
  num_bags -= 1
  _check_rows(codes, scale, bias, "pool_dequantized")
  common.check_flat_sizes("pool_dequantized",
                          **{"code shard": codes.shape,
                             "output": (num_bags, width)})
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), jnp.float32)
  config = resolve_config(config, num_bags, width, _POOL_TILE_ELEMENTS)
  kernel = functools.partial(
      _pool_kernel, num_bags=num_bags, vocab_rows=vocab_rows, width=width,
      max_len=max_len, block_bags=config.block_rows,
      block_cols=config.block_cols, interpret=interpret)
  return common.call_row_tiles(
      kernel, bag_starts, rows, weights.astype(jnp.float32),
      codes.reshape(-1), scale.astype(jnp.float32), bias.astype(jnp.float32),
      num_rows=num_bags, width=width, dtype=jnp.float32,
      block_rows=config.block_rows, config=config,
      name="pallas_emb_quantized_pool", interpret=interpret)
