"""The Mosaic backend's lookups: the sequence gather and the pooled lookup.

Both read a stored table (`stored.py`: rows of 32-bit words, whole
128-lane rows) and return logical rows; both also take a logical
`[V, width]` table (the single-table API, the row placement's exchanged
rows), which they convert first.

gather: `table[wrap_and_clamp(ids)]`. By default XLA's gather of whole
stored rows, which a v5e ran faster than row DMAs (`GATHER_METHOD`,
`bench/tpu_parts.py`); `method="dma"` is the kernel: program i DMAs its
`R` rows into a VMEM tile while program i - 1's tile is written out
(double-buffered across grid steps).

pool: per bag, `round(sum_k weights[k] * f32(table[rows[k]]))`, summed in
f32 in entry order with every product rounded on its own (as
`reference.pool_rows`, bit for bit). The CSR bags are laid out densely
first (`[M, max_len]` entries): program i DMAs the rows of its `R` bags'
entries into a `[max_len * R, P]` tile (entry k of every bag in rows
`k * R ... k * R + R - 1`) while program i - 1 sums its own, then adds the
`max_len` `[R, P]` slices. A padding entry reads row 0 and is masked to
+0.0, as the twin's masked lanes add. Bags too long for a tile in VMEM are
pooled by XLA's gathers (the same sums, in the same order). By default
(`POOL_METHOD`) bags of at most `XLA_POOL_UNROLL` entries are pooled by
XLA's gathers, one per entry position, which a v5e ran faster than the
kernel's row DMAs.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

from pallas_emb.kernels import common
from pallas_emb.kernels import reference
from pallas_emb.kernels.mosaic_tpu import dma
from pallas_emb.kernels.mosaic_tpu import stored

# The sequence gather: "xla" (XLA's gather of stored rows) or "dma" (the
# kernel). On a v5e, 16,384 / 327,680 rows of a 1M-row table: xla 0.72 /
# 4.5 ms, dma 0.81 / 5.3 ms (`python -m bench.tpu_parts`).
GATHER_METHOD = "xla"
# The pooled lookup: "xla" (per entry position, XLA's gather of every bag's
# stored row, summed in the same order: bounded temporaries, `[M, P]` a
# position), "dma" (the kernel), or "auto": "xla" for bags of at most
# XLA_POOL_UNROLL entries, else "dma". On a v5e, the 1M x 64 f32 step of
# 16,384 bags of 20 (`bench.tpu --set=...POOL_METHOD=...`): "xla" unrolled
# 13.8 ms, "dma" 15.9, "xla" as a loop over positions 16.1.
POOL_METHOD = "auto"
# The "xla" pool's positions are a straight line of gathers up to this many
# (XLA fuses each gather with its add); longer bags loop over positions.
XLA_POOL_UNROLL = 32


def _as_stored(table, width):
  """`(stored table, width, logical dtype)` of a stored or logical table."""
  if width is None:
    width = table.shape[1]
  if stored.is_stored(table, width):
    dtype = jnp.bfloat16 if table.dtype == stored.WORD else table.dtype
    return table, width, dtype
  return stored.to_stored(table), width, table.dtype


def gather_rows(table: jax.Array, ids: jax.Array, *, width: int | None = None,
                method: str | None = None,
                interpret: bool = False) -> jax.Array:
  """`[N, width]` logical rows `table[wrap_and_clamp(ids)]` of a stored (or
  logical) `[V, *]` table, for `[N]` int32 ids."""
  table, width, dtype = _as_stored(table, width)
  vocab_rows = table.shape[0]
  (num_ids,) = ids.shape
  if num_ids == 0:
    return jnp.zeros((0, width), dtype)
  ids = common.wrap_and_clamp(ids.astype(jnp.int32), vocab_rows)
  if (method or GATHER_METHOD) == "xla":
    rows = jnp.take(table, ids, axis=0)
  else:
    rows = _dma_gather(table, ids, interpret)
  return stored.from_stored(rows, width, dtype)


def _gather_kernel(ids_ref, next_ref, table, out_ref, tile, sem, *, block):
  slot = dma.double_buffered_reads(ids_ref, next_ref, table, tile, sem,
                                   num=block)
  out_ref[...] = tile[slot]


def _dma_gather(table, ids, interpret):
  """`table[ids]` (ids in range) by row DMAs."""
  num_ids = ids.shape[0]
  width = table.shape[1]
  block = dma.block_rows(num_ids, width * 4, copies=4)
  num_blocks = pl.cdiv(num_ids, block)
  ids = dma.smem_blocks(dma.padded(ids, num_blocks * block, 0), block)
  out = pl.pallas_call(
      functools.partial(_gather_kernel, block=block),
      out_shape=jax.ShapeDtypeStruct((num_blocks * block, width),
                                     table.dtype),
      grid=(num_blocks,),
      in_specs=[dma.smem_block(block),
                dma.smem_block(block, ahead=1, num_blocks=num_blocks),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((2, block, width), table.dtype),
                      pltpu.SemaphoreType.DMA((2,))],
      compiler_params=dma.compiler_params("arbitrary"),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_gather_tpu",
  )(ids, ids, table)
  return out[:num_ids]


def _pool_kernel(rows_ref, next_ref, *refs, block, max_len, words, masked,
                 grads_width):
  # valid_ref (masked only), weights_ref, table, out_ref, tile, sem
  valid_ref = refs[0] if masked else None
  weights_ref, table, out_ref, tile, sem = refs[1 if masked else 0:]
  slot = dma.double_buffered_reads(rows_ref, next_ref, table, tile, sem,
                                   num=block * max_len)
  here = tile.at[slot]

  def add_entry(k, sums):
    at = pl.ds(pl.multiple_of(k * block, block), block)
    values = here[at, :]
    parts = stored.unpack(values) if words else (values,)
    weight = weights_ref[at, :]
    products = [common.unfused_product(weight, v) for v in parts]
    if masked:
      ok = valid_ref[at, :] > 0
      products = [jnp.where(ok, p, 0.0) for p in products]
    return tuple(s + p for s, p in zip(sums, products))

  zeros = jnp.zeros((block, table.shape[1]), jnp.float32)
  sums = lax.fori_loop(0, max_len, add_entry,
                       (zeros, zeros) if words else (zeros,))
  out_ref[...] = (stored.join_grads(*sums, grads_width, pltpu.roll)
                  if words else sums[0])


def _static_starts(bag_starts):
  """`bag_starts` as numpy if it is known before tracing, else None."""
  if isinstance(bag_starts, np.ndarray):
    return bag_starts
  try:
    return np.asarray(bag_starts)
  except (TypeError, jax.errors.TracerArrayConversionError):
    return None


def _dense_by_runs(values, starts, max_len: int, fill):
  """`[num_bags, max_len]` of the CSR `values` whose bag starts are known
  (numpy): each run of bags of one length is a reshape, not a gather (a
  TPU gathers 327,680 scalars in milliseconds)."""
  lengths = np.diff(starts)
  parts, bag = [], 0
  while bag < lengths.shape[0]:
    end = bag
    while end < lengths.shape[0] and lengths[end] == lengths[bag]:
      end += 1
    length = int(lengths[bag])
    run = values[int(starts[bag]):int(starts[end])].reshape(end - bag, length)
    parts.append(jnp.pad(run, ((0, 0), (0, max_len - length)),
                         constant_values=fill))
    bag = end
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def dense_entries(rows, weights, bag_starts, *, max_len: int, block: int):
  """The CSR bags as `[num_blocks * max_len * block]` entries: their rows
  (0 for padding), whether they are entries (1) or padding (0; None when
  every bag is known to be full), and their f32 weights, ordered block,
  entry position, bag (a pool tile's order)."""
  num_bags = bag_starts.shape[0] - 1
  num_blocks = pl.cdiv(num_bags, block)
  weights = weights.astype(jnp.float32)
  static = _static_starts(bag_starts)
  if static is not None:
    lengths = np.diff(static)
    ok = np.arange(max_len)[None, :] < lengths[:, None]
    ok = jnp.asarray(np.pad(ok, ((0, num_blocks * block - num_bags), (0, 0))))
    pad = lambda x: dma.padded(x, num_blocks * block, 0)
    dense_rows = pad(_dense_by_runs(rows, static, max_len, 0))
    dense_weights = pad(_dense_by_runs(weights, static, max_len, 0.0))
  else:
    starts = dma.padded(bag_starts[:-1], num_blocks * block, 0)
    ends = dma.padded(bag_starts[1:], num_blocks * block, 0)
    entry = starts[:, None] + jnp.arange(max_len, dtype=jnp.int32)[None, :]
    ok = entry < ends[:, None]
    entry = jnp.where(ok, entry, 0)
    dense_rows = jnp.where(ok, jnp.take(rows, entry, mode="clip"), 0)
    dense_weights = jnp.where(ok, jnp.take(weights, entry, mode="clip"), 0.0)

  def blocked(x):  # [bags, max_len] -> [blocks, max_len, block], flat
    return x.reshape(num_blocks, block, max_len).transpose(0, 2, 1).reshape(-1)

  # Bags all of length max_len (known before tracing) need no mask.
  full = static is not None and bool(np.all(np.diff(static) == max_len))
  return (blocked(dense_rows), None if full else blocked(ok.astype(jnp.int32)),
          blocked(dense_weights))


def _xla_pool(table, rows, valid, weights, packed: bool,
              grads_width: int) -> jax.Array:
  """The kernel's sums by XLA: `rows`, `valid` (or None), `weights`
  `[max_len, M]`, entry position k of every bag in row k; per position, a
  gather of the bags' stored rows, added in position order."""
  max_len, num_bags = rows.shape

  def add_entry(k, sums):
    at = lambda x: lax.dynamic_index_in_dim(x, k, 0, keepdims=False)
    values = jnp.take(table, at(rows), axis=0, mode="clip")
    parts = stored.unpack(values) if packed else (values,)
    products = [common.unfused_product(at(weights)[:, None], v)
                for v in parts]
    if valid is not None:
      ok = at(valid)[:, None] > 0
      products = [jnp.where(ok, p, 0.0) for p in products]
    return tuple(s + p for s, p in zip(sums, products))

  zeros = jnp.zeros((num_bags, table.shape[1]), jnp.float32)
  sums = (zeros, zeros) if packed else (zeros,)
  if max_len <= XLA_POOL_UNROLL:
    for k in range(max_len):
      sums = add_entry(k, sums)
  else:
    sums = lax.fori_loop(0, max_len, add_entry, sums)
  return stored.join_grads(*sums, grads_width) if packed else sums[0]


def pool_rows(table: jax.Array, rows: jax.Array, weights: jax.Array,
              bag_starts: jax.Array, *, max_len: int,
              width: int | None = None, method: str | None = None,
              interpret: bool = False, out_dtype=None) -> jax.Array:
  """`[M, width]` weighted row sums of a stored (or logical) table for CSR
  bags (as `reference.pool_rows`; see the module doc). `method`: "dma" or
  "xla" or "auto" (`POOL_METHOD`)."""
  table, width, dtype = _as_stored(table, width)
  out_dtype = out_dtype or dtype
  vocab_rows, words_ = table.shape
  num_bags = bag_starts.shape[0] - 1
  if num_bags == 0 or max_len == 0 or rows.shape[0] == 0:
    return jnp.zeros((num_bags, width), out_dtype)
  row_bytes = 4 * words_
  block = dma.block_rows(num_bags, row_bytes, copies=2 * max_len, most=256)
  entries = block * max_len
  rows = common.wrap_and_clamp(rows.astype(jnp.int32), vocab_rows)
  if 2 * entries * row_bytes > dma.TILE_BUDGET:
    # Bags too long for even the smallest tile: XLA's gathers of the
    # entries' rows (the same sums in the same order).
    values = lambda entry: stored.from_stored(jnp.take(
        table, jnp.take(rows, entry, mode="clip"), axis=0), width,
                                                dtype).astype(jnp.float32)
    return reference._pool_entries(  # pylint: disable=protected-access
        values, weights, bag_starts, width, max_len).astype(out_dtype)
  num_blocks = pl.cdiv(num_bags, block)
  dense_rows, valid, dense_weights = dense_entries(
      rows, weights, bag_starts, max_len=max_len, block=block)
  packed = table.dtype == stored.WORD
  grads_width = stored.grad_width(width, dtype)
  method = method or POOL_METHOD
  if method == "auto":
    method = "xla" if max_len <= XLA_POOL_UNROLL else "dma"
  if method == "xla":
    by_position = lambda x: None if x is None else x.reshape(
        num_blocks, max_len, block).transpose(1, 0, 2).reshape(max_len, -1)
    sums = _xla_pool(table, by_position(dense_rows), by_position(valid),
                     by_position(dense_weights), packed, grads_width)
    return stored.from_grads(sums[:num_bags], width, dtype).astype(out_dtype)
  masked = valid is not None
  column = pl.BlockSpec((entries, 1), lambda i: (i, 0))
  sums = pl.pallas_call(
      functools.partial(_pool_kernel, block=block, max_len=max_len,
                        words=packed, masked=masked,
                        grads_width=grads_width),
      out_shape=jax.ShapeDtypeStruct((num_blocks * block, grads_width),
                                     jnp.float32),
      grid=(num_blocks,),
      in_specs=[dma.smem_block(entries),
                dma.smem_block(entries, ahead=1, num_blocks=num_blocks)]
               + [column] * (2 if masked else 1)
               + [pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, grads_width), lambda i: (i, 0)),
      scratch_shapes=[pltpu.VMEM((2, entries, words_), table.dtype),
                      pltpu.SemaphoreType.DMA((2,))],
      compiler_params=dma.compiler_params("arbitrary"),
      interpret=dma.interpret_params(interpret),
      name="pallas_emb_pool_tpu",
  )(dma.smem_blocks(dense_rows, entries), dma.smem_blocks(dense_rows, entries),
    *([valid[:, None]] if masked else []), dense_weights[:, None], table)
  return stored.from_grads(sums[:num_bags], width, dtype).astype(out_dtype)
