"""Registers, spills and access widths of the kernels as an H100/H200 runs them.

Lowered through the public API on a 1-device CPU mesh (`pe.lookup`,
`pe.dedup` + `pe.apply_gradients` with backend="triton" and every sparse
optimizer; `lower(lowering_platforms=("cuda",))`, no GPU needed), each
pallas_call is compiled for sm_90a with the `triton` package and its
`ptxas -v` (`pallas_emb.testing.ptx`). For shard widths 8, 64, 128, 512 and
f32 / bf16 tables, every kernel -- gather, both segment-sum kernels, the
generic sparse-update kernel with each optimizer's rule (row-wise Adagrad
eager and lazy, SGD, Adagrad, Adam, partial row-wise Adam, FTRL with the
square root and with a general power) -- must have

* zero spill bytes, and
* vector row accesses: every global load/store of a row tile (a ref holding
  `[rows, width]` data through a flat view) moves, per PTX instruction,
  `min(16, itemsize * elements_per_thread)` bytes or more, where
  `elements_per_thread = tile elements / (32 * num_warps)`: 16-byte `v4`
  accesses whenever a thread holds 16 bytes of a row, `v2` when it holds 8.
  At these widths every row is contiguous and 16-byte aligned.

Exempt, and why:

* per-row refs (one element per row: ids, tokens, sort order, run bounds,
  `row_sq`, an optimizer's row-wise state such as `row_state`, `last_step`
  or partial row-wise Adam's `v`): each lane's element belongs to a
  different row -- gathered / scattered by token, or too short a vector per
  thread -- so they are 4-byte accesses by nature;
* scalars (`apply`, `step`, the optimizer's per-step `scalars`, the piece
  kernel's key and run end);
* a row tile with fewer than 8 bytes per thread, i.e. the piece kernel's
  one reduced row `[1, block_cols]` at block_cols <= 128 over 64-128
  threads: it cannot be vectorized, and the formula above then asks for
  what it gets (one element per thread; the warp's addresses are still one
  contiguous segment).

Skips when the `triton` package (e.g. `pip install triton==3.5.1`, the
`test` extra) or jax's Pallas Triton lowering hook is missing.
"""

import logging

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import pallas_emb as pe
from pallas_emb import kernels
from pallas_emb.kernels.triton import sparse_update
from pallas_emb.optimizers import base
from pallas_emb.testing import ptx

WIDTHS = (8, 64, 128, 512)
DTYPES = ("float32", "bfloat16")
TOKENS = 16384  # a realistic batch: the heuristics size tiles by it
VOCAB = 1_000_000

# Kernel -> {ref: kind}; kind "row" must be vectorized, the others are the
# exemptions of the module docstring. A ref missing here fails the test.
REFS = {
    "pallas_emb_gather": {
        "table_ref": "row", "out_ref": "row", "ids_ref": "per_row"},
    "pallas_emb_segment_sum_pieces": {
        "grads_ref": "row", "pieces_ref": "row", "order_ref": "per_row",
        "keys_ref": "scalar", "end_ref": "scalar"},
    "pallas_emb_segment_sum": {
        "grads_ref": "row", "pieces_ref": "row", "accum_ref": "row",
        "order_ref": "per_row", "start_ref": "per_row", "end_ref": "per_row",
        "row_sq_ref": "per_row"},
}
# Row refs each kernel must show (guards against a silent attribution bug).
REQUIRED = {
    "pallas_emb_gather": {("table_ref", "load"), ("out_ref", "store")},
    "pallas_emb_segment_sum_pieces": {("grads_ref", "load"),
                                      ("pieces_ref", "store")},
    "pallas_emb_segment_sum": {("grads_ref", "load"), ("pieces_ref", "load"),
                               ("accum_ref", "store")},
}
# Every optimizer's update kernel, one per kernel name.
OPTIMIZERS = (
    pe.RowwiseAdagrad(0.1),
    pe.RowwiseAdagrad(0.1, half_life_steps=100.0, weight_decay=1e-4,
                      lazy=True),
    pe.Sgd(0.1), pe.Adagrad(0.1), pe.Adam(1e-3),
    pe.PartialRowwiseAdam(1e-3), pe.Ftrl(0.1, l1=1e-3, l2=1e-3),
    pe.Ftrl(0.1, l2=1e-3, lr_power=-0.7),
)


def update_refs(opt) -> dict[str, str]:
  """An update kernel's refs: table, gradient and element-wise state are
  rows; tokens, row_sq and row-wise state per row; the rest scalars."""
  names = sparse_update.ref_names(opt)
  per_row = {"tokens_ref", "row_sq_ref"} | {
      f"{s.name}_{io}" for s in opt.slots() if s.kind == base.ROW
      for io in ("ref", "out")}
  scalar = {"apply_ref", "step_ref", "scalars_ref"}
  return {n: "scalar" if n in scalar else "per_row" if n in per_row
          else "row" for n in names}


def update_required(opt) -> set[tuple[str, str]]:
  rows = ["table"] + [s.name for s in opt.slots() if s.kind == base.ELEMENT]
  return ({("grad_ref", "load")} | {(f"{r}_ref", "load") for r in rows}
          | {(f"{r}_out", "store") for r in rows})


_BYTES = {"b8": 1, "b16": 2, "b32": 4, "b64": 8, "f32": 4, "f16": 2, "u16": 2,
          "s32": 4, "u32": 4, "f64": 8, "u8": 1, "s16": 2, "u64": 8, "s64": 8}
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i8": 1}
SKIP_REASON = ptx.triton_available()


def access_bytes(kind: str) -> int:
  """Bytes one PTX access moves per thread, e.g. 'v4.b32' -> 16."""
  parts = kind.split(".")
  lanes = int(parts[0][1:]) if parts[0].startswith("v") else 1
  return lanes * _BYTES[parts[-1]]


def expected_bytes(access: ptx.Access, num_warps: int) -> int:
  per_thread = max(1, int(np.prod(access.shape)) // (32 * num_warps))
  return min(16, _ITEMSIZE[access.dtype] * per_thread)


def public_api_kernels(width: int, dtype: str) -> list[ptx.CapturedKernel]:
  """Every pallas_call of a lookup and of an update with each optimizer."""
  mesh = test_util.mesh({"x": 1})
  ctx = pe.make_context(mesh, "x", tokens_per_batch=TOKENS, emb_width=width,
                        num_unique=TOKENS + 1)
  table_sharding = NamedSharding(mesh, P(None, "x"))
  tokens = NamedSharding(mesh, P("x"))
  table = jax.ShapeDtypeStruct((VOCAB, width), jnp.dtype(dtype),
                               sharding=table_sharding)
  ids = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=tokens)
  grads = jax.ShapeDtypeStruct((TOKENS, width), jnp.dtype(dtype),
                               sharding=NamedSharding(mesh, P("x", None)))
  captured = ptx.capture(
      lambda t, i: pe.lookup(ctx, t, i, backend="triton"), table, ids)
  for opt in OPTIMIZERS:
    state = jax.eval_shape(lambda t, o=opt: o.init(ctx, t), table)

    def step(t, s, i, g, opt=opt):
      result = pe.dedup(ctx, i, vocab_rows=VOCAB)
      return pe.apply_gradients(ctx, opt, t, s, g, result, backend="triton")

    captured += ptx.capture(step, table, state, ids, grads)
  return captured


@absltest.skipIf(SKIP_REASON is not None, f"PTX check skipped: {SKIP_REASON}")
class PtxTest(parameterized.TestCase):

  @parameterized.product(width=WIDTHS, dtype=DTYPES)
  def test_no_spills_and_vector_row_accesses(self, width, dtype):
    kernels = public_api_kernels(width, dtype)
    names = sorted(k.name for k in kernels)
    self.assertEqual(names, sorted(
        ["pallas_emb_gather"]
        + ["pallas_emb_segment_sum_pieces", "pallas_emb_segment_sum"]
        * len(OPTIMIZERS) + [opt.kernel_name for opt in OPTIMIZERS]))
    updates = iter(OPTIMIZERS)  # the update kernels, in capture order
    for kernel in kernels:
      if kernel.name in REFS:
        refs, required = REFS[kernel.name], REQUIRED[kernel.name]
      else:
        opt = next(updates)
        self.assertEqual(kernel.name, opt.kernel_name)
        refs, required = update_refs(opt), update_required(opt)
      report = ptx.compile_kernel(kernel)
      logging.info("w=%d %s %s", width, dtype, report.row())
      where = f"{kernel.name} (width {width}, {dtype}): {report.row()}"
      self.assertEqual(report.spill_bytes, 0, f"spills in {where}")
      seen = set()
      for access in report.accesses:
        self.assertIn(access.ref, refs, f"unclassified ref {access.ref!r} in "
                      f"{where}; classify it (REFS / update_refs) with a reason")
        seen.add((access.ref, access.op))
        if refs[access.ref] != "row":
          continue
        want = expected_bytes(access, report.num_warps)
        for kind in access.widths:
          self.assertGreaterEqual(
              access_bytes(kind), want,
              f"{access.op} of {access.ref}{list(access.shape)} is {kind} "
              f"({access_bytes(kind)} bytes per thread), expected >= {want} "
              f"in {where}")
      self.assertEmpty(required - seen,
                       f"row accesses missing from {where}")

  @parameterized.parameters(*WIDTHS)
  def test_gather_of_int8_codes(self, width):
    """A row or table owner serving an int8 copy gathers its uint8 code
    rows with the gather kernel (`row._serve`): no spills, and row
    accesses as wide as the code row's alignment allows (as
    `test_quantized_gather`'s codes)."""
    (kernel,) = ptx.capture(
        lambda c, i: kernels.gather_rows(c, i, backend="triton"),
        jax.ShapeDtypeStruct((VOCAB, width), jnp.uint8),
        jax.ShapeDtypeStruct((TOKENS,), jnp.int32))
    self.assertEqual(kernel.name, "pallas_emb_gather")
    report = ptx.compile_kernel(kernel)
    logging.info("w=%d uint8 %s", width, report.row())
    where = f"width {width} uint8: {report.row()}"
    self.assertEqual(report.spill_bytes, 0, f"spills in {where}")
    refs = REFS["pallas_emb_gather"]
    seen = set()
    for access in report.accesses:
      self.assertIn(access.ref, refs, f"unclassified ref in {where}")
      seen.add((access.ref, access.op))
      if refs[access.ref] != "row":
        continue
      want = min(expected_bytes(access, report.num_warps), width & -width)
      for kind in access.widths:
        self.assertGreaterEqual(access_bytes(kind), want,
                                f"{access.op} of {access.ref} is {kind}, "
                                f"expected >= {want} bytes in {where}")
    self.assertEmpty(REQUIRED["pallas_emb_gather"] - seen,
                     f"row accesses missing from {where}")

  @parameterized.product(width=WIDTHS, pooled=(False, True))
  def test_quantized_gather(self, width, pooled):
    """The int8 serving kernels: uint8 code rows in, f32 rows out.

    A code row is `width` bytes, so a thread's contiguous codes are also
    capped by the row's alignment (8 bytes at width 8: the whole row).
    """
    rows = jax.ShapeDtypeStruct((VOCAB,), jnp.float32)
    codes = jax.ShapeDtypeStruct((VOCAB, width), jnp.uint8)
    per_row = {"ids_ref", "scale_ref", "bias_ref", "starts_ref", "rows_ref",
               "weights_ref"}
    if pooled:
      bags = TOKENS // 16
      (kernel,) = ptx.capture(
          lambda c, s, b, r, w, st: kernels.pool_dequantized(
              c, s, b, r, w, st, max_len=16, backend="triton"),
          codes, rows, rows, jax.ShapeDtypeStruct((TOKENS,), jnp.int32),
          jax.ShapeDtypeStruct((TOKENS,), jnp.float32),
          jax.ShapeDtypeStruct((bags + 1,), jnp.int32))
    else:
      (kernel,) = ptx.capture(
          lambda c, s, b, i: kernels.gather_dequantized(c, s, b, i,
                                                        backend="triton"),
          codes, rows, rows, jax.ShapeDtypeStruct((TOKENS,), jnp.int32))
    self.assertEqual(kernel.name, "pallas_emb_quantized_pool" if pooled
                     else "pallas_emb_quantized_gather")
    report = ptx.compile_kernel(kernel)
    logging.info("w=%d %s", width, report.row())
    where = f"width {width}: {report.row()}"
    self.assertEqual(report.spill_bytes, 0, f"spills in {where}")
    seen = set()
    for access in report.accesses:
      self.assertIn(access.ref, per_row | {"codes_ref", "out_ref"},
                    f"unclassified ref in {where}")
      seen.add((access.ref, access.op))
      if access.ref in per_row:
        continue
      want = expected_bytes(access, report.num_warps)
      if access.ref == "codes_ref":
        want = min(want, width & -width)
      for kind in access.widths:
        self.assertGreaterEqual(access_bytes(kind), want,
                                f"{access.op} of {access.ref} is {kind}, "
                                f"expected >= {want} bytes in {where}")
    self.assertEmpty({("codes_ref", "load"), ("out_ref", "store")} - seen,
                     f"row accesses missing from {where}")

if __name__ == "__main__":
  absltest.main()
