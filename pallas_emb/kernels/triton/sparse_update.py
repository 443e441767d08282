"""Pallas (Triton) kernel: one fused sparse optimizer update, in place.

Every sparse optimizer runs through this one kernel. What
differs between them is an *update rule* (see `UpdateRule`): the names of
its row-wise state (`[V]`, one value per row, e.g. Adagrad's row
accumulator), of its element-wise state (`[V, S]`, laid out as the table
shard, e.g. Adam's moments), and two pure functions that the kernel and its
jnp twin (`reference.sparse_update`) both call:

* `row_update(row, row_sq, step, scalars, emb_width)`, once per row:
  the row-wise state's new values and per-row coefficients for the columns;
* `column_update(coeffs, values, grad, element, scalars, dtype)`, per
  column block: the table's new values and the element-wise state's.

One program owns `block_rows` unique slots. For each slot it wraps the token
once and skips it when the update is not applied, the token is outside the
table (fill values), or (unless `rule.updates_zero_rows`) the row got no
gradient (`row_sq == 0`: a padding slot). It then reads the row-wise state,
runs `row_update`, loops over `[block_rows, block_cols]` column blocks of
the table, the gradient and the element-wise state running `column_update`,
and writes the row-wise state once at the end. Column blocks are a loop
inside the program, not a grid axis: a second program reading the row state
after the first one wrote it would apply the row part twice.

The table and every state array are aliased to the outputs
(`input_output_aliases`): unique tokens are unique, so every touched row is
read and written by exactly one lane of one program, no other row is
written, and nothing depends on the order of the grid. Under donation the
update costs O(U * S), not O(V * S).

As in `gather.py` the table (and the element-wise state, same layout) is
addressed through a flat view with per-row masks on 1-D vectors, so rows are
read and written with vector accesses; row-wise state holds one element per
row and is gathered / scattered by token.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Mapping, Protocol, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_emb.kernels import common

# Tiles of 4 KiB of f32: with 4 warps, at most 8 elements (two rows) per
# thread. The per-row arithmetic (two `exp`s in lazy row-wise Adagrad) is
# replicated on every thread of a row; at four rows per thread ptxas spills
# the inlined expf (seen at [32, 64] and [16, 128] f32 tiles, 4 warps).
# Element-wise state (two more f32 arrays for Adam and FTRL, FTRL's powf)
# fits the same tile: at most 84 registers, no spills (tests/ptx_test.py).
_TILE_BYTES = 4096
_MAX_ROW_BYTES = 1024
_MIN_PROGRAMS = 512


class UpdateRule(Protocol):
  """What the kernel and the twin need to know about an optimizer.

  Frozen and hashable (it is a static argument). `row_slots` and
  `element_slots` name the state arrays in the order they are passed;
  `row_update` gets `{name: [R]}` row-wise values, `row_sq` f32 `[R]` (the
  full-width squared norms of the rows' gradients), `step` (int32 scalar:
  updates applied before this one), `scalars` (f32 scalars, the per-step
  values such as the learning rate) and the full `emb_width`; it returns
  `({name: [R] new value}, tuple of f32 [R] coefficients)`.
  `column_update` gets those coefficients as `[R, 1]`, the table's values
  (f32 `[R, C]`), the summed gradient (f32 `[R, C]`, not yet rounded to the
  table dtype), `{name: f32 [R, C]}` element-wise state, the scalars and the
  table dtype; it returns `(new values, {name: new value})`, the values
  rounded as the rule wants (the kernel casts them to the table dtype).
  Both must be elementwise per row, so that any tile computes the same
  bits, and should use `common.unfused_product` for every product that
  feeds a sum (see its docstring). `updates_zero_rows`: whether a row whose
  gradient is all zero (`row_sq == 0`, a padding slot) is updated at all.
  `kernel_name` names the pallas_call (profiles, HLO).
  """
  kernel_name: str
  row_slots: tuple[str, ...]
  element_slots: tuple[str, ...]
  updates_zero_rows: bool

  def row_update(self, row: Mapping[str, jax.Array], row_sq: jax.Array,
                 step: jax.Array, scalars: Sequence[jax.Array],
                 emb_width: int): ...

  def column_update(self, coeffs: Sequence[jax.Array], values: jax.Array,
                    grad: jax.Array, element: Mapping[str, jax.Array],
                    scalars: Sequence[jax.Array], dtype): ...


@dataclasses.dataclass(frozen=True)
class SparseUpdateConfig(common.RowTileConfig):
  """Tile of the update kernel (`common.RowTileConfig`); a wider shard
  loops over column blocks inside the program (the row-wise state is read
  and written once)."""


def resolve_config(config: SparseUpdateConfig | None, num_unique: int,
                   width: int) -> SparseUpdateConfig:
  """`config` with every None field filled in by the shape heuristic."""
  config = config or SparseUpdateConfig()
  # The update is computed in f32 whatever the table dtype.
  block_rows, block_cols, num_warps = common.fill_tile(
      config.block_rows, config.block_cols, config.num_warps,
      num_rows=num_unique, width=width, itemsize=4, tile_bytes=_TILE_BYTES,
      max_row_bytes=_MAX_ROW_BYTES, min_programs=_MIN_PROGRAMS,
      split_cols=False)
  return dataclasses.replace(config, block_rows=block_rows,
                             block_cols=block_cols, num_warps=num_warps)


def ref_names(rule) -> tuple[str, ...]:
  """The kernel's parameters, inputs then outputs (debug info, PTX report)."""
  state = (("table",) + tuple(rule.row_slots) + tuple(rule.element_slots))
  return (("apply_ref", "step_ref", "scalars_ref", "tokens_ref", "grad_ref",
           "row_sq_ref") + tuple(f"{s}_ref" for s in state)
          + tuple(f"{s}_out" for s in state))


def _named(body, names):
  """`body` with a signature naming its refs (jaxpr debug info)."""
  def kernel(*refs):
    return body(*refs)
  kernel.__signature__ = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY)
       for n in names])
  return kernel


def _kernel(*refs, rule, num_scalars, num_unique, vocab_rows, width,
            emb_width, block_rows, block_cols, interpret):
  num_rows, num_elements = len(rule.row_slots), len(rule.element_slots)
  (apply_ref, step_ref, scalars_ref, tokens_ref, grad_ref, row_sq_ref,
   table_ref) = refs[:7]
  row_refs = refs[7:7 + num_rows]
  element_refs = refs[7 + num_rows:7 + num_rows + num_elements]
  outs = refs[7 + num_rows + num_elements:]
  table_out, row_outs, element_outs = (outs[0], outs[1:1 + num_rows],
                                       outs[1 + num_rows:])

  slots = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  slot_ok = slots < num_unique
  # Contiguous and masked: lanes past the end read nothing on a GPU.
  tokens = plgpu.load(tokens_ref.at[slots], mask=slot_ok, other=0)
  tokens = common.wrap_once(tokens, vocab_rows)
  ok = (slot_ok & (apply_ref[0] != 0) & (tokens >= 0)
        & (tokens < vocab_rows))
  # Per-row masking on 1-D vectors: skipped lanes address row 0 / slot 0
  # (in range) and are masked.
  rows = jnp.where(ok, tokens, 0)
  slots = jnp.where(ok, slots, 0)
  step = step_ref[0]
  scalars = tuple(scalars_ref[i] for i in range(num_scalars))

  row_sq = plgpu.load(row_sq_ref.at[slots], mask=ok, other=0)
  if not rule.updates_zero_rows:
    ok = ok & (row_sq > 0)
  row = {name: plgpu.load(ref.at[rows], mask=ok, other=0)
         for name, ref in zip(rule.row_slots, row_refs)}
  new_row, coeffs = rule.row_update(row, row_sq, step, scalars, emb_width)
  coeffs = tuple(c[:, None] for c in coeffs)

  def column_block(j, carry):
    cols = j * block_cols + jnp.arange(block_cols)
    mask = ok[:, None]
    if width % block_cols:
      mask = mask & (cols < width)[None, :]
    table_at = rows[:, None] * width + cols[None, :]
    values = plgpu.load(table_ref.at[table_at], mask=mask, other=0)
    grad = plgpu.load(grad_ref.at[slots[:, None] * width + cols[None, :]],
                      mask=mask, other=0)
    element = {name: plgpu.load(ref.at[table_at], mask=mask, other=0)
               for name, ref in zip(rule.element_slots, element_refs)}
    new_values, new_element = rule.column_update(
        coeffs, values.astype(jnp.float32), grad, element, scalars,
        table_ref.dtype)
    # Unique tokens: each touched row is written by exactly one lane. The
    # element-wise state has the table's layout, so the same offsets.
    at = common.store_offsets(table_at, mask, vocab_rows * width, interpret)
    plgpu.store(table_out.at[at], new_values.astype(table_ref.dtype),
                mask=mask)
    for name, out in zip(rule.element_slots, element_outs):
      plgpu.store(out.at[at], new_element[name], mask=mask)
    return carry

  num_col_blocks = pl.cdiv(width, block_cols)
  if num_col_blocks == 1:
    column_block(0, 0)
  else:
    lax.fori_loop(0, num_col_blocks, column_block, 0)
  # One element per row: these are gathers/scatters by token by nature.
  row_at = common.store_offsets(rows, ok, vocab_rows, interpret)
  for name, ref, out in zip(rule.row_slots, row_refs, row_outs):
    plgpu.store(out.at[row_at], new_row[name].astype(ref.dtype), mask=ok)


def sparse_update(rule: UpdateRule, table: jax.Array,
                  row_state: Sequence[jax.Array],
                  element_state: Sequence[jax.Array],
                  unique_tokens: jax.Array, grad_accum: jax.Array,
                  row_sq: jax.Array, apply, step,
                  scalars: Sequence[Any], *, emb_width: int | None = None,
                  interpret: bool = False,
                  config: SparseUpdateConfig | None = None):
  """`rule`'s update of the rows of `unique_tokens`, in place.

  Args:
    rule: the static update rule (an optimizer, see `UpdateRule`).
    table: `[V, S]` f32 or bf16 column shard.
    row_state: f32 / int32 `[V]` arrays, in `rule.row_slots` order.
    element_state: f32 `[V, S]` arrays, in `rule.element_slots` order.
    unique_tokens: int32 `[U]`, unique among the valid ones; a negative token
      is wrapped once, any other outside `[0, V)` (fill values) is skipped.
    grad_accum: f32 `[U, S]` summed gradients of the shard's columns.
    row_sq: f32 `[U]` full-width squared row norms (a trailing total slot,
      `[U + 1]`, is ignored).
    apply: bool scalar; when false nothing changes.
    step: int32 scalar, the updates applied so far.
    scalars: f32 scalars for the rule (learning rate, ...); may be traced.
    emb_width: the full (unsharded) width, for the rule's row part.
    interpret: run through the Pallas interpreter.
    config: tile sizes (None fields: the shape heuristic).

  Returns:
    `(table, row_state, element_state)`, the states as tuples.
  """
  row_state, element_state = tuple(row_state), tuple(element_state)
  scalars = tuple(jnp.asarray(s, jnp.float32) for s in scalars)
  row_sq = common.check_update_args(rule, table, row_state, element_state, unique_tokens,
                      grad_accum, row_sq, scalars)
  vocab_rows, width = table.shape
  (num_unique,) = unique_tokens.shape
  common.check_flat_sizes(rule.kernel_name, **{
      "table shard": table.shape, "grad_accum": grad_accum.shape})
  if num_unique == 0:
    return table, row_state, element_state
  config = resolve_config(config, num_unique, width)

  # Traced scalars travel as small arrays (bools as int32).
  inputs = (jnp.asarray(apply, jnp.int32).reshape(1),
            jnp.asarray(step, jnp.int32).reshape(1),
            jnp.stack(scalars) if scalars else jnp.zeros((1,), jnp.float32),
            unique_tokens, grad_accum.reshape(-1), row_sq)
  state = ((table.reshape(-1),) + row_state
           + tuple(e.reshape(-1) for e in element_state))
  body = functools.partial(
      _kernel, rule=rule, num_scalars=len(scalars), num_unique=num_unique,
      vocab_rows=vocab_rows, width=width, emb_width=emb_width,
      block_rows=config.block_rows, block_cols=config.block_cols,
      interpret=interpret)
  with common.quiet_triton_deprecation():
    outs = pl.pallas_call(
        _named(body, ref_names(rule)),
        out_shape=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype)
                        for s in state),
        grid=(pl.cdiv(num_unique, config.block_rows),),
        input_output_aliases={len(inputs) + i: i for i in range(len(state))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        name=rule.kernel_name,
    )(*inputs, *state)
  num_rows = len(row_state)
  return (outs[0].reshape(vocab_rows, width), tuple(outs[1:1 + num_rows]),
          tuple(o.reshape(vocab_rows, width) for o in outs[1 + num_rows:]))
