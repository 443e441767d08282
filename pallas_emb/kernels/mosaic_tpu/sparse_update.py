"""Mosaic TPU kernel: a sparse optimizer's update of the rows a batch used.

Every optimizer runs through this one kernel, driven by its update rule
(`triton.sparse_update.UpdateRule`). The row-wise part (one value per row:
Adagrad's accumulator, the last step of a lazy decay) is computed by XLA
on the touched slots, a chunk of slots at a time up to the last used slot
of the unique buffer (which is sized for a slot per id), and scattered
back: a few bytes per row. The kernel does the heavy part in place, on a
stored table (`stored.py`) and the element-wise state in the gradients'
layout: program i reads the rows of its `R` unique slots by DMA into VMEM
tiles while program i - 1's rows are written back (double-buffered), runs
`rule.column_update` on whole `[R, P]` tiles (a bf16 table's words
unpacked into two f32 halves and packed again) and DMAs the rows back.
Unique tokens are unique, so every row is read and written once; the
programs past the last used slot do nothing, and the update costs
O(U * S), never O(V * S).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels import common
from pallas_emb.kernels import reference
from pallas_emb.kernels import xla
from pallas_emb.kernels.mosaic_tpu import dma
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.kernels.mosaic_tpu import stream_update

# Slots per XLA chunk of the row-wise part.
ROW_CHUNK = 8192
# With sorted tokens: "auto" streams the table where
# `stream_update.worth_streaming` says so; "always" or "never" (A/Bs).
STREAM = "auto"



def _kernel(live_ref,  # scalar prefetch: [1] blocks with a used slot
            reads_ref, reads_next_ref, dest_ref,  # SMEM [1, R] blocks
            grad_ref,  # VMEM [R, G] block
            *refs, rule, num_coeffs, coeff_inputs, num_scalars, block):
  # SMEM [1, R] blocks, a coefficient's each (one of zeros if none).
  coeff_refs = refs[:num_coeffs]
  scalars_ref = refs[coeff_inputs]  # SMEM [k]
  refs = refs[coeff_inputs + 1:]
  num_states = 1 + len(rule.element_slots)
  states = refs[:num_states]  # HBM: the table, element-wise states
  outs = refs[num_states:2 * num_states]  # the same buffers (aliased)
  tiles = refs[2 * num_states:3 * num_states]  # VMEM [2, R, *] each
  read_sem, write_sem, started, columns = refs[3 * num_states:]
  i, live = pl.program_id(0), live_ref[0]
  slot = i % 2

  def start_reads(ids_ref, into):
    for state, tile in zip(states, tiles):
      dma.start_reads(ids_ref, state, tile.at[into], read_sem.at[into],
                      num=block)

  def wait_writes(of):
    for out, tile in zip(outs, tiles):
      dma.wait_rows(tile.at[of], out, write_sem.at[of], started[of])

  @pl.when(i < live)
  def _():
    @pl.when(i == 0)
    def _():
      start_reads(reads_ref, 0)

    @pl.when(i + 1 < live)
    def _():
      @pl.when(i > 0)
      def _():
        wait_writes(1 - slot)  # that tile's rows are written: refill it
      start_reads(reads_next_ref, 1 - slot)

    for state, tile in zip(states, tiles):
      dma.wait_tile(state, tile.at[slot], read_sem.at[slot])

    # The coefficients arrive one per row in SMEM (lane-dense in HBM; an
    # `[R, c]` array would pad each row to 128 lanes there): each becomes
    # a column of a VMEM tile.
    def spread(k, carry):
      for u in range(dma.UNROLL):
        r = k * dma.UNROLL + u
        for j, ref in enumerate(coeff_refs):
          columns[j, pl.ds(r, 1), :] = jnp.full(
              (1, columns.shape[2]), ref[0, r], jnp.float32)
      return carry
    if num_coeffs:
      lax.fori_loop(0, block // dma.UNROLL, spread, 0)
    coeffs = tuple(columns[j][:, 0:1] for j in range(num_coeffs))
    scalars = tuple(scalars_ref[j] for j in range(num_scalars))
    table_tile, element_tiles = tiles[0].at[slot], [t.at[slot]
                                                    for t in tiles[1:]]
    new_values, new_element = stored.rule_on_tiles(
        rule, coeffs, table_tile[...], grad_ref[...],
        {n: t[...] for n, t in zip(rule.element_slots, element_tiles)},
        scalars, pltpu.roll)
    table_tile[...] = new_values
    for name, tile in zip(rule.element_slots, element_tiles):
      tile[...] = new_element[name].astype(tile.dtype)
    count = jnp.int32(0)
    for out, tile in zip(outs, tiles):
      count = dma.start_writes(dest_ref, tile.at[slot], out,
                               write_sem.at[slot], num=block)
    started[slot] = count

    @pl.when(i + 1 == live)
    def _():
      @pl.when(i > 0)
      def _():
        wait_writes(1 - slot)
      wait_writes(slot)


def _row_part(rule, vocab_rows, row_state, unique_tokens, row_sq, apply,
              step, scalars, emb_width, size):
  """The row-wise part of the update on the used slots (see
  `reference.touched_row_state`): `(row_state, dest [U], coeffs)`, dest -1
  for a slot that is not updated, coeffs c arrays `[size]` (`size` >= U;
  zeros past U). The slots are visited a chunk at a time up to the last
  used one: the buffer holds a slot per id."""
  num_slots = unique_tokens.shape[0]
  tokens = common.wrap_once(unique_tokens, vocab_rows)
  used = (tokens >= 0) & (tokens < vocab_rows)
  extent = jnp.max(jnp.where(used, jnp.arange(1, num_slots + 1), 0),
                   initial=0)
  chunk = min(ROW_CHUNK, num_slots)
  probe = reference.touched_row_state(
      rule, vocab_rows, row_state, unique_tokens[:1], row_sq[:1], apply,
      step, scalars, emb_width=emb_width)
  num_coeffs = max(1, len(probe.coeffs))

  def body(start, fresh, carry):
    row_state, dest, coeffs = carry
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk)
    # A slot of the chunk before (the last chunk may overlap it) is left.
    part_tokens = jnp.where(fresh, take(unique_tokens), vocab_rows)
    part = reference.touched_row_state(
        rule, vocab_rows, row_state, part_tokens, take(row_sq), apply,
        step, scalars, emb_width=emb_width)
    row_state = tuple(
        a.at[part.dest].set(part.new[name].astype(a.dtype), mode="drop")
        for name, a in zip(rule.row_slots, row_state))
    here = jnp.where(part.ok, part.rows, -1).astype(jnp.int32)
    dest = jax.lax.dynamic_update_slice_in_dim(
        dest, jnp.where(fresh, here, take(dest)), start, 0)
    values = part.coeffs or (jnp.zeros((chunk,), jnp.float32),)
    coeffs = tuple(
        jax.lax.dynamic_update_slice_in_dim(
            c, jnp.where(fresh, v.astype(jnp.float32), take(c)), start, 0)
        for c, v in zip(coeffs, values))
    return row_state, dest, coeffs

  carry = (tuple(row_state), jnp.full((num_slots,), -1, jnp.int32),
           tuple(jnp.zeros((size,), jnp.float32) for _ in range(num_coeffs)))
  carry = xla._over_used_chunks(  # pylint: disable=protected-access
      body, num_slots, extent, carry, chunk)
  return carry, extent, len(probe.coeffs)


def sparse_update(rule, table: jax.Array, row_state: Sequence[jax.Array],
                  element_state: Sequence[jax.Array],
                  unique_tokens: jax.Array, grad_accum: jax.Array,
                  row_sq: jax.Array, apply, step, scalars: Sequence[Any], *,
                  emb_width: int | None = None, interpret: bool = False,
                  sorted_tokens: bool = False):
  """`rule`'s update of the rows of `unique_tokens`, in place (the
  arguments and result of `triton.sparse_update.sparse_update`).

  `table` is stored (`stored.py`; then `grad_accum` and the element-wise
  states are in the gradients' layout) or logical `[V, S]` (converted to
  and from the stored layout around the kernel: a table-sized copy, for
  callers that hold logical tables). `sorted_tokens`: the tokens ascend,
  the kept rows (in `[0, V)`) first (the dedup's buffer); then a batch
  that touches a large share of the table streams the whole table
  (`stream_update`, chosen at run time by `STREAM`).
  """
  row_state, element_state = tuple(row_state), tuple(element_state)
  scalars = tuple(jnp.asarray(s, jnp.float32) for s in scalars)
  if table.dtype == jnp.bfloat16 or (
      table.dtype == jnp.float32 and table.shape[1] % stored.LANES):
    return _logical_update(rule, table, row_state, element_state,
                           unique_tokens, grad_accum, row_sq, apply, step,
                           scalars, emb_width=emb_width, interpret=interpret,
                           sorted_tokens=sorted_tokens)
  vocab_rows, width = table.shape
  words = table.dtype == stored.WORD
  grad_width = grad_accum.shape[1]
  if grad_width not in ((width, 2 * width) if words else (width,)):
    raise ValueError(
        f"pallas_emb mosaic sparse_update: gradient sums of {grad_width} "
        f"columns for a stored {table.dtype}[{vocab_rows}, {width}] table; "
        "expected them in the stored layout (stored.to_grads).")
  (num_unique,) = unique_tokens.shape
  if num_unique == 0:
    return table, row_state, element_state
  if row_sq.shape[0] == num_unique + 1:
    row_sq = row_sq[:num_unique]
  args = (unique_tokens, grad_accum, row_sq, apply, step, scalars)
  by_rows = lambda _, state: _update_rows(
      rule, *state, *args, emb_width=emb_width, interpret=interpret)
  if (not sorted_tokens or STREAM == "never" or not stream_update.block_rows(
      width + grad_width * len(element_state))):
    return by_rows(0, (table, row_state, element_state))
  by_stream = lambda _, state: stream_update.stream_update(
      rule, *state, *args, emb_width=emb_width, interpret=interpret)
  if STREAM == "always":
    return by_stream(0, (table, row_state, element_state))
  used = jnp.sum((unique_tokens >= 0) & (unique_tokens < vocab_rows))
  row_bytes = 4 * (width + grad_width * len(element_state) + len(row_state))
  stream = stream_update.worth_streaming(
      vocab_rows, row_bytes, 1 + len(element_state), len(row_state),
      used).astype(jnp.int32)
  # Loops of zero or one trip, not a `lax.cond`: XLA updates a loop's
  # carried table in place.
  state = lax.fori_loop(0, stream, by_stream,
                        (table, row_state, element_state))
  return lax.fori_loop(0, 1 - stream, by_rows, state)


def _update_rows(rule, table, row_state, element_state, unique_tokens,
                 grad_accum, row_sq, apply, step, scalars, *, emb_width,
                 interpret):
  """The update by the row kernel: each touched row by DMA, the row-wise
  part in XLA (`_row_part`)."""
  vocab_rows = table.shape[0]
  words = table.dtype == stored.WORD
  grad_width = grad_accum.shape[1]
  num_unique = unique_tokens.shape[0]
  copies = 2 * (1 + len(element_state)) * (2 if words else 1)
  block = dma.block_rows(num_unique, 4 * grad_width, copies=copies)
  num_blocks = pl.cdiv(num_unique, block)
  size = num_blocks * block
  (row_state, dest, coeffs), extent, num_coeffs = _row_part(
      rule, vocab_rows, row_state, unique_tokens, row_sq, apply, step,
      scalars, emb_width, size)
  dest = dma.padded(dest, size, -1)
  reads = jnp.maximum(dest, 0)
  grad = dma.padded(grad_accum.astype(jnp.float32), size, 0.0)
  scalar_array = (jnp.stack(scalars) if scalars
                  else jnp.zeros((1,), jnp.float32))
  live = jnp.reshape((extent + block - 1) // block, (1,)).astype(jnp.int32)
  states = (table,) + element_state
  # Programs past the last used block keep the last block's inputs (no
  # refetch) and do nothing.
  clamp = lambda i, live: jnp.maximum(jnp.minimum(i, live[0] - 1), 0)
  smem = lambda ahead: pl.BlockSpec(
      (None, 1, block), lambda i, live: (
          jnp.maximum(jnp.minimum(i + ahead, live[0] - 1), 0), 0, 0),
      memory_space=pltpu.SMEM)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  inputs = ((dma.smem_blocks(reads, block), dma.smem_blocks(reads, block),
             dma.smem_blocks(dest, block), grad)
            + tuple(dma.smem_blocks(c, block) for c in coeffs)
            + (scalar_array,))
  outs = dma.update_in_place(
      functools.partial(_kernel, rule=rule, num_coeffs=num_coeffs,
                        coeff_inputs=len(coeffs),
                        num_scalars=len(scalars), block=block),
      pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(num_blocks,),
          in_specs=[smem(0), smem(1), smem(0),
                    pl.BlockSpec((block, grad_width),
                                 lambda i, live: (clamp(i, live), 0))]
                   + [smem(0)] * len(coeffs)
                   + [pl.BlockSpec(memory_space=pltpu.SMEM)]
                   + [any_spec] * len(states),
          out_specs=tuple(any_spec for _ in states),
          scratch_shapes=(
              [pltpu.VMEM((2, block, s.shape[1]), s.dtype) for s in states]
              + [pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)),
                 pltpu.SMEM((2,), jnp.int32),
                 pltpu.VMEM((len(coeffs), block, stored.LANES),
                            jnp.float32)])),
      live, inputs, states, interpret=interpret,
      name=rule.kernel_name + "_tpu")
  return outs[0], tuple(row_state), tuple(outs[1:])


def _logical_update(rule, table, row_state, element_state, unique_tokens,
                    grad_accum, row_sq, apply, step, scalars, *, emb_width,
                    interpret, sorted_tokens):
  """The update of a logical `[V, S]` table and its logical element-wise
  states, through their stored layouts."""
  dtype = table.dtype
  width = table.shape[1]
  new_table, row_state, new_elements = sparse_update(
      rule, stored.to_stored(table), row_state,
      tuple(stored.to_grads(e, dtype) for e in element_state),
      unique_tokens, stored.to_grads(grad_accum, dtype), row_sq, apply, step,
      scalars, emb_width=emb_width, interpret=interpret,
      sorted_tokens=sorted_tokens)
  return (stored.from_stored(new_table, width, dtype), row_state,
          tuple(stored.from_grads(e, width, dtype).astype(old.dtype)
                for e, old in zip(new_elements, element_state)))
