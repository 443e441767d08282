"""Pallas (Triton) kernel: deterministic f32 segment sums of gradient rows.

`grads[N, S]` rows are summed per segment id into `grad_accum[U, S]` (f32),
together with `row_sq[u] = sum_c round(grad_accum[u, c])**2` and its total.

Strategy: no atomics. A scatter-add with atomics is non-deterministic on GPU,
degrades badly when many rows hit one (hot, Zipf) segment, and in interpret
mode a scatter with duplicate indices loses updates. Instead the XLA wrapper
stable-sorts the rows by segment id (dropped ids are keyed `U`, so they sort
last and are never read) and finds each segment's run `[start, end)` in the
sorted order. Each program then owns `block_segments` consecutive segments
and, for each one, loops over its run in chunks of `chunk_rows` sorted rows:
a masked indirect load of a `[chunk_rows, next_pow2(S)]` tile, added into a
tile-shaped f32 accumulator, reduced over rows once at the end. The order of
every addition is fixed, so the result is deterministic, and a segment with
thousands of rows is just a longer loop.

Like `gather.py`, grads and outputs are addressed through flat views, so any
shard width works (power-of-two column tiles, masked past the width), and
masked lanes get out-of-range positive offsets.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common


@dataclasses.dataclass(frozen=True)
class SegmentSumConfig:
  """Tile sizes of the segment-sum kernel (powers of two).

  `chunk_rows` is capped so that a `[chunk_rows, next_pow2(S)]` f32 tile has
  at most `max_tile_elements` elements: wide shards get shorter chunks rather
  than spilling registers.
  """
  block_segments: int = 8
  chunk_rows: int = 16
  max_tile_elements: int = 4096
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_segments", "chunk_rows", "max_tile_elements"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"SegmentSumConfig.{name} must be a positive power "
                         f"of two, got {value}.")

  def rows_per_chunk(self, block_cols: int) -> int:
    return max(1, min(self.chunk_rows, self.max_tile_elements // block_cols))


def _segment_sum_kernel(starts_ref, order_ref, grads_ref, accum_ref,
                        row_sq_ref, *, num_rows, num_segments, width,
                        round_dtype, block_segments, chunk_rows, block_cols):
  cols = jnp.arange(block_cols)
  col_ok = cols < width
  first = pl.program_id(0) * block_segments
  lanes = jnp.arange(block_segments)

  def one_segment(j, row_sq):
    u = first + j
    # `starts` is padded past U with the end of the valid rows, so these two
    # loads are in range and the padded segments are empty.
    start = starts_ref[u]
    end = starts_ref[u + 1]

    def one_chunk(k, acc):
      pos = start + k * chunk_rows + jnp.arange(chunk_rows)
      ok = pos < end
      src = plgpu.load(order_ref.at[jnp.where(ok, pos, num_rows)],
                       mask=ok, other=0)
      tile_ok = ok[:, None] & col_ok[None, :]
      offsets = jnp.where(tile_ok, src[:, None] * width + cols[None, :],
                          num_rows * width)
      rows = plgpu.load(grads_ref.at[offsets], mask=tile_ok, other=0)
      return acc + rows.astype(jnp.float32)

    num_chunks = (end - start + chunk_rows - 1) // chunk_rows
    acc = lax.fori_loop(0, num_chunks, one_chunk,
                        jnp.zeros((chunk_rows, block_cols), jnp.float32))
    total = jnp.sum(acc, axis=0)
    seg_ok = u < num_segments
    out_ok = seg_ok & col_ok
    plgpu.store(
        accum_ref.at[jnp.where(out_ok, u * width + cols,
                               num_segments * width)],
        total, mask=out_ok)
    sq = jnp.sum(jnp.square(common.round_to(total, round_dtype)))
    return jnp.where(lanes == j, sq, row_sq)

  row_sq = lax.fori_loop(0, block_segments, one_segment,
                         jnp.zeros((block_segments,), jnp.float32))
  segs = first + lanes
  ok = segs < num_segments
  plgpu.store(row_sq_ref.at[jnp.where(ok, segs, num_segments)], row_sq,
              mask=ok)


def sort_segments(segment_ids: jax.Array, num_segments: int,
                  padded_segments: int) -> tuple[jax.Array, jax.Array]:
  """Stable sort order of the rows and the run starts of every segment.

  Returns `order[N]` (row indices, valid segments first, by segment id, ties
  in row order) and `starts[padded_segments + 1]` where segment u's rows are
  `order[starts[u]:starts[u + 1]]`; entries past U all equal the number of
  valid rows, so padded segments are empty.
  """
  valid = (segment_ids >= 0) & (segment_ids < num_segments)
  keys = jnp.where(valid, segment_ids, num_segments)
  order = jnp.argsort(keys, stable=True).astype(jnp.int32)
  queries = jnp.minimum(jnp.arange(padded_segments + 1, dtype=jnp.int32),
                        num_segments)
  starts = jnp.searchsorted(keys[order], queries, side="left")
  return order, starts.astype(jnp.int32)


def segment_sum_rows(grads: jax.Array, segment_ids: jax.Array,
                     num_segments: int, *, round_dtype, interpret: bool = False,
                     config: SegmentSumConfig = SegmentSumConfig()
                     ) -> tuple[jax.Array, jax.Array]:
  """f32 `[U, S]` per-segment sums of `[N, S]` rows and `[U + 1]` `row_sq`.

  Segment ids outside `[0, U)` (including -1) are dropped. `row_sq[u]` is
  `sum_c round_to(grad_accum[u, c], round_dtype)**2`; `row_sq[U]` the total.
  """
  chex.assert_rank(grads, 2)
  chex.assert_type(segment_ids, jnp.int32)
  chex.assert_shape(segment_ids, (grads.shape[0],))
  if grads.dtype not in (jnp.float32, jnp.bfloat16):
    raise TypeError(f"pallas_emb segment_sum_rows expects f32 or bf16 "
                    f"gradients, got {grads.dtype}.")
  num_rows, width = grads.shape
  if num_segments < 1:
    raise ValueError(f"pallas_emb segment_sum_rows needs num_segments >= 1, "
                     f"got {num_segments}.")
  common.check_flat_size(grads, "gradient block")
  common.check_flat_size(
      jax.ShapeDtypeStruct((num_segments, width), jnp.float32), "grad_accum")

  block_cols = pl.next_power_of_2(width)
  num_blocks = pl.cdiv(num_segments, config.block_segments)
  order, starts = sort_segments(segment_ids, num_segments,
                                num_blocks * config.block_segments)
  kernel = functools.partial(
      _segment_sum_kernel, num_rows=num_rows, num_segments=num_segments,
      width=width, round_dtype=jnp.dtype(round_dtype),
      block_segments=config.block_segments,
      chunk_rows=config.rows_per_chunk(block_cols), block_cols=block_cols)
  accum, row_sq = pl.pallas_call(
      kernel,
      out_shape=(
          jax.ShapeDtypeStruct((num_segments * width,), jnp.float32),
          jax.ShapeDtypeStruct((num_segments,), jnp.float32),
      ),
      grid=(num_blocks,),
      interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      name="pallas_emb_segment_sum",
  )(starts, order, grads.reshape(-1))
  row_sq = jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])
  return accum.reshape(num_segments, width), row_sq
