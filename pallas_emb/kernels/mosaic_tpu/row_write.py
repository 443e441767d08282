"""Mosaic TPU kernel: rows written into a stored array in place, one DMA a
row (the host tier's swap: a batch's fetched rows into their cache slots).

XLA's scatter of 32,768 rows of 128 f32 lanes into an `[8M, 128]` cache
took a v5e 2.07 ms, 63 ns a row; a row DMA takes 14-20 ns (`dma.py`).
Program i copies its `R` rows into VMEM (Pallas' pipeline, overlapped with
program i - 1), starts one DMA per row whose slot is in the array, and
waits for them before it ends. The slots must be unique: two copies to one
row land in no set order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels.mosaic_tpu import dma
from pallas_emb.kernels.mosaic_tpu import stored


def write_rows_twin(array: jax.Array, slots: jax.Array,
                    rows: jax.Array) -> jax.Array:
  """`write_rows` in jnp: rows whose slot is outside `[0, V)` are skipped."""
  inside = (slots >= 0) & (slots < array.shape[0])
  return array.at[jnp.where(inside, slots, array.shape[0])].set(
      rows.astype(array.dtype), mode="drop")


def supported(array: jax.Array) -> bool:
  """Whether `write_rows` takes `array`: `[V, S]` of 32-bit words, S whole
  128-lane rows (a stored table, or element-wise state in the gradients'
  layout)."""
  return (array.ndim == 2 and array.dtype.itemsize == 4
          and array.shape[1] % stored.LANES == 0)


def _kernel(dest_ref, rows_ref, _, out_ref, sem, *, block):
  count = dma.start_writes(dest_ref, rows_ref, out_ref, sem.at[0], num=block)
  dma.wait_rows(rows_ref, out_ref, sem.at[0], count)


def write_rows(array: jax.Array, slots: jax.Array, rows: jax.Array, *,
               interpret: bool = False) -> jax.Array:
  """`array` `[V, S]` with row `slots[k]` set to `rows[k]`, in place (the
  array is aliased: donate it); a slot outside `[0, V)` is skipped. Slots
  inside must be unique."""
  if not supported(array):
    raise ValueError(
        f"pallas_emb mosaic write_rows: a {array.dtype}{list(array.shape)} "
        "array; expected [rows, columns] of 32-bit words with the columns "
        f"a multiple of {stored.LANES} (a stored table).")
  n, width = rows.shape
  if n == 0:
    return array
  block = dma.block_rows(n, 4 * width, copies=2)
  size = pl.cdiv(n, block) * block
  inside = (slots >= 0) & (slots < array.shape[0])
  dest = dma.padded(jnp.where(inside, slots, -1).astype(jnp.int32), size, -1)
  rows = dma.padded(rows.astype(array.dtype), size, 0)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_kernel, block=block),
      out_shape=jax.ShapeDtypeStruct(array.shape, array.dtype),
      grid=(size // block,),
      in_specs=[dma.smem_block(block),
                pl.BlockSpec((block, width), lambda i: (i, 0)), any_spec],
      out_specs=any_spec,
      scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
      input_output_aliases={2: 0},
      compiler_params=dma.compiler_params("arbitrary"),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_write_rows_tpu",
  )(dma.smem_blocks(dest, block), rows, array)
