"""Pallas (Triton) kernels: deterministic f32 segment sums of gradient rows.

`grads[N, S]` rows are summed per segment id into `grad_accum[U, S]` (f32),
together with `row_sq[u] = sum_c round(grad_accum[u, c])**2` and its total.

No atomics: a scatter-add with atomics is non-deterministic on GPU, degrades
badly when many rows hit one (hot, Zipf) segment, and in interpret mode a
scatter with duplicate indices loses updates. Instead:

1. The XLA wrapper sorts the rows by segment id (one stable key/index sort;
   dropped ids are keyed `U` and sort last, never read) and finds each
   segment's run `[start, end)` of sorted positions with two scatters (each
   segment is written once: no contention, no O(log N) search).
2. Pieces (`pallas_emb_segment_sum_pieces`): the sorted positions are cut
   into pieces of `piece_rows`; piece `c` sums the rows of the run that
   covers its first position, from there to the end of the piece or of the
   run. A hot segment of 25,000 rows is thus summed by ~25,000 / piece_rows
   programs in parallel.
3. Segments (`pallas_emb_segment_sum`): a program owns `block_segments`
   segments, one per tile row, and walks their heads (the rows before the
   first piece boundary, `< piece_rows` of them) one row per segment per
   step -- most segments have 1-3 rows, so a step loads a full tile -- then
   adds, for the few segments that cover whole pieces, those pieces' sums in
   piece order.

Every sum is taken in a fixed order (head rows in sorted order, then pieces
in order), so the result is deterministic; a segment with one row is copied
exactly. Grads, pieces and outputs are addressed through flat views with
per-row masks on 1-D vectors (`rows[:, None] * width + cols[None, :]`), so
row accesses are contiguous vector loads/stores; wide shards loop over
column blocks.

`python -m bench.kernels --sweep --what=segment_sum` sweeps its block sizes.
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

# f32 tiles of 8 KiB for the segment kernel (it holds the accumulator, a
# piece-sum tile and a loaded tile at once) and 16 KiB for the piece kernel;
# rows of at most 1 KiB per column block.
_SEGMENT_TILE_BYTES = 8192
_PIECE_TILE_BYTES = 16384
_MAX_ROW_BYTES = 1024
_MIN_PROGRAMS = 512


@dataclasses.dataclass(frozen=True)
class SegmentSumConfig:
  """Tiles of the two segment-sum kernels; None fields take the heuristic.

  piece_rows: sorted rows per piece (the most head rows a segment walks one
    by one; a run longer than that is split across pieces).
  block_segments: segments per program of the segment kernel (tile rows).
  block_cols: columns per block (both kernels; wider shards loop).
  piece_block_rows: rows per step of the piece kernel (a piece takes
    `piece_rows / piece_block_rows` steps; a hot segment adds its piece sums
    `block_segments` per step).
  num_warps / piece_num_warps: warps of the segment / piece kernel.
  All block sizes are powers of two; a tile is at most
  `common.MAX_TILE_ELEMENTS` elements.
  """
  piece_rows: int | None = None
  block_segments: int | None = None
  block_cols: int | None = None
  piece_block_rows: int | None = None
  num_warps: int | None = None
  piece_num_warps: int | None = None
  num_stages: int = 1

  def __post_init__(self):
    common.check_config(
        self, ("piece_rows", "block_segments", "block_cols",
               "piece_block_rows", "num_warps", "piece_num_warps"),
        (("block_segments", "block_cols"), ("piece_block_rows", "block_cols")))


def resolve_config(config: SegmentSumConfig | None, num_rows: int,
                   num_segments: int, width: int) -> SegmentSumConfig:
  """`config` with every None field filled in by the shape heuristic.

  Accumulators are f32, so tiles are sized for 4-byte elements. A segment
  walks at most `piece_rows` head rows, one step each, and a hot one then
  adds `len / piece_rows` piece sums, `block_segments` per step: 32 rows per
  piece keeps both chains short for 16k-262k tokens (the top id of a
  Zipf(1.05) batch of 262k tokens: <= 32 + 25,000 / 32 / block_segments).
  """
  config = config or SegmentSumConfig()
  f32 = 4
  block_segments, block_cols, num_warps = common.fill_tile(
      config.block_segments, config.block_cols, config.num_warps,
      num_rows=num_segments, width=width, itemsize=f32,
      tile_bytes=_SEGMENT_TILE_BYTES, max_row_bytes=_MAX_ROW_BYTES,
      min_programs=_MIN_PROGRAMS, split_cols=False)
  piece_rows = config.piece_rows or 32
  piece_block_rows = config.piece_block_rows or min(piece_rows, max(
      1, common.pow2_floor(_PIECE_TILE_BYTES // (block_cols * f32))))
  del num_rows  # the pieces are sized by the chains, not by N
  piece_num_warps = config.piece_num_warps or common.num_warps_for(
      min(piece_block_rows, piece_rows) * block_cols, f32)
  return SegmentSumConfig(piece_rows, block_segments, block_cols,
                          piece_block_rows, num_warps, piece_num_warps,
                          config.num_stages)


def _column_blocks(width: int, block_cols: int, body, init):
  """`body(cols, carry)` over the column blocks (straight-line if one)."""
  def one(j, carry):
    return body(j * block_cols + jnp.arange(block_cols), carry)
  num_blocks = pl.cdiv(width, block_cols)
  if num_blocks == 1:
    return one(0, init)
  return lax.fori_loop(0, num_blocks, one, init)


def _pieces_kernel(keys_ref, end_ref, order_ref, grads_ref, pieces_ref, *,
                   num_pieces, num_segments, width, piece_rows, block_rows,
                   block_cols, interpret):
  """Piece c: sum of the run covering sorted position c * piece_rows, to the
  end of the piece or of the run (zeros if that position is dropped)."""
  c = pl.program_id(0)
  first = c * piece_rows
  seg = keys_ref[first]
  seg_ok = seg < num_segments
  run_end = end_ref[jnp.where(seg_ok, seg, 0)]
  last = jnp.where(seg_ok, jnp.minimum(run_end, first + piece_rows), first)
  steps = (last - first + block_rows - 1) // block_rows

  def column_block(cols, carry):
    mask_cols = None if width % block_cols == 0 else (cols < width)[None, :]

    def step(k, acc):
      pos = first + k * block_rows + jnp.arange(block_rows)
      ok = pos < last
      src = plgpu.load(order_ref.at[pos], mask=ok, other=0)
      mask = ok[:, None] if mask_cols is None else ok[:, None] & mask_cols
      rows = plgpu.load(grads_ref.at[src[:, None] * width + cols[None, :]],
                        mask=mask, other=0)
      return acc + rows.astype(jnp.float32)

    acc = lax.fori_loop(0, steps, step,
                        jnp.zeros((block_rows, block_cols), jnp.float32))
    # One program per piece row: no other program writes it. Kept 2-D
    # ([1, block_cols], in the tile's layout): no layout conversion, and
    # vector stores once a thread holds 8 bytes or more of the row.
    total = jnp.sum(acc, axis=0, keepdims=True)
    dst = c * width + cols[None, :]
    if mask_cols is None:
      plgpu.store(pieces_ref.at[dst], total)
    else:
      dst = common.store_offsets(dst, mask_cols, num_pieces * width,
                                 interpret)
      plgpu.store(pieces_ref.at[dst], total, mask=mask_cols)
    return carry

  _column_blocks(width, block_cols, column_block, 0)


def _segment_kernel(start_ref, end_ref, order_ref, grads_ref, pieces_ref,
                    accum_ref, row_sq_ref, *, num_segments, width, round_dtype,
                    piece_rows, block_segments, block_cols, interpret):
  lanes = jnp.arange(block_segments)
  segs = pl.program_id(0) * block_segments + lanes
  seg_ok = segs < num_segments
  start = plgpu.load(start_ref.at[segs], mask=seg_ok, other=0)
  end = plgpu.load(end_ref.at[segs], mask=seg_ok, other=0)
  # Head: from start to the first piece boundary after it (at most
  # piece_rows rows), clipped to the run; then the pieces [first_piece,
  # last_piece) whose first position lies inside the run (only runs that
  # cross a piece boundary have any).
  first_piece = start // piece_rows + 1
  last_piece = (end + piece_rows - 1) // piece_rows
  head_len = jnp.minimum(end, first_piece * piece_rows) - start
  num_pieces = jnp.maximum(last_piece - first_piece, 0)
  head_steps = jnp.max(head_len)
  out_rows = jnp.where(seg_ok, segs, 0)

  def column_block(cols, row_sq):
    col_ok = None if width % block_cols == 0 else (cols < width)[None, :]

    def with_cols(mask):
      return mask if col_ok is None else mask & col_ok

    def head_step(k, acc):
      ok = k < head_len
      src = plgpu.load(order_ref.at[start + k], mask=ok, other=0)
      rows = plgpu.load(grads_ref.at[src[:, None] * width + cols[None, :]],
                        mask=with_cols(ok[:, None]), other=0)
      return acc + rows.astype(jnp.float32)

    acc = lax.fori_loop(0, head_steps, head_step,
                        jnp.zeros((block_segments, block_cols), jnp.float32))

    # Segments that cover whole pieces (hot ids; usually none): add their
    # pieces' sums, one segment at a time in lane order.
    def next_lane(after):
      return jnp.min(jnp.where((num_pieces > 0) & (lanes > after), lanes,
                               block_segments))

    def add_pieces(state):
      lane, acc = state
      pick = lanes == lane
      first = jnp.sum(jnp.where(pick, first_piece, 0))
      count = jnp.sum(jnp.where(pick, num_pieces, 0))

      def piece_step(k, total):
        idx = k * block_segments + lanes
        ok = idx < count
        rows = plgpu.load(
            pieces_ref.at[(first + idx)[:, None] * width + cols[None, :]],
            mask=with_cols(ok[:, None]), other=0)
        return total + rows

      # Tiles shaped like the accumulator: the same register budget.
      total = lax.fori_loop(
          0, (count + block_segments - 1) // block_segments, piece_step,
          jnp.zeros((block_segments, block_cols), jnp.float32))
      acc = jnp.where(pick[:, None], acc + jnp.sum(total, axis=0)[None, :],
                      acc)
      return next_lane(lane), acc

    _, acc = lax.while_loop(lambda state: state[0] < block_segments,
                            add_pieces, (next_lane(-1), acc))
    mask = with_cols(seg_ok[:, None])
    dst = common.store_offsets(out_rows[:, None] * width + cols[None, :],
                               mask, num_segments * width, interpret)
    plgpu.store(accum_ref.at[dst], acc, mask=mask)
    return row_sq + jnp.sum(jnp.square(common.round_to(acc, round_dtype)),
                            axis=1)

  row_sq = _column_blocks(width, block_cols, column_block,
                          jnp.zeros((block_segments,), jnp.float32))
  plgpu.store(row_sq_ref.at[common.store_offsets(out_rows, seg_ok,
                                                 num_segments, interpret)],
              row_sq, mask=seg_ok)


def sort_segments(segment_ids: jax.Array, num_segments: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Sorted keys and order, and every segment's run in the sorted order.

  Returns `keys[N]` (segment ids sorted, dropped ones as `U`, last),
  `order[N]` (row indices, ties in row order) and `start[U]`, `end[U]`:
  segment u's rows are `order[start[u]:end[u]]` (0, 0 when it is empty).
  The runs come from two scatters that write each segment once (at its
  first and last sorted position); the other positions go to distinct
  slots past `U`, which the scatters drop.
  """
  (num_rows,) = segment_ids.shape
  valid = (segment_ids >= 0) & (segment_ids < num_segments)
  keys = jnp.where(valid, segment_ids, num_segments)
  pos = jnp.arange(num_rows, dtype=jnp.int32)
  keys, order = lax.sort((keys, pos), num_keys=1, is_stable=True)
  differs = keys[1:] != keys[:-1]
  is_first = jnp.concatenate([jnp.ones((1,), bool), differs])
  is_last = jnp.concatenate([differs, jnp.ones((1,), bool)])
  in_range = keys < num_segments
  spare = num_segments + pos

  def runs(is_edge, value):
    slots = jnp.where(is_edge & in_range, keys, spare)
    return jnp.zeros((num_segments,), jnp.int32).at[slots].set(
        value, mode="drop", unique_indices=True)

  return keys, order, runs(is_first, pos), runs(is_last, pos + 1)


def segment_sum_rows(grads: jax.Array, segment_ids: jax.Array,
                     num_segments: int, *, round_dtype,
                     interpret: bool = False,
                     config: SegmentSumConfig | None = None
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
  config = resolve_config(config, num_rows, num_segments, width)
  num_pieces = pl.cdiv(num_rows, config.piece_rows)
  common.check_flat_sizes(
      "segment_sum", **{"gradient block": grads.shape,
                        "grad_accum": (num_segments, width),
                        "piece sums": (num_pieces, width),
                        "segments + rows": (num_segments + num_rows,)})
  if num_rows == 0:
    accum = jnp.zeros((num_segments, width), jnp.float32)
    return accum, jnp.zeros((num_segments + 1,), jnp.float32)

  keys, order, start, end = sort_segments(segment_ids, num_segments)
  params = plgpu.CompilerParams
  pieces_kernel = functools.partial(
      _pieces_kernel, num_pieces=num_pieces, num_segments=num_segments,
      width=width, piece_rows=config.piece_rows,
      block_rows=min(config.piece_block_rows, config.piece_rows),
      block_cols=config.block_cols, interpret=interpret)
  segment_kernel = functools.partial(
      _segment_kernel, num_segments=num_segments, width=width,
      round_dtype=jnp.dtype(round_dtype), piece_rows=config.piece_rows,
      block_segments=config.block_segments, block_cols=config.block_cols,
      interpret=interpret)
  with common.quiet_triton_deprecation():
    pieces = pl.pallas_call(
        pieces_kernel,
        out_shape=jax.ShapeDtypeStruct((num_pieces * width,), jnp.float32),
        grid=(num_pieces,),
        interpret=interpret,
        compiler_params=params(num_warps=config.piece_num_warps,
                               num_stages=config.num_stages),
        name="pallas_emb_segment_sum_pieces",
    )(keys, end, order, grads.reshape(-1))
    accum, row_sq = pl.pallas_call(
        segment_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_segments * width,), jnp.float32),
            jax.ShapeDtypeStruct((num_segments,), jnp.float32),
        ),
        grid=(pl.cdiv(num_segments, config.block_segments),),
        interpret=interpret,
        compiler_params=params(num_warps=config.num_warps,
                               num_stages=config.num_stages),
        name="pallas_emb_segment_sum",
    )(start, end, order, grads.reshape(-1), pieces)
  row_sq = jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])
  return accum.reshape(num_segments, width), row_sq
