"""Pallas (Triton) kernel: pooled gather, one weighted sum of rows per bag.

For a column shard `[vocab_rows, shard_width]`, `[N]` entry rows and f32
weights, and bags given CSR-style by `bag_starts[M + 1]` (bag m holds the
entries `[bag_starts[m], bag_starts[m + 1])`, at most `max_len` of them):

    out[m] = round(sum_e weights[e] * f32(table[rows[e]]))     (e ascending)

accumulated in f32 and rounded once to the table dtype. This is
what lets a pooled feature send one row per example through the all-to-all
instead of one per id.

Program `(i, j)` owns `block_bags` bags and `block_cols` columns; it walks
the bags' entries in lock step (`k = 0 .. max_len - 1`): per step one id and
one weight per bag (1-D vectors, masked per bag where the bag is shorter)
and a `[block_bags, block_cols]` tile of rows, with the offsets
`rows[:, None] * width + cols[None, :]` (the GPU kernel rules: vectorized row reads).
Each bag is summed by one program in entry order, so the result is
deterministic and equals the jnp twin bit for bit; the products are rounded
on their own (`common.unfused_product`) so no backend contracts them into
FMAs differently.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common

_TILE_BYTES = 8192     # f32 accumulator tile + one row tile in registers
_MAX_ROW_BYTES = 512
_MIN_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """Tile of the pooled gather; a field left None takes the shape heuristic."""
  block_bags: int | None = None
  block_cols: int | None = None
  num_warps: int | None = None
  num_stages: int = 1

  def __post_init__(self):
    common.check_config(self, ("block_bags", "block_cols", "num_warps"),
                        (("block_bags", "block_cols"),))


def resolve_config(config: PoolConfig | None, num_bags: int,
                   width: int) -> PoolConfig:
  """`config` with every None field filled in by the shape heuristic.

  Tiles are sized for the f32 accumulator (4 bytes per element), whatever
  the table dtype.
  """
  config = config or PoolConfig()
  return PoolConfig(*common.fill_tile(
      config.block_bags, config.block_cols, config.num_warps,
      num_rows=num_bags, width=width, itemsize=4, tile_bytes=_TILE_BYTES,
      max_row_bytes=_MAX_ROW_BYTES, min_programs=_MIN_PROGRAMS),
                    config.num_stages)


def pool_bags(starts_ref, rows_ref, weights_ref, out_ref, load_values, *,
              num_bags, vocab_rows, width, max_len, block_bags, block_cols,
              interpret):
  """The body of a pooled-gather kernel, whatever the table's storage.

  `load_values(rows, cols, mask)` reads the f32 `[block_bags, block_cols]`
  values of table rows `rows` (wrapped and clamped), columns `cols`, and is
  0 where `mask` is False; `quantized_gather.py` passes a dequantizing one.
  """
  bags = pl.program_id(0) * block_bags + jnp.arange(block_bags)
  bag_ok = bags < num_bags
  start = plgpu.load(starts_ref.at[bags], mask=bag_ok, other=0)
  end = plgpu.load(starts_ref.at[bags + 1], mask=bag_ok, other=0)
  cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)
  col_ok = cols < width

  def add_entry(k, acc):
    entry = start + k
    ok = bag_ok & (entry < end)
    row = plgpu.load(rows_ref.at[entry], mask=ok, other=0)
    row = common.wrap_and_clamp(row, vocab_rows)
    weight = plgpu.load(weights_ref.at[entry], mask=ok, other=0.0)
    mask = ok[:, None]
    if width % block_cols:
      mask = mask & col_ok[None, :]
    values = load_values(row, cols, mask)
    return acc + common.unfused_product(weight[:, None], values)

  acc = lax.fori_loop(0, max_len, add_entry,
                      jnp.zeros((block_bags, block_cols), jnp.float32))
  mask = bag_ok[:, None]
  if width % block_cols:
    mask = mask & col_ok[None, :]
  dst = jnp.where(bag_ok, bags, 0)[:, None] * width + cols[None, :]
  dst = common.store_offsets(dst, mask, num_bags * width, interpret)
  plgpu.store(out_ref.at[dst], acc.astype(out_ref.dtype), mask=mask)


def _pool_kernel(starts_ref, rows_ref, weights_ref, table_ref, out_ref,
                 **static):
  width = static["width"]

  def load_values(rows, cols, mask):
    values = plgpu.load(table_ref.at[rows[:, None] * width + cols[None, :]],
                        mask=mask, other=0)
    return values.astype(jnp.float32)

  pool_bags(starts_ref, rows_ref, weights_ref, out_ref, load_values, **static)


def pool_rows(table: jax.Array, rows: jax.Array, weights: jax.Array,
              bag_starts: jax.Array, *, max_len: int,
              config: PoolConfig | None = None,
              interpret: bool = False, out_dtype=None) -> jax.Array:
  """`[M, S]` weighted row sums of `[V, S]` for CSR bags (see module doc).

  Args:
    table: `[V, S]` f32 or bf16 column shard.
    rows: int32 `[N]` entry rows (wrapped and clamped into the table).
    weights: f32 `[N]` entry weights (0 for padding).
    bag_starts: int32 `[M + 1]`, non-decreasing, `bag_starts[M] <= N`.
    max_len: static upper bound of any bag's length.
    out_dtype: the result's dtype (default: the table's).
  """
  out_dtype = out_dtype or table.dtype
  vocab_rows, width = table.shape
  (num_bags,) = bag_starts.shape
  num_bags -= 1
  common.check_flat_sizes("pool", **{"table shard": table.shape,
                                     "output": (num_bags, width)})
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), out_dtype)
  config = resolve_config(config, num_bags, width)
  kernel = functools.partial(
      _pool_kernel, num_bags=num_bags, vocab_rows=vocab_rows, width=width,
      max_len=max_len, block_bags=config.block_bags,
      block_cols=config.block_cols, interpret=interpret)
  return common.call_row_tiles(
      kernel, bag_starts, rows, weights.astype(jnp.float32),
      table.reshape(-1), num_rows=num_bags, width=width, dtype=out_dtype,
      block_rows=config.block_bags, config=config, name="pallas_emb_pool",
      interpret=interpret)
