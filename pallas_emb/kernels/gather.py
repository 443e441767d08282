"""Pallas (Triton) kernel: gather rows of a column shard for a list of ids.

The table shard `[vocab_rows, shard_width]` and the output `[num_ids,
shard_width]` are addressed through flat views, so any shard width works: a
program copies a `[block_rows, next_pow2(shard_width)]` tile, masking the
columns past the width and the rows past the end. Masked lanes are given
out-of-range (never negative) flat offsets, because interpret mode turns a
masked store into a scatter that drops out-of-range writes but would let an
in-range masked lane overwrite a real one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common


@dataclasses.dataclass(frozen=True)
class GatherConfig:
  """Tile sizes of the gather kernel."""
  block_rows: int = 64
  num_warps: int = 4
  num_stages: int = 1


def _gather_kernel(ids_ref, table_ref, out_ref, *, num_ids, vocab_rows,
                   width, block_rows, block_cols):
  rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  row_ok = rows < num_ids
  ids = plgpu.load(ids_ref.at[jnp.where(row_ok, rows, num_ids)],
                   mask=row_ok, other=0)
  ids = common.wrap_and_clamp(ids, vocab_rows)
  cols = jnp.arange(block_cols)
  ok = row_ok[:, None] & (cols < width)[None, :]
  src = jnp.where(ok, ids[:, None] * width + cols[None, :], vocab_rows * width)
  values = plgpu.load(table_ref.at[src], mask=ok, other=0)
  dst = jnp.where(ok, rows[:, None] * width + cols[None, :], num_ids * width)
  plgpu.store(out_ref.at[dst], values, mask=ok)


def gather_rows(table: jax.Array, ids: jax.Array, *,
                config: GatherConfig = GatherConfig(),
                interpret: bool = False) -> jax.Array:
  """`table[wrap_and_clamp(ids)]` for a `[V, S]` table and `[N]` int32 ids."""
  vocab_rows, width = table.shape
  (num_ids,) = ids.shape
  common.check_flat_size(table, "table shard")
  kernel = functools.partial(
      _gather_kernel, num_ids=num_ids, vocab_rows=vocab_rows, width=width,
      block_rows=config.block_rows,
      block_cols=pl.next_power_of_2(width))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_ids * width,), table.dtype),
      grid=(pl.cdiv(num_ids, config.block_rows),),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      name="pallas_emb_gather",
  )(ids, table.reshape(-1))
  return out.reshape(num_ids, width)
