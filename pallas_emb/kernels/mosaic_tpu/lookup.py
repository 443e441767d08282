"""Mosaic TPU kernels: the sequence gather and the pooled lookup.

gather: `out[n] = table[wrap_and_clamp(ids[n])]`. Program i copies the rows
of ids `i * R ... i * R + R - 1` straight from the table (HBM) into its
`[R, S]` output tile by DMA.

pool: per bag, `round(sum_k weights[k] * f32(table[rows[k]]))`, accumulated
in f32 in entry order with every product rounded on its own (as
`reference.pool_rows`, bit for bit). The CSR bags are laid out densely
first (`[M, max_len]` entries, padding entries marked -1): program i copies
the rows of its `R` bags' entries into a `[max_len * R, S]` tile, entry k of
every bag in rows `k * R ... k * R + R - 1`, and sums the `max_len` `[R, S]`
slices. Padding entries copy nothing: their rows are zeros and their
weights 0, so they add +0.0, as the twin's masked lanes do. Bags so long
that 16 bags' entry rows pass `dma.MAX_POOL_TILE_BYTES` are pooled by the
xla backend's gathers instead.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels import common
from pallas_emb.kernels import xla
from pallas_emb.kernels.mosaic_tpu import dma


def _gather_kernel(ids_ref, table_ref, out_ref, sem, *, block):
  dma.copy_rows(ids_ref, table_ref, out_ref, sem.at[0], num=block,
                src_is_table=True)


def gather_rows(table: jax.Array, ids: jax.Array, *,
                interpret: bool = False) -> jax.Array:
  """`table[wrap_and_clamp(ids)]` for a `[V, S]` table and `[N]` int32 ids."""
  vocab_rows, width = table.shape
  (num_ids,) = ids.shape
  if num_ids == 0:
    return jnp.zeros((0, width), table.dtype)
  block = dma.block_rows(num_ids, width)
  num_blocks = pl.cdiv(num_ids, block)
  ids = dma.padded(common.wrap_and_clamp(ids.astype(jnp.int32), vocab_rows),
                   num_blocks * block, 0)
  out = pl.pallas_call(
      functools.partial(_gather_kernel, block=block),
      out_shape=jax.ShapeDtypeStruct((num_blocks * block, width),
                                     table.dtype),
      grid=(num_blocks,),
      in_specs=[dma.smem_block(block), pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
      scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",)),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_gather_tpu",
  )(dma.smem_blocks(ids, block), table)
  return out[:num_ids]


def _pool_kernel(rows_ref, weights_ref, table_ref, out_ref, tile_ref, sem,
                 *, block, max_len):
  tile_ref[...] = jnp.zeros(tile_ref.shape, tile_ref.dtype)
  dma.copy_rows(rows_ref, table_ref, tile_ref, sem.at[0],
                num=block * max_len, src_is_table=True)

  def add_entry(k, acc):
    at = pl.ds(pl.multiple_of(k * block, block), block)
    values = tile_ref[at, :].astype(jnp.float32)
    return acc + common.unfused_product(weights_ref[at, :], values)

  acc = lax.fori_loop(0, max_len, add_entry,
                      jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def dense_entries(rows, weights, bag_starts, *, max_len: int, block: int):
  """The CSR bags as `[num_blocks * max_len * block]` entry rows (-1 for
  padding) and f32 weights (0 for padding), ordered block, entry position,
  bag: the order a pool program's tile holds them in."""
  num_bags = bag_starts.shape[0] - 1
  num_blocks = pl.cdiv(num_bags, block)
  starts = dma.padded(bag_starts[:-1], num_blocks * block, 0)
  ends = dma.padded(bag_starts[1:], num_blocks * block, 0)
  entry = starts[:, None] + jnp.arange(max_len, dtype=jnp.int32)[None, :]
  ok = entry < ends[:, None]
  entry = jnp.where(ok, entry, 0)
  dense_rows = jnp.where(ok, jnp.take(rows, entry, mode="clip"), -1)
  dense_weights = jnp.where(
      ok, jnp.take(weights.astype(jnp.float32), entry, mode="clip"), 0.0)

  def blocked(x):  # [bags, max_len] -> [blocks, max_len, block], flat
    return x.reshape(num_blocks, block, max_len).transpose(0, 2, 1).reshape(-1)

  return blocked(dense_rows), blocked(dense_weights)


def pool_rows(table: jax.Array, rows: jax.Array, weights: jax.Array,
              bag_starts: jax.Array, *, max_len: int,
              interpret: bool = False, out_dtype=None) -> jax.Array:
  """`[M, S]` weighted row sums of `[V, S]` for CSR bags (as
  `reference.pool_rows`; see the module doc)."""
  out_dtype = out_dtype or table.dtype
  vocab_rows, width = table.shape
  num_bags = bag_starts.shape[0] - 1
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), out_dtype)
  block = dma.block_rows(num_bags, width, copies=max_len)
  if block * max_len * width * 4 > dma.MAX_POOL_TILE_BYTES:
    # Bags too long for even the smallest tile of entry rows in VMEM: XLA's
    # gathers (the same sums in the same order).
    return xla.pool_rows(table, rows, weights, bag_starts, max_len=max_len,
                         out_dtype=out_dtype)
  num_blocks = pl.cdiv(num_bags, block)
  entries = block * max_len
  rows = common.wrap_and_clamp(rows.astype(jnp.int32), vocab_rows)
  dense_rows, dense_weights = dense_entries(rows, weights, bag_starts,
                                            max_len=max_len, block=block)
  out = pl.pallas_call(
      functools.partial(_pool_kernel, block=block, max_len=max_len),
      out_shape=jax.ShapeDtypeStruct((num_blocks * block, width), out_dtype),
      grid=(num_blocks,),
      in_specs=[dma.smem_block(entries),
                pl.BlockSpec((entries, 1), lambda i: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((entries, width), table.dtype),
                      pltpu.SemaphoreType.DMA((1,))],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",)),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_pool_tpu",
  )(dma.smem_blocks(dense_rows, entries), dense_weights[:, None], table)
  return out[:num_bags]
