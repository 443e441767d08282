"""Small pieces shared by the kernels and their jnp twins.

Kernel-side helpers (tile heuristics, int32 offset checks, masked-store
offsets, the Triton deprecation filter) sit next to the arithmetic that the
kernels and the twins share (`adagrad_row_update`, `adagrad_new_values`,
`AdagradRule`) and the argument checks of the sparse update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Triton addresses a flat view with int32 offsets.
MAX_FLAT_SIZE = 2**31 - 1
# Largest tile a config may ask for (elements): beyond this the registers of
# even 8 warps spill. The heuristics stay well below.
MAX_TILE_ELEMENTS = 16384
# Offsets are computed up to one tile past the end of an array before the
# mask is applied (`pid * block + arange(block)`), so a kernel may address
# `size + MAX_TILE_ELEMENTS` without overflowing int32.
_OFFSET_HEADROOM = MAX_TILE_ELEMENTS
# One 16-byte (v4.b32) access per thread is what a coalesced row read is
# made of on NVIDIA GPUs.
VECTOR_BYTES = 16

# jax 0.11.2 warns at every Triton lowering; this exact message is silenced
# around our own pallas_calls (see `quiet_triton_deprecation`).
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be "
                      r"removed in a future JAX version\.")


def wrap_and_clamp(ids: jax.Array, vocab_rows: int) -> jax.Array:
  """A negative id is wrapped once, then clamped into the table."""
  ids = jnp.where(ids < 0, ids + vocab_rows, ids)
  return jnp.clip(ids, 0, vocab_rows - 1)


def wrap_once(ids: jax.Array, vocab_rows: int) -> jax.Array:
  """A negative unique token is wrapped once (not clamped)."""
  return jnp.where(ids < 0, ids + vocab_rows, ids)


def check_flat_size(array, what: str) -> None:
  """Raises ValueError if `array` (or a ShapeDtypeStruct) is too big.

  Too big: more elements than int32 offsets can address, one tile of
  headroom kept.
  """
  size = math.prod(array.shape)
  if size > MAX_FLAT_SIZE - _OFFSET_HEADROOM:
    raise ValueError(
        f"pallas_emb {what} {tuple(array.shape)} has {size} elements per "
        f"rank, more than the {MAX_FLAT_SIZE - _OFFSET_HEADROOM} a Pallas "
        "kernel can address with int32 offsets. Shard the table over more "
        "ranks, or use backend='xla'.")


def check_flat_sizes(kernel: str, **shapes) -> None:
  """`check_flat_size` for every named shape a kernel addresses."""
  for what, shape in shapes.items():
    check_flat_size(jax.ShapeDtypeStruct(tuple(shape), jnp.int8),
                    f"{kernel}: {what}")


@contextlib.contextmanager
def quiet_triton_deprecation():
  """Silences jax 0.11.2's Triton-backend DeprecationWarning, nothing else.

  jax emits it from the pallas_call *lowering* rule, so this catches it when
  the lowering happens inside the block: an eager (un-jitted) kernel call,
  or a `jax.jit(...).lower()` / first call of a jitted function wrapped in
  it. Kernels called inside a user's jit are lowered when that jit lowers.
  """
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION,
                            category=DeprecationWarning)
    yield


# --------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def pow2_floor(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n).bit_length() - 1)


def check_pow2(owner: str, name: str, value, allow_none: bool = True) -> None:
  if value is None and allow_none:
    return
  if not isinstance(value, int) or value < 1 or value & (value - 1):
    raise ValueError(f"pallas_emb {owner}.{name} must be a positive power of "
                     f"two, got {value!r}.")


def check_tile(owner: str, rows, cols) -> None:
  if rows is not None and cols is not None and rows * cols > MAX_TILE_ELEMENTS:
    raise ValueError(
        f"pallas_emb {owner} tile {rows} x {cols} = {rows * cols} elements is "
        f"more than the {MAX_TILE_ELEMENTS} that fit in registers; use fewer "
        "rows or columns per block.")


def check_config(config, pow2_fields: tuple[str, ...],
                 tiles: tuple[tuple[str, str], ...]) -> None:
  """A kernel config's checks: power-of-two fields, tiles that fit in
  registers (`(rows field, cols field)` pairs), num_stages >= 1."""
  owner = type(config).__name__
  for name in pow2_fields:
    check_pow2(owner, name, getattr(config, name))
  for rows, cols in tiles:
    check_tile(owner, getattr(config, rows), getattr(config, cols))
  if config.num_stages < 1:
    raise ValueError(f"pallas_emb {owner}.num_stages must be >= 1, got "
                     f"{config.num_stages}.")


@dataclasses.dataclass(frozen=True)
class RowTileConfig:
  """A tile of `block_rows` rows x `block_cols` columns (powers of two,
  `block_rows * block_cols <= MAX_TILE_ELEMENTS`); a field left None takes
  the kernel's shape heuristic. num_warps: Triton warps per program."""
  block_rows: int | None = None
  block_cols: int | None = None
  num_warps: int | None = None
  num_stages: int = 1

  def __post_init__(self):
    check_config(self, ("block_rows", "block_cols", "num_warps"),
                 (("block_rows", "block_cols"),))


def block_cols_for(width: int, itemsize: int, max_row_bytes: int) -> int:
  """Columns per block: the whole (power-of-two padded) row, capped in bytes."""
  return max(1, min(next_pow2(width), pow2_floor(max_row_bytes // itemsize)))


def block_rows_for(num_rows: int, block_cols: int, itemsize: int, *,
                   tile_bytes: int, min_programs: int,
                   col_blocks: int = 1) -> int:
  """Rows per block: a `tile_bytes` tile, fewer if that leaves few programs.

  Narrow rows get many rows per block (a warp then covers several rows, each
  thread one 16-byte vector); the floor keeps one full vector per thread of
  a single warp, the cap keeps the tile in registers.
  """
  cap = max(1, pow2_floor(tile_bytes // (block_cols * itemsize)))
  floor = max(1, min(cap, (32 * VECTOR_BYTES) // (block_cols * itemsize)))
  wanted = pow2_floor(max(1, (num_rows * col_blocks) // min_programs))
  return max(floor, min(cap, wanted))


def num_warps_for(tile_elements: int, itemsize: int, max_warps: int = 4) -> int:
  """Warps such that every thread holds at least one 16-byte vector."""
  vectors = max(1, tile_elements * itemsize // VECTOR_BYTES)
  return max(1, min(max_warps, pow2_floor(vectors // 32)))


def fill_tile(block_rows: int | None, block_cols: int | None,
              num_warps: int | None, *, num_rows: int, width: int,
              itemsize: int, tile_bytes: int, max_row_bytes: int,
              min_programs: int, split_cols: bool = True
              ) -> tuple[int, int, int]:
  """`(block_rows, block_cols, num_warps)`: given values kept, None filled.

  The heuristic of every row-tiled kernel: blocks of whole rows up to
  `max_row_bytes`, tiles of `tile_bytes`, and at least `min_programs`
  programs over the row blocks (times the column blocks when the grid
  splits columns too, `split_cols`).
  """
  block_cols = block_cols or block_cols_for(width, itemsize, max_row_bytes)
  col_blocks = -(-width // block_cols) if split_cols else 1
  block_rows = block_rows or block_rows_for(
      num_rows, block_cols, itemsize, tile_bytes=tile_bytes,
      min_programs=min_programs, col_blocks=col_blocks)
  num_warps = num_warps or num_warps_for(block_rows * block_cols, itemsize)
  return block_rows, block_cols, num_warps


def call_row_tiles(kernel, *args, num_rows: int, width: int, dtype,
                   block_rows: int, config, name: str,
                   interpret: bool) -> jax.Array:
  """`[num_rows, width]` of `kernel` over a (row blocks, column blocks) grid.

  The output is flat: kernels store at computed offsets (`store_offsets`).
  `config` gives `block_cols`, `num_warps` and `num_stages`.
  """
  with quiet_triton_deprecation():
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows * width,), dtype),
        grid=(pl.cdiv(num_rows, block_rows),
              pl.cdiv(width, config.block_cols)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        name=name,
    )(*args)
  return out.reshape(num_rows, width)


def store_offsets(offsets: jax.Array, mask: jax.Array, size: int,
                  interpret: bool) -> jax.Array:
  """Flat offsets of a masked store; masked lanes past `size` if interpreted.

  On a GPU a masked lane does not write, so the offsets stay a plain
  `rows[:, None] * width + cols[None, :]` that Triton can vectorize. The
  interpreter discharges a masked store into a read-modify-write scatter
  that writes the OLD value back at every masked lane; if such a lane's
  offset is also written by a real lane of the same store (a padding column
  reaching into the next row, or a skipped row pointing at row 0), the
  scatter keeps whichever comes last and a real write can be lost
  (tests/gather_test.py proves it). Past `size` the scatter drops them.
  """
  if not interpret:
    return offsets
  return jnp.where(mask, offsets, size)


# --------------------------------------------------------------------------
# Arithmetic shared with the twins
# --------------------------------------------------------------------------


# A bf16 table in a collection state on the `xla` backend is held as its
# uint16 bits (`placement.storage_dtype`): XLA:CPU scatters uint16 rows in
# place, while a bf16 scatter (or a bitcast of the whole table) runs over
# every row. The xla kernels take either; only gathered rows are bitcast.
BF16_BITS = jnp.uint16


def logical_dtype(dtype):
  """The dtype a table of `dtype` holds: bf16 for its uint16 bits, and for
  the uint32 words of two bf16 columns (the Mosaic backend's storage)."""
  return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) in (BF16_BITS, jnp.uint32)
                   else dtype)


def logical_rows(rows: jax.Array) -> jax.Array:
  """Rows (or a table) as their logical dtype: uint16 bits read as bf16."""
  if rows.dtype != BF16_BITS:
    return rows
  return jax.lax.bitcast_convert_type(rows, jnp.bfloat16)


def stored_rows(rows: jax.Array, storage_dtype) -> jax.Array:
  """Rows (or a table) of their logical dtype as `storage_dtype`: bf16 as
  its uint16 bits when that is the storage, else unchanged."""
  if jnp.dtype(storage_dtype) != BF16_BITS or rows.dtype != jnp.bfloat16:
    return rows
  return jax.lax.bitcast_convert_type(rows, BF16_BITS)


def f32_from_bf16_bits(bits: jax.Array) -> jax.Array:
  """bf16 values held as their uint16 bits, as f32 (exact: the bits are
  the f32's upper half)."""
  return jax.lax.bitcast_convert_type(
      bits.astype(jnp.uint32) << 16, jnp.float32)


def take_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
  """`table[rows]` for in-range `[N]` rows; on CPU, a uint16 table (bf16
  bits) of even width through its uint32 view, two columns a word.

  XLA:CPU gathers a uint16 row a column at a time, and fused into the
  update's math that gather made a bf16 step 2.6x an f32 one; a row of
  words moves half the elements, and the barrier keeps it a gather of its
  own (contiguous rows for the math). The default bf16 step at 1M x 64,
  bags of 20, 57.7 -> 48.7 ms; at 10M rows, 65,536 ids, 28.3 -> 21.0 ms
  (`bench.cpu_knobs --variants=default,uint16_gather`; docs/
  cpu_performance.md, "bf16 rows as words"). Only the update reads
  a table this way: XLA:CPU makes the view with a pass over the table,
  which it fuses into one gather but runs over every row for two (the
  lookup's too; tests/hlo_test.py).
  """
  num_rows, width = table.shape
  # Accelerators tile a [V, S/2, 2] view (not measured there).
  if (table.dtype != BF16_BITS or width % 2
      or jax.default_backend() != "cpu"):
    return table[rows]
  words = jax.lax.bitcast_convert_type(
      table.reshape(num_rows, width // 2, 2), jnp.uint32)
  taken = jax.lax.optimization_barrier(words[rows])
  return jax.lax.bitcast_convert_type(taken, BF16_BITS).reshape(
      rows.shape[0], width)


def narrow(x: jax.Array, dtype) -> jax.Array:
  """f32 `x` as `dtype`; to bf16 rounded to nearest even on the bits.

  The same bits as `x.astype(jnp.bfloat16)` (a NaN becomes the quiet NaN
  of its sign). Inside XLA:CPU's fused bf16 row update, whose rows are
  gathered in random order, XLA's own convert made the update a third
  slower: the more work per row, the fewer rows' cache misses overlap.
  """
  if jnp.dtype(dtype) != jnp.bfloat16 or x.dtype != jnp.float32:
    return x.astype(dtype)
  return jax.lax.bitcast_convert_type(bf16_bits(x).astype(jnp.uint16),
                                      jnp.bfloat16)


def bf16_bits(x: jax.Array) -> jax.Array:
  """uint32: the bits of `narrow(x, bf16)` in the low half (32-bit integer
  ops only, as a Mosaic kernel computes them)."""
  sign = (jax.lax.bitcast_convert_type(x, jnp.uint32) >> 16) & jnp.uint32(
      0x8000)
  return jnp.where(jnp.isnan(x), sign | jnp.uint32(0x7FC0),
                   _round_bf16_bits(x) >> 16)


def _round_bf16_bits(x: jax.Array) -> jax.Array:
  """uint32: the bits of f32 `x` with the carry that rounds their upper
  half to nearest, ties to even (meaningless for a NaN)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))


def round_to(x: jax.Array, dtype) -> jax.Array:
  """Rounds an f32 value to `dtype` (f32 or bf16) and back, as f32.

  The bf16 rounding (to nearest, ties to even) is done on the f32 bits:
  XLA:GPU drops a `convert` pair f32 -> bf16 -> f32 as "excess precision"
  (`--xla_allow_excess_precision`, on by default), which would skip the
  rounding the update's numerics are defined by. Integer ops are never
  folded, and Triton lowers them too. A NaN stays a NaN.
  """
  if jnp.dtype(dtype) == jnp.float32:
    return x
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"round_to: dtype {jnp.dtype(dtype)}; expected float32 "
                     "or bfloat16.")
  rounded = jax.lax.bitcast_convert_type(
      _round_bf16_bits(x) & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.where(jnp.isnan(x), x, rounded)


def check_update_args(rule, table, row_state, element_state, unique_tokens,
                      grad_accum, row_sq, scalars) -> jax.Array:
  """Shape/dtype checks shared by the update kernel and its twin.

  Returns `row_sq` as `[U]`: a trailing total slot (the `[U + 1]` output of
  the segment sum) is dropped.
  """
  chex.assert_rank(table, 2)
  vocab_rows, width = table.shape
  if table.dtype not in (jnp.float32, jnp.bfloat16, BF16_BITS):
    raise TypeError(f"pallas_emb sparse_update expects an f32 or bf16 table "
                    f"(or bf16 bits as uint16), got {table.dtype}.")
  for what, names, arrays in (("row", rule.row_slots, row_state),
                              ("element", rule.element_slots, element_state)):
    if len(arrays) != len(names):
      raise ValueError(
          f"pallas_emb sparse_update: {rule.kernel_name} has {what}-wise "
          f"state {list(names)}, got {len(arrays)} arrays.")
  for array in row_state:
    chex.assert_shape(array, (vocab_rows,))
    if array.dtype not in (jnp.float32, jnp.int32):
      raise TypeError(f"pallas_emb sparse_update: row-wise state must be "
                      f"f32 or int32, got {array.dtype}.")
  for array in element_state:
    chex.assert_shape(array, (vocab_rows, width))
    chex.assert_type(array, jnp.float32)
  chex.assert_type([grad_accum, row_sq], [jnp.float32, jnp.float32])
  chex.assert_type(unique_tokens, jnp.int32)
  chex.assert_rank(unique_tokens, 1)
  (num_unique,) = unique_tokens.shape
  chex.assert_shape(grad_accum, (num_unique, width))
  if row_sq.shape == (num_unique + 1,):
    row_sq = row_sq[:num_unique]
  chex.assert_shape(row_sq, (num_unique,))
  for s in scalars:
    chex.assert_shape(s, ())
  return row_sq


def unfused_product(x: jax.Array, y: jax.Array) -> jax.Array:
  """`x * y` rounded to f32 on its own, never contracted into an FMA.

  XLA:CPU always lets LLVM contract `a * b + c` into a fused multiply-add
  (and NVPTX does too), and which product gets fused depends on how the
  surrounding program was fused: the last bit would then differ between the
  twin, the interpret-mode kernel and the same twin inside a larger jit. A
  select on the product (NaN canonicalisation, otherwise the identity) is
  opaque to the contraction, so every backend rounds the product itself.
  """
  p = x * y
  return jnp.where(jnp.isnan(p), jnp.float32(jnp.nan), p)


# ln 2 in two parts: k * _LN2_HI is exact for |k| < 2**8 (16 bits each).
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06
# Below this exp(x) is not a normal f32: the decays call it 0.
_EXP_FLOOR = -87.0


def decay_exp(x: jax.Array) -> jax.Array:
  """`exp(x)` in f32 for `x <= 0`, by + and x alone, so that every platform
  gives the same bits (XLA's `exp` does not: a v5e's was 2.35e-6 off,
  about 40 ulps): `x = k ln2 + r` (Cody-Waite, |r| <= ln2 / 2), the
  degree-7 Taylor polynomial of `exp(r)` (truncation 5e-9 relative; within
  2 ulps of exp), times `2**k` as exponent bits. Exactly 1 at 0; 0 below
  -87, where exp is no longer a normal f32 (a chip flushes subnormals)."""
  f32 = jnp.float32
  x = jnp.asarray(x, f32)
  clamped = jnp.maximum(x, f32(_EXP_FLOOR))
  k = jnp.floor(unfused_product(clamped, f32(1.4426950408889634)) + f32(0.5))
  r = ((clamped - unfused_product(k, f32(_LN2_HI)))
       - unfused_product(k, f32(_LN2_LO)))
  p = f32(1 / 5040)
  for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1, 1):
    p = unfused_product(p, r) + f32(c)
  power = lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, f32)
  return jnp.where(x < f32(_EXP_FLOOR), f32(0), unfused_product(p, power))


def dequantize(codes: jax.Array, scale: jax.Array,
               bias: jax.Array) -> jax.Array:
  """Row-wise int8 read back: `codes * scale + bias` in f32, the product
  rounded on its own.

  `scale` and `bias` broadcast against `codes` (e.g. `[N, 1]` against
  `[N, S]`). The product is never contracted into an FMA
  (`unfused_product`), so the kernels and their twins agree bit for bit.
  """
  return unfused_product(codes.astype(jnp.float32), scale) + bias


def adagrad_row_update(row_state, last_step, row_sq, step, learning_rate,
                       hparams):
  """Per-row part of row-wise Adagrad: `(accum, wd, lr_scale)`, all f32.

  Shared by the kernel body and its twin so both evaluate the same
  expressions in the same order. `last_step` is None in eager mode.
  """
  f32 = jnp.float32
  has_grad = row_sq > 0
  if hparams.lazy:
    delta = jnp.maximum(step - last_step, 0).astype(f32)
    factor = decay_exp(f32(-hparams.accum_decay_rate) * delta)
    wd = jnp.where(has_grad,
                   decay_exp(f32(-hparams.weight_decay_rate) * delta), f32(1))
  else:
    factor = f32(hparams.decay_factor)
    wd = jnp.where(has_grad, f32(hparams.weight_decay_factor), f32(1))
  accum = (unfused_product(row_state, factor)
           + unfused_product(row_sq, f32(hparams.inv_width)))
  lr_scale = -learning_rate / (jnp.sqrt(accum) + f32(hparams.eps))
  return accum, wd, lr_scale


def adagrad_new_values(values, wd, lr_scale, grad, dtype) -> jax.Array:
  """`R(values * wd) + R(lr_scale * R(grad))` in f32; the caller rounds it
  to `dtype` once more.

  R rounds to the table dtype; `values` (of `dtype`, held as f32) and
  `grad` are f32. `wd` None: no weight decay, and `R(values * 1)` is
  `values` (fewer ops per element in the fused row update).
  """
  decayed = values if wd is None else round_to(unfused_product(values, wd),
                                               dtype)
  delta = round_to(unfused_product(lr_scale, round_to(grad, dtype)), dtype)
  return decayed + delta


@dataclasses.dataclass(frozen=True)
class AdagradRule:
  """Row-wise Adagrad as a `sparse_update.UpdateRule`.

  Row-wise state `row_state` (+ `last_step` in lazy mode), no element-wise
  state; the one scalar is the learning rate. A row without gradient is
  still updated: its accumulator decays (eager mode) as §4 says.
  """
  hparams: Any  # hparams.AdagradHParams
  kernel_name: str = "pallas_emb_adagrad"
  element_slots: tuple[str, ...] = ()
  updates_zero_rows: bool = True

  @property
  def row_slots(self) -> tuple[str, ...]:
    return ("row_state", "last_step") if self.hparams.lazy else (
        "row_state",)

  def row_update(self, row, row_sq, step, scalars, emb_width):
    del emb_width  # hparams.inv_width
    accum, wd, lr_scale = adagrad_row_update(
        row["row_state"], row.get("last_step"), row_sq, step, scalars[0],
        self.hparams)
    new = {"row_state": accum}
    if self.hparams.lazy:
      new["last_step"] = jnp.broadcast_to(step, row_sq.shape)
    return new, (wd, lr_scale)

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    del element, scalars
    wd, lr_scale = coeffs
    wd = wd if self.hparams.decays_weights else None
    return adagrad_new_values(values, wd, lr_scale, grad, dtype), {}


def row_square_sums(grad_accum: jax.Array, round_dtype) -> jax.Array:
  """`[U + 1]`: per row `sum_c round(g)**2`, the total in the last slot.

  The squares are rounded on their own (`unfused_product`), so a row's sum
  has the same bits wherever XLA fuses this (a loop over chunks of rows,
  or after a scatter).
  """
  row_sq = _halving_sum(_rounded_squares(grad_accum, round_dtype))
  return jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])


def split_row_square_sums(evens: jax.Array, odds: jax.Array,
                          round_dtype) -> jax.Array:
  """`row_square_sums` of rows whose even columns are `evens` and odd ones
  `odds` (`[U, S/2]` each, S a power of two), with the same bits: the
  halving adds pair columns c and c + S/2, of the same parity until the
  last add, which adds the even and the odd column's sums."""
  row_sq = (_halving_sum(_rounded_squares(evens, round_dtype))
            + _halving_sum(_rounded_squares(odds, round_dtype)))
  return jnp.concatenate([row_sq, jnp.sum(row_sq, keepdims=True)])


def _rounded_squares(x: jax.Array, round_dtype) -> jax.Array:
  rounded = round_to(x, round_dtype)
  return unfused_product(rounded, rounded)


def _halving_sum(squares: jax.Array) -> jax.Array:
  """`[U]`: each row's columns summed by halving adds."""
  # Halving adds, not a reduce: XLA:CPU hands a row reduce to a library
  # call that cannot fuse the squares, which then take a `[U, S]` buffer.
  while squares.shape[1] > 1:
    half = squares.shape[1] // 2
    folded = squares[:, :half] + squares[:, half:2 * half]
    squares = (folded if squares.shape[1] % 2 == 0 else
               jnp.concatenate([folded, squares[:, 2 * half:]], axis=1))
  return squares[:, 0]
