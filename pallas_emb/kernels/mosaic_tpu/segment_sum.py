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

That windowed form walks every entry once per pass, and the passes grow
with the batch's distinct rows (a v5e took 10.8 ms for 327,680 entries of
77k distinct rows in two live passes of seven). When the gradient rows fit
in VMEM (`SORTED_ROWS_BYTES`), `grad_sums` runs the sorted form instead:
the entries are sorted by slot (stable: entry order within a slot, so the
same sums bit for bit), the rows are copied into VMEM once, and one walk
over the sorted entries adds each into a ring of slot rows in VMEM (the
slot's running sum kept in a register, stored after every add). The
slots a block of sorted entries touches are consecutive (a dedup's slots
are a prefix), so every slot below the next block's first is complete:
its rows leave the ring by 8-row DMAs while the next block is summed, and
are zeroed for reuse once written.
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
# Gradient rows up to this many bytes are summed by the sorted form: they
# sit in VMEM beside the ring (at most 2 MiB), within `dma.VMEM_LIMIT`.
# 48 MiB holds the 67,584 rows of a 128-lane HSTU batch on ML-1M.
SORTED_ROWS_BYTES = 48 << 20


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


def fits_sorted(num_rows: int, width: int) -> bool:
  """Whether `[num_rows, width]` f32 gradient rows fit the sorted form."""
  return num_rows * width * 4 <= SORTED_ROWS_BYTES


def grad_sums(rows: jax.Array, entry_rows: np.ndarray, slots: jax.Array,
              weights: jax.Array, num_slots: int, live_slots: jax.Array, *,
              method: str | None = None, slot_sorted: bool = False,
              interpret: bool = False) -> jax.Array:
  """f32 `[num_slots, G]`: per slot, `sum_e weights[e] * rows[entry_rows[e]]`
  over the entries e whose `slots[e]` is that slot, in entry order.

  Args:
    rows: f32 `[T, G]` gradient rows (G a multiple of 128).
    entry_rows: int32 `[N]` (static) the row of each entry, never
      decreasing, each at most one more than the one before.
    slots: int32 `[N]` each entry's slot; outside `[0, num_slots)`: none.
      The slots taken are `[0, live_slots)`, each by some entry (a dedup's
      prefix; the sorted form relies on it).
    weights: f32 `[N]` each entry's factor.
    num_slots: the sum buffer's slots U.
    live_slots: int32 scalar; slots at and past it get no entry: zeros in
      the windowed form, left unwritten (undefined) by the sorted one
      (a 160 MiB zero fill of 327,680 slots saved; readers stop at it).
    method: "sorted" or "windowed" (see the module doc); None: sorted when
      the rows fit `SORTED_ROWS_BYTES`.
    slot_sorted: the entries come in slot order, each slot's in entry
      order, as the dedup's sort leaves them (`dedup.unique_and_segments`'
      `sort_along`); entries of no slot may sit between two slots' runs
      (never inside one), and `entry_rows` may be traced. The sorted form
      then skips its sort (the rows must fit it).
  """
  num_rows, width = rows.shape
  (num_entries,) = entry_rows.shape
  if num_entries == 0 or num_slots == 0:
    return jnp.zeros((num_slots, width), jnp.float32)
  # Entries per block (a multiple of the SMEM row), and the blocks.
  entries = ENTRY_BLOCK if num_entries > ENTRY_BLOCK else (
      -(-num_entries // dma.ROW_ALIGN) * dma.ROW_ALIGN)
  blocks = (entries, pl.cdiv(num_entries, entries))
  if method is None:
    method = "sorted" if fits_sorted(num_rows, width) else "windowed"
  if slot_sorted:
    if method != "sorted" or not fits_sorted(num_rows, width):
      raise ValueError(
          f"pallas_emb grad_sums: entries in slot order need the sorted "
          f"form, whose rows must fit {SORTED_ROWS_BYTES} bytes; got method "
          f"{method!r} and {num_rows} rows of {width} lanes.")
    return _walk_sorted(rows, slots, entry_rows, weights, num_slots,
                        live_slots, blocks, interpret)
  form = _sorted_grad_sums if method == "sorted" else _windowed_grad_sums
  return form(rows, entry_rows, slots, weights, num_slots, live_slots,
              blocks, interpret)


def _windowed_grad_sums(rows, entry_rows, slots, weights, num_slots,
                        live_slots, blocks, interpret):
  num_rows, width = rows.shape
  (num_entries,) = entry_rows.shape
  entries, num_blocks = blocks
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


def _ring_rows(entries: int) -> int:
  """Rows of the sorted form's ring: a power of two holding the slots of
  two blocks of entries and a partial 8-row chunk on each side."""
  rows = 8
  while rows < 2 * entries + 16:
    rows *= 2
  return rows


def _sorted_kernel(firsts_ref, live_ref,  # scalar prefetch: [B + 1], [1]
                   slots_ref, entry_rows_ref, weights_ref,  # SMEM [1, E]
                   rows_hbm,  # [T, G] f32
                   out_hbm,  # [U, G] f32, HBM (rows past the live: unwritten)
                   rows, ring, marks, rows_sem, write_sem, *, entries,
                   ring_rows, num_slots):
  j, num_blocks = pl.program_id(0), pl.num_programs(0)
  mask = ring_rows - 1
  chunk = lambda c: pltpu.make_async_copy(
      ring.at[pl.ds(pl.multiple_of(c & mask, 8), 8)],
      out_hbm.at[pl.ds(pl.multiple_of(c, 8), 8)], write_sem.at[0])

  @pl.when(j == 0)
  def _():
    copy = pltpu.make_async_copy(rows_hbm, rows, rows_sem.at[0])
    copy.start()
    ring[...] = jnp.zeros(ring.shape, ring.dtype)
    marks[0] = 0  # slots below it are written or being written
    marks[1] = 0  # slots from it up to marks[0] are being written
    copy.wait()

  # The running sum of the current slot stays in a register and is stored
  # (never re-read) after each add: a slot's adds come one after another
  # in the sorted walk, so no add waits for the store before it. The sum
  # restarts from zero when the slot changes (0 + x is x, so the same
  # bits as adding into a zeroed row); the block's first slot may have
  # begun in the block before, so the walk starts from its ring row.
  at_of = lambda slot: jnp.where(slot < num_slots, slot & mask, ring_rows)
  first_slot = slots_ref[0, 0]

  def body(k, carry):
    prev, total = carry
    for u in range(dma.UNROLL):
      e = k * dma.UNROLL + u
      slot = slots_ref[0, e]
      # Entries that take no slot (sorted last, or between two slots'
      # runs) add into the trash row.
      value = rows[pl.ds(entry_rows_ref[0, e], 1), :]
      product = weights_ref[0, e] * value
      # Rounded on its own (never contracted into the add), as
      # `common.unfused_product`.
      product = jnp.where(jnp.isnan(product), jnp.float32(jnp.nan), product)
      total = jnp.where(slot == prev, total, 0.0) + product
      ring[pl.ds(at_of(slot), 1), :] = total
      prev = slot
    return prev, total
  lax.fori_loop(0, entries // dma.UNROLL, body,
                (first_slot, ring[pl.ds(at_of(first_slot), 1), :]))

  # Once all of the previous block's writes have landed (a semaphore
  # counts bytes, not copies), their ring rows are zeroed for reuse.
  written, writing = marks[0], marks[1]
  # (Shifts and masks: a traced `//` lowers through `sign`.)
  pending = (written - writing) >> 3
  lax.fori_loop(0, pending, lambda i, c: (chunk(writing).wait(), c)[1], 0)

  def zero(i, carry):
    at = pl.multiple_of((writing + 8 * i) & mask, 8)
    ring[pl.ds(at, 8), :] = jnp.zeros((8, ring.shape[1]), ring.dtype)
    return carry
  lax.fori_loop(0, pending, zero, 0)

  # Every slot below the next block's first is complete, and every slot
  # at or past the live ones is zero: write the whole 8-row chunks.
  live = live_ref[0]
  last = j == num_blocks - 1
  whole = lambda n: n & -8  # n rounded down to whole chunks
  upto = jnp.where(last, whole(live + 7),
                   whole(jnp.minimum(firsts_ref[j + 1], live)))
  upto = jnp.maximum(jnp.minimum(upto, num_slots // 8 * 8), written)

  def start(i, carry):
    chunk(written + 8 * i).start()
    return carry
  lax.fori_loop(0, (upto - written) >> 3, start, 0)
  marks[0], marks[1] = upto, written

  @pl.when(last)
  def _():
    lax.fori_loop(0, (upto - written) >> 3,
                  lambda i, c: (chunk(written + 8 * i).wait(), c)[1], 0)
    # A buffer of U slots, U not a multiple of 8, ends in single rows.
    for r in range(num_slots // 8 * 8, num_slots):
      @pl.when(r < live)
      def _(r=r):
        copy = pltpu.make_async_copy(ring.at[pl.ds(r & mask, 1)],
                                     out_hbm.at[pl.ds(r, 1)], write_sem.at[1])
        copy.start()
        copy.wait()


def _sorted_grad_sums(rows, entry_rows, slots, weights, num_slots,
                      live_slots, blocks, interpret):
  """`grad_sums` by one walk over the entries sorted by slot (the module
  doc); the rows `[T, G]` sit in VMEM."""
  slots = slots.astype(jnp.int32)
  keys = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)
  # Stable: within a slot the entries keep their order.
  keys, sorted_rows, sorted_weights = lax.sort(
      (keys, jnp.asarray(entry_rows, jnp.int32), weights.astype(jnp.float32)),
      num_keys=1, is_stable=True)
  return _walk_sorted(rows, keys, sorted_rows, sorted_weights, num_slots,
                      live_slots, blocks, interpret)


def _walk_sorted(rows, slots, entry_rows, weights, num_slots, live_slots,
                 blocks, interpret):
  """The sorted form's walk over entries already in slot order."""
  num_rows, width = rows.shape
  entries, num_blocks = blocks
  size = num_blocks * entries
  slots = slots.astype(jnp.int32)
  keys = dma.padded(
      jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots),
      size, num_slots)
  # The first slot of each block and of every block after it (the entries
  # of no slot, `num_slots`, may sit between the slots' runs).
  firsts = jnp.concatenate([
      lax.cummin(keys.reshape(num_blocks, entries).min(axis=1), reverse=True),
      jnp.full((1,), num_slots, jnp.int32)])
  ring_rows = _ring_rows(entries)
  smem = pl.BlockSpec((None, 1, entries), lambda j, *_: (j, 0, 0),
                      memory_space=pltpu.SMEM)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_sorted_kernel, entries=entries, ring_rows=ring_rows,
                        num_slots=num_slots),
      out_shape=jax.ShapeDtypeStruct((num_slots, width), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(num_blocks,),
          in_specs=[smem, smem, smem, any_spec],
          out_specs=any_spec,
          scratch_shapes=[pltpu.VMEM((num_rows, width), jnp.float32),
                          # The ring, then a trash row (a whole tile).
                          pltpu.VMEM((ring_rows + 8, width), jnp.float32),
                          pltpu.SMEM((2,), jnp.int32),
                          pltpu.SemaphoreType.DMA((1,)),
                          pltpu.SemaphoreType.DMA((2,))]),
      compiler_params=dma.compiler_params("arbitrary"),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_sorted_grad_sums_tpu",
  )(firsts, jnp.reshape(live_slots, (1,)).astype(jnp.int32),
    dma.smem_blocks(keys, entries),
    dma.smem_blocks(dma.padded(entry_rows.astype(jnp.int32), size, 0),
                    entries),
    dma.smem_blocks(dma.padded(weights.astype(jnp.float32), size, 0.0),
                    entries),
    rows.astype(jnp.float32))
