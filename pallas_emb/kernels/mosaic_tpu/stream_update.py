"""Mosaic TPU kernel: a sparse optimizer's update as one pass over the table.

`sparse_update`'s row kernel moves each touched row by its own DMA (about
20 ns a row each way on a v5e) and leaves the row-wise part to XLA's
gathers and scatters of `[V]` arrays (about 30 ns a row). When a batch
touches a large share of the table (16,384 bags of 20 touch 77k of 1M
rows), streaming every row through VMEM in whole blocks costs less: on a
v5e this kernel moves about 450 bytes a nanosecond (HBM peaks near 800).

Program b holds rows `[b * B, (b + 1) * B)` of the table and of
every state in VMEM (pipelined by Pallas, written back in place). The
batch's unique rows ascend (the dedup's sorted buffer), so the slots of
block b are one range, `bounds[b]` to `bounds[b + 1]`, which lies in at
most two `[B]` blocks of the slot arrays. Each of its slots puts its
gradient row at its table row's place in a dense block of gradients, and
its squared norm and the block's stamp beside it; the rule's row-wise
part then runs on lane-dense tiles, as the row-wise state comes (the
norms and stamps brought there by transposes), its column-wise part on
the whole block (the coefficients turned into columns), and the rows no
slot used keep their bits (a select).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_emb.kernels.mosaic_tpu import dma
from pallas_emb.kernels.mosaic_tpu import stored

# Table rows a program holds: a power of two from MIN_BLOCK (8 * 128, so
# that a `[V]` row-wise state, seen as `[V / 128, 128]`, comes in whole
# (8, 128) tiles) to MAX_BLOCK, the most whose 32-bit words over the table
# and element-wise states (each block double-buffered in and out) stay
# within BLOCK_WORDS. A v5e ran 1M rows of row-wise Adagrad 0.2-0.3 ms
# faster in blocks of 2048 than of 1024. Tables wider than that at
# MIN_BLOCK rows are not streamed. The slot arrays come in blocks of as
# many slots, so a table block's slots (at most its rows: the rows are
# unique) lie in two of them.
MIN_BLOCK, MAX_BLOCK = 1024, 2048
BLOCK_WORDS = 1 << 20
# The cost model that picks this kernel (`worth_streaming`), from a v5e
# (`python -m bench.tpu_update`, 1M x 64 f32): the bytes a nanosecond this
# kernel streams (table and states, read and written), and nanoseconds a
# touched slot costs this kernel (placing its gradient row), the row kernel
# per state array it moves (a DMA each way), and the row-wise part in XLA
# per row-wise state.
STREAM_BYTES_PER_NS = 450
STREAM_SLOT_NS = 6
ROW_DMA_NS = 38
ROW_PART_NS = 14


def block_rows(words_per_row: int) -> int:
  """Table rows a program holds, 0 if too wide to stream (above)."""
  rows = MAX_BLOCK
  while rows > MIN_BLOCK and rows * words_per_row > BLOCK_WORDS:
    rows //= 2
  return rows if rows * words_per_row <= BLOCK_WORDS else 0


def worth_streaming(vocab_rows: int, row_bytes: int, num_arrays: int,
                    num_row_states: int, used_slots: jax.Array) -> jax.Array:
  """Whether streaming a table of `vocab_rows` rows (`row_bytes` bytes a
  row over the table and every state) beats moving `used_slots` rows of
  `num_arrays` arrays one by one (traced bool)."""
  used = used_slots.astype(jnp.float32)
  stream_ns = (2 * vocab_rows * row_bytes / STREAM_BYTES_PER_NS
               + STREAM_SLOT_NS * used)
  rows_ns = (ROW_DMA_NS * num_arrays + ROW_PART_NS * num_row_states) * used
  return stream_ns < rows_ns


def _lanes_to_column(x: jax.Array) -> jax.Array:
  """`[n, 128]` (n <= 128) to `[n * 128, 1]`: row r is `x[r // 128, r % 128]`
  (a transpose of one 128 x 128 tile; 32-bit values)."""
  n = x.shape[0]
  square = jnp.concatenate(
      [x, jnp.zeros((stored.LANES - n, stored.LANES), x.dtype)], axis=0)
  t = square.T  # t[l, a] = x[a, l]
  return jnp.concatenate([t[:, a:a + 1] for a in range(n)], axis=0)


def _aux_to_lanes(aux, num_lanes: int) -> list[jax.Array]:
  """The first `num_lanes` lanes of `aux` `[n * 128, 128]` f32, each as
  lane-dense `[n, 128]` (row r at `[r // 128, r % 128]`): transposes of
  its 128 x 128 tiles."""
  lanes = stored.LANES
  n = aux.shape[0] // lanes
  sublane = lax.broadcasted_iota(jnp.int32, (n, lanes), 0)
  out = [jnp.zeros((n, lanes), jnp.float32) for _ in range(num_lanes)]
  for a in range(n):
    t = aux[a * lanes:(a + 1) * lanes, :].T  # t[l, r] = aux[a * 128 + r, l]
    out = [jnp.where(sublane == a, t[l:l + 1, :], o)
           for l, o in enumerate(out)]
  return out


def _kernel(bounds_ref,  # scalar prefetch: [num_blocks + 1] slot bounds
            tokens0_ref, tokens1_ref, sq0_ref, sq1_ref,  # SMEM [1, block]
            grad0_ref, grad1_ref,  # VMEM [block, G]
            flags_ref,  # SMEM [2]: apply, step
            scalars_ref,  # SMEM [k]
            *refs, rule, num_scalars, emb_width, block):
  num_rows = len(rule.row_slots)
  num_elements = len(rule.element_slots)
  table_ref = refs[0]
  row_refs = refs[1:1 + num_rows]  # [block / 128, 128] each
  element_refs = refs[1 + num_rows:1 + num_rows + num_elements]
  outs = refs[1 + num_rows + num_elements:2 * (1 + num_rows + num_elements)]
  dense, aux = refs[2 * (1 + num_rows + num_elements):]
  b = pl.program_id(0)
  base = b * block
  first, end = bounds_ref[b], bounds_ref[b + 1]
  # The first slot of tokens0/grad0 (`lax.div`: Mosaic lowers `//` by way
  # of a sign, which needs the chip's generation).
  block0 = lax.div(first, block) * block
  mid = jnp.minimum(end, block0 + block)
  # A row of aux is this block's where lane 1 holds its stamp, b + 1: no
  # zero-fill per block (rows no slot placed hold an older stamp, and their
  # rows of `dense` stale sums, which the selects below leave unused).
  stamp = (b + 1).astype(jnp.float32)

  @pl.when(b == 0)
  def _():
    aux[...] = jnp.zeros(aux.shape, aux.dtype)

  lane = lax.broadcasted_iota(jnp.int32, (1, aux.shape[1]), 1)

  def place(tokens_ref, sq_ref, grad_ref, start):
    def body(j, carry):
      k = j - start
      r = tokens_ref[0, k] - base
      dense[pl.ds(r, 1), :] = grad_ref[pl.ds(k, 1), :]
      # Lane 0: the row's squared norm; lane 1: the stamp.
      aux[pl.ds(r, 1), :] = jnp.where(lane == 0, sq_ref[0, k], stamp)
      return carry
    return body

  lax.fori_loop(first, mid, place(tokens0_ref, sq0_ref, grad0_ref, block0),
                0)
  lax.fori_loop(mid, end, place(tokens1_ref, sq1_ref, grad1_ref,
                                block0 + block), 0)

  apply, step = flags_ref[0] != 0, flags_ref[1]
  scalars = tuple(scalars_ref[j] for j in range(num_scalars))
  # The row-wise part on lane-dense `[block / 128, 128]` tiles, as the
  # row-wise state comes: a `[block, 1]` column takes a vreg per 8 rows,
  # so every op on one costs as much as on a whole `[block, 128]` tile (on
  # a v5e, columns took the 1M-row pooled step 0.24 ms longer). Only the
  # coefficients and the mask become columns, for the table's tiles.
  row_sq, stamps = _aux_to_lanes(aux, 2)
  ok = (stamps == stamp) & apply
  if not rule.updates_zero_rows:
    ok = ok & (row_sq > 0)
  old_rows = {name: ref[...] for name, ref in zip(rule.row_slots, row_refs)}
  new_rows, coeffs = rule.row_update(old_rows, row_sq, step, scalars,
                                     emb_width)
  for name, ref, out in zip(rule.row_slots, row_refs, outs[1:1 + num_rows]):
    out[...] = jnp.where(ok, new_rows[name].astype(ref.dtype), old_rows[name])
  coeffs = tuple(_lanes_to_column(c.astype(jnp.float32)) for c in coeffs)
  ok = _lanes_to_column(ok.astype(jnp.float32)) != 0

  old = table_ref[...]
  old_elements = {n: r[...] for n, r in zip(rule.element_slots,
                                              element_refs)}
  new_values, new_elements = stored.rule_on_tiles(
      rule, tuple(c.astype(jnp.float32) for c in coeffs), old, dense[...],
      old_elements, scalars, pltpu.roll)
  outs[0][...] = jnp.where(ok, new_values.astype(old.dtype), old)
  for name, out in zip(rule.element_slots, outs[1 + num_rows:]):
    out[...] = jnp.where(ok, new_elements[name].astype(out.dtype),
                         old_elements[name])


def stream_update(rule, table: jax.Array, row_state: Sequence[jax.Array],
                  element_state: Sequence[jax.Array],
                  unique_tokens: jax.Array, grad_accum: jax.Array,
                  row_sq: jax.Array, apply, step, scalars: Sequence[Any], *,
                  emb_width: int | None = None, interpret: bool = False):
  """`sparse_update.sparse_update` on a stored table (and its states in the
  gradients' layout) whose `unique_tokens` ascend, the kept rows in
  `[0, V)` first (the dedup's buffer; rows at or past V and fill values
  after them are skipped): `(table, row_state, element_state)`, in place.
  """
  vocab_rows, width = table.shape
  grad_width = grad_accum.shape[1]
  num_slots = unique_tokens.shape[0]
  block = block_rows(width + grad_width * len(element_state))
  if not block:
    raise ValueError(
        f"pallas_emb stream_update: a {table.dtype}[{vocab_rows}, {width}] "
        f"table with {len(element_state)} element-wise states of "
        f"{grad_width} columns is too wide to stream (block_rows); update "
        "it by rows (sparse_update.STREAM = 'never').")
  num_blocks = pl.cdiv(vocab_rows, block)
  size = pl.cdiv(num_slots, block) * block
  last = size // block - 1
  tokens = dma.padded(unique_tokens.astype(jnp.int32), size,
                      jnp.iinfo(jnp.int32).max)
  bounds = jnp.searchsorted(
      tokens, jnp.minimum(jnp.arange(num_blocks + 1) * block, vocab_rows),
      side="left").astype(jnp.int32)
  sq = dma.padded(row_sq[:num_slots].astype(jnp.float32), size, 0.0)
  grad = dma.padded(grad_accum.astype(jnp.float32), size, 0.0)
  flags = jnp.stack([jnp.asarray(apply, jnp.int32),
                     jnp.asarray(step, jnp.int32)])
  scalars = tuple(jnp.asarray(s, jnp.float32) for s in scalars)
  scalar_array = (jnp.stack(scalars) if scalars
                  else jnp.zeros((1,), jnp.float32))
  # Whole blocks (a copy of a few bytes a row unless V is a multiple of
  # the block).
  rows_2d = tuple(dma.padded(a, num_blocks * block, 0).reshape(
      -1, stored.LANES) for a in row_state)

  def slot_block(ahead):
    return lambda b, bounds: (
        jnp.minimum(lax.div(bounds[b], block) + ahead, last), 0, 0)

  def grad_block(ahead):
    return lambda b, bounds: (
        jnp.minimum(lax.div(bounds[b], block) + ahead, last), 0)

  smem_slots = lambda ahead: pl.BlockSpec((None, 1, block), slot_block(ahead),
                                          memory_space=pltpu.SMEM)
  whole_smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  table_spec = pl.BlockSpec((block, width), lambda b, bounds: (b, 0))
  row_spec = pl.BlockSpec((block // stored.LANES, stored.LANES),
                          lambda b, bounds: (b, 0))
  element_spec = pl.BlockSpec((block, grad_width), lambda b, bounds: (b, 0))
  states = (table,) + rows_2d + tuple(element_state)
  state_specs = ([table_spec] + [row_spec] * len(rows_2d)
                 + [element_spec] * len(element_state))
  if interpret:  # Pallas' TPU interpreter mis-shapes a partial last block
    states = tuple(
        dma.padded(s, pl.cdiv(s.shape[0], spec.block_shape[0])
                   * spec.block_shape[0], 0)
        for s, spec in zip(states, state_specs))
  inputs = (dma.smem_blocks(tokens, block), dma.smem_blocks(tokens, block),
            dma.smem_blocks(sq, block), dma.smem_blocks(sq, block),
            grad, grad, flags, scalar_array)
  outs = dma.update_in_place(
      functools.partial(_kernel, rule=rule, num_scalars=len(scalars),
                        emb_width=emb_width, block=block),
      pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(num_blocks,),
          in_specs=[smem_slots(0), smem_slots(1), smem_slots(0),
                    smem_slots(1),
                    pl.BlockSpec((block, grad_width), grad_block(0)),
                    pl.BlockSpec((block, grad_width), grad_block(1)),
                    whole_smem, whole_smem] + state_specs,
          out_specs=tuple(state_specs),
          scratch_shapes=[pltpu.VMEM((block, grad_width), jnp.float32),
                          pltpu.VMEM((block, stored.LANES), jnp.float32)]),
      bounds, inputs, states, interpret=interpret,
      name=rule.kernel_name + "_stream_tpu")
  # The slices past V undo the padding (none on the chip).
  rows_end = 1 + len(row_state)
  return (outs[0][:vocab_rows],
          tuple(o.reshape(-1)[:vocab_rows] for o in outs[1:rows_end]),
          tuple(o[:vocab_rows] for o in outs[rows_end:]))
