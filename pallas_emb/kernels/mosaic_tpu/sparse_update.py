"""Mosaic TPU kernel: a sparse optimizer's update of the rows a batch used.

Every optimizer runs through this one kernel, driven by its update rule
(`triton.sparse_update.UpdateRule`). The row-wise part (one value per row:
Adagrad's accumulator, the last step of a lazy decay) is computed in jnp on
the `[U]` touched rows and scattered back: a few bytes per row. The kernel
does the heavy part in place: program i reads the table rows (and the
element-wise state rows, e.g. Adam's moments) of its `R` unique slots by
DMA into VMEM tiles, runs `rule.column_update` on the `[R, S]` tiles and
writes the rows back by DMA. The table and the element-wise state are
aliased to the outputs and stay in HBM: unique tokens are unique, so every
touched row is read and written by one program, no other row is touched,
and the update costs O(U * S), not O(V * S).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels import common
from pallas_emb.kernels import reference
from pallas_emb.kernels.mosaic_tpu import dma


def _kernel(*refs, rule, num_coeffs, num_scalars, block):
  num_elements = len(rule.element_slots)
  dest_ref, grad_ref, coeffs_ref, scalars_ref, table_ref = refs[:5]
  element_refs = refs[5:5 + num_elements]
  table_out = refs[5 + num_elements]
  element_outs = refs[6 + num_elements:6 + 2 * num_elements]
  table_tile = refs[6 + 2 * num_elements]
  element_tiles = refs[7 + 2 * num_elements:7 + 3 * num_elements]
  sem = refs[-1].at[0]

  read = functools.partial(dma.copy_rows, dest_ref, num=block,
                           src_is_table=True)
  write = functools.partial(dma.copy_rows, dest_ref, num=block,
                            src_is_table=False)
  read(table_ref, table_tile, sem)
  for ref, tile in zip(element_refs, element_tiles):
    read(ref, tile, sem)
  coeffs = tuple(coeffs_ref[:, j:j + 1] for j in range(num_coeffs))
  scalars = tuple(scalars_ref[i] for i in range(num_scalars))
  new_values, new_element = rule.column_update(
      coeffs, table_tile[...].astype(jnp.float32), grad_ref[...],
      {name: tile[...] for name, tile in zip(rule.element_slots,
                                             element_tiles)},
      scalars, table_tile.dtype)
  table_tile[...] = new_values.astype(table_tile.dtype)
  write(table_tile, table_out, sem)
  for name, tile, out in zip(rule.element_slots, element_tiles,
                             element_outs):
    tile[...] = new_element[name].astype(tile.dtype)
    write(tile, out, sem)


def sparse_update(rule, table: jax.Array, row_state: Sequence[jax.Array],
                  element_state: Sequence[jax.Array],
                  unique_tokens: jax.Array, grad_accum: jax.Array,
                  row_sq: jax.Array, apply, step, scalars: Sequence[Any], *,
                  emb_width: int | None = None, interpret: bool = False):
  """`rule`'s update of the rows of `unique_tokens`, in place (the
  arguments and result of `triton.sparse_update.sparse_update`)."""
  row_state, element_state = tuple(row_state), tuple(element_state)
  scalars = tuple(jnp.asarray(s, jnp.float32) for s in scalars)
  row_sq = common.check_update_args(rule, table, row_state, element_state,
                                    unique_tokens, grad_accum, row_sq,
                                    scalars)
  vocab_rows, width = table.shape
  (num_unique,) = unique_tokens.shape
  if num_unique == 0:
    return table, row_state, element_state
  part = reference.touched_row_state(rule, vocab_rows, row_state,
                                     unique_tokens, row_sq, apply, step,
                                     scalars, emb_width=emb_width)
  row_state = tuple(
      a.at[part.dest].set(part.new[name].astype(a.dtype), mode="drop")
      for name, a in zip(rule.row_slots, row_state))

  block = dma.block_rows(num_unique, width,
                         copies=2 + 2 * len(element_state))
  num_blocks = pl.cdiv(num_unique, block)
  size = num_blocks * block
  dest = dma.padded(jnp.where(part.ok, part.rows, -1).astype(jnp.int32),
                    size, -1)
  grad = dma.padded(grad_accum.astype(jnp.float32), size, 0.0)
  num_coeffs = len(part.coeffs)
  coeffs = (jnp.stack(part.coeffs, axis=1).astype(jnp.float32)
            if num_coeffs else jnp.zeros((num_unique, 1), jnp.float32))
  coeffs = dma.padded(coeffs, size, 0.0)
  scalar_array = (jnp.stack(scalars) if scalars
                  else jnp.zeros((1,), jnp.float32))
  state = (table,) + element_state
  inputs = (dma.smem_blocks(dest, block), grad, coeffs, scalar_array)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = pl.pallas_call(
      functools.partial(_kernel, rule=rule, num_coeffs=num_coeffs,
                        num_scalars=len(scalars), block=block),
      out_shape=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in state),
      grid=(num_blocks,),
      in_specs=[dma.smem_block(block),
                pl.BlockSpec((block, width), lambda i: (i, 0)),
                pl.BlockSpec((block, coeffs.shape[1]), lambda i: (i, 0)),
                pl.BlockSpec(memory_space=pltpu.SMEM)]
               + [any_spec] * len(state),
      out_specs=tuple(any_spec for _ in state),
      scratch_shapes=([pltpu.VMEM((block, width), s.dtype) for s in state]
                      + [pltpu.SemaphoreType.DMA((1,))]),
      input_output_aliases={len(inputs) + i: i for i in range(len(state))},
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",)),
      interpret=dma.interpret_params(interpret),
      name=rule.kernel_name + "_tpu",
  )(*inputs, *state)
  return outs[0], row_state, tuple(outs[1:])
