"""Mosaic TPU kernel: a batch's gradient sums per unique row.

`grad_sums` adds, for every entry e of the communicator (in entry order),
`weights[e] * rows[entry_rows[e]]` into slot `slots[e]` of an f32 sum
buffer: a sequence id's gradient row (weight 1) or a pooled bag's gradient
scaled by the entry's combiner weight. A bag's gradient thus reaches its
entries' slots without a per-entry gradient row (`[entries, S]`), and each
slot meets its adds in entry order, each product rounded on its own: the
sums of `reference.segment_sum_rows` over the per-entry rows, bit for bit.

XLA's scatter-add on a TPU serializes its rows (about 20 ns each on a
v5e); here every add is a read-modify-write of one row of a sum buffer in
VMEM (about 4 ns). The buffer holds `C` slots of the `U` slots; the grid
makes passes over the entries, pass p adding the entries of slots
`[p C, (p + 1) C)` and writing its C sums out; passes past the batch's
distinct rows only write zeros. The rows an entry reads are streamed: the
entries' rows never decrease (a rank's sequence rows, then its bags), so
a block of E entries reads a window of at most E consecutive rows, which
is DMA'd into VMEM while the block before it is summed.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

from pallas_emb.kernels.mosaic_tpu import dma

# Entries per block (the window of rows a block may read).
ENTRY_BLOCK = 512
# Bytes of the VMEM sum buffer (the slots of one pass).
SUMS_BYTES = 24 << 20


def pass_slots(num_slots: int, width: int) -> int:
  """Slots one pass sums (a multiple of 8, at most `num_slots` rounded)."""
  fits = max(8, SUMS_BYTES // (4 * width) // 8 * 8)
  return min(fits, -(-num_slots // 8) * 8)


def _kernel(starts_ref, live_ref,  # scalar prefetch: [blocks], [1]
            entry_rows_ref, slots_ref, weights_ref,  # SMEM [1, E] blocks
            rows_hbm,  # [T + window, G] f32, HBM
            out_hbm,  # [passes * C, G] f32, HBM
            sums, window, sem, out_sem, *, window_rows, entries,
            slots_per_pass):
  p, j = pl.program_id(0), pl.program_id(1)
  num_blocks = pl.num_programs(1)
  step = p * num_blocks + j
  last_step = pl.num_programs(0) * num_blocks - 1
  slot = step % 2

  def window_copy(block, into):
    return pltpu.make_async_copy(
        rows_hbm.at[pl.ds(pl.multiple_of(starts_ref[block], 8),
                          window_rows)], window.at[into],
        sem.at[into])

  @pl.when(step == 0)
  def _():
    window_copy(0, 0).start()

  @pl.when(step < last_step)
  def _():
    window_copy((j + 1) % num_blocks, 1 - slot).start()

  window_copy(j, slot).wait()

  @pl.when(j == 0)
  def _():
    sums[...] = jnp.zeros(sums.shape, sums.dtype)

  first = p * slots_per_pass
  here = window.at[slot]
  start = starts_ref[j]

  @pl.when(first < live_ref[0])
  def _():
    def body(k, carry):
      for u in range(dma.UNROLL):
        e = k * dma.UNROLL + u
        at = slots_ref[0, e] - first

        @pl.when((at >= 0) & (at < slots_per_pass))
        def _():
          value = here[pl.ds(entry_rows_ref[0, e] - start, 1), :]
          product = weights_ref[0, e] * value
          # Rounded on its own (never contracted into the add), as
          # `common.unfused_product`.
          product = jnp.where(jnp.isnan(product), jnp.float32(jnp.nan),
                              product)
          sums[pl.ds(at, 1), :] += product
      return carry
    lax.fori_loop(0, entries // dma.UNROLL, body, 0)

  @pl.when(j == num_blocks - 1)
  def _():
    copy = pltpu.make_async_copy(
        sums, out_hbm.at[pl.ds(first, slots_per_pass)], out_sem.at[0])
    copy.start()
    copy.wait()


def grad_sums(rows: jax.Array, entry_rows: np.ndarray, slots: jax.Array,
              weights: jax.Array, num_slots: int, live_slots: jax.Array, *,
              interpret: bool = False) -> jax.Array:
  """f32 `[num_slots, G]`: per slot, `sum_e weights[e] * rows[entry_rows[e]]`
  over the entries e whose `slots[e]` is that slot, in entry order.

  Args:
    rows: f32 `[T, G]` gradient rows (G a multiple of 128).
    entry_rows: int32 `[N]` (static) the row of each entry, never
      decreasing, each at most one more than the one before.
    slots: int32 `[N]` each entry's slot; outside `[0, num_slots)`: none.
    weights: f32 `[N]` each entry's factor.
    num_slots: the sum buffer's slots U.
    live_slots: int32 scalar; slots at and past it get no entry (their
      passes only write zeros).
  """
  num_rows, width = rows.shape
  (num_entries,) = entry_rows.shape
  if num_entries == 0 or num_slots == 0:
    return jnp.zeros((num_slots, width), jnp.float32)
  entries = ENTRY_BLOCK if num_entries > ENTRY_BLOCK else (
      -(-num_entries // dma.ROW_ALIGN) * dma.ROW_ALIGN)
  num_blocks = pl.cdiv(num_entries, entries)
  size = num_blocks * entries
  entry_rows = np.asarray(entry_rows, np.int32)
  # Padding entries take no slot; they read the last row of their block.
  entry_rows = np.concatenate(
      [entry_rows, np.full(size - num_entries, entry_rows[-1], np.int32)])
  # Each block's window starts at its first row, rounded down to a whole
  # (8, 128) tile of the rows.
  starts = entry_rows[::entries] // 8 * 8
  span = entry_rows.reshape(num_blocks, entries).max(axis=1) - starts
  window_rows = entries + 8
  if span.max() >= window_rows:
    raise ValueError("pallas_emb grad_sums: a block of entries reads more "
                     f"rows ({span.max() + 1}) than its window "
                     f"({window_rows}).")
  slots = dma.padded(slots.astype(jnp.int32), size, -1)
  weights = dma.padded(weights.astype(jnp.float32), size, 0.0)
  # The windows may read past the last row.
  rows = dma.padded(rows.astype(jnp.float32), num_rows + window_rows, 0.0)
  per_pass = pass_slots(num_slots, width)
  passes = pl.cdiv(num_slots, per_pass)
  smem = pl.BlockSpec((None, 1, entries), lambda p, j, *_: (j, 0, 0),
                      memory_space=pltpu.SMEM)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      functools.partial(_kernel, window_rows=window_rows,
                        entries=entries, slots_per_pass=per_pass),
      out_shape=jax.ShapeDtypeStruct((passes * per_pass, width), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(passes, num_blocks),
          in_specs=[smem, smem, smem, any_spec],
          out_specs=any_spec,
          scratch_shapes=[pltpu.VMEM((per_pass, width), jnp.float32),
                          pltpu.VMEM((2, window_rows, width), jnp.float32),
                          pltpu.SemaphoreType.DMA((2,)),
                          pltpu.SemaphoreType.DMA((1,))]),
      compiler_params=dma.compiler_params("arbitrary", "arbitrary"),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_grad_sums_tpu",
  )(jnp.asarray(starts), jnp.reshape(live_slots, (1,)).astype(jnp.int32),
    dma.smem_blocks(jnp.asarray(entry_rows), entries),
    dma.smem_blocks(slots, entries), dma.smem_blocks(weights, entries), rows)
  return out[:num_slots]
