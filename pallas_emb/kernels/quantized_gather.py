"""Pallas (Triton) kernel: gather int8 rows of a column shard, as f32.

For a uint8 code shard `[vocab_rows, shard_width]` with per-row f32 `scale`
and `bias` (`quantize.QuantizedRows`, FBGEMM's fused 8-bit row-wise
semantics) and `[N]` ids:

    out[n] = codes[r] * scale[r] + bias[r]      r = wrap_and_clamp(ids[n])

computed in f32 with the product rounded on its own, so the result equals
the jnp twin (`quantize.gather_dequantized_reference`) bit for bit.

The layout is the f32 gather's (`gather.py`): flat views, program `(i, j)`
owns `block_rows` ids and `block_cols` columns, the per-row mask and the
per-row scale / bias are 1-D vectors, the codes are read with offsets
`rows[:, None] * width + cols[None, :]`. A row of codes is a quarter of an
f32 row, so a 16-byte access carries 16 codes: tiles are sized for the f32
output (4 bytes per element), warps so that every thread holds 16 codes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb import quantize
from pallas_emb.kernels import common

# The f32 output tile: 4096 elements (16 KiB) in registers, row segments of
# at most 256 columns (1 KiB of output), and enough programs for the SMs.
_TILE_ELEMENTS = 4096
_MAX_ROW_COLS = 256
_MIN_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class QuantizedGatherConfig(common.RowTileConfig):
  """Tile of the dequantizing gather (`common.RowTileConfig`)."""


def resolve_config(config: QuantizedGatherConfig | None, num_ids: int,
                   width: int) -> QuantizedGatherConfig:
  """`config` with every None field filled in by the shape heuristic.

  The heuristics count codes (1 byte): the floor of one warp holding 16
  codes per thread and the warps giving each thread 16 codes; the cap is
  the f32 tile.
  """
  config = config or QuantizedGatherConfig()
  block_cols = config.block_cols or common.block_cols_for(width, 1,
                                                          _MAX_ROW_COLS)
  block_rows = config.block_rows or common.block_rows_for(
      num_ids, block_cols, 1, tile_bytes=_TILE_ELEMENTS,
      min_programs=_MIN_PROGRAMS, col_blocks=pl.cdiv(width, block_cols))
  num_warps = config.num_warps or common.num_warps_for(
      block_rows * block_cols, 1)
  return QuantizedGatherConfig(block_rows, block_cols, num_warps,
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
  values = quantize.dequantize(codes, scale[:, None], bias[:, None])
  dst = jnp.where(row_ok, rows, 0)[:, None] * width + cols[None, :]
  dst = common.store_offsets(dst, mask, num_ids * width, interpret)
  plgpu.store(out_ref.at[dst], values, mask=mask)


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
  if codes.dtype != jnp.uint8 or scale.shape != (vocab_rows,) or (
      bias.shape != (vocab_rows,)):
    raise ValueError(
        f"pallas_emb gather_dequantized: codes {codes.dtype}"
        f"{list(codes.shape)}, scale {list(scale.shape)}, bias "
        f"{list(bias.shape)}; expected uint8 [V, S] codes and [V] scale and "
        "bias (quantize.quantize_rows(table, 'int8')).")
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
  with common.quiet_triton_deprecation():
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_ids * width,), jnp.float32),
        grid=(pl.cdiv(num_ids, config.block_rows),
              pl.cdiv(width, config.block_cols)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        name="pallas_emb_quantized_gather",
    )(ids, codes.reshape(-1), scale.astype(jnp.float32),
      bias.astype(jnp.float32))
  return out.reshape(num_ids, width)
