"""The Mosaic TPU backend on a CPU: its kernels in Pallas' TPU interpreter
against numpy models and their jnp twins, a whole training step through
them against the xla backend, its lowering for TPU, and the backend
resolution per platform.

The kernels run here through `pltpu.InterpretParams`, which forgives races
and misaligned DMAs that a chip does not: `bench/tpu_check.sh` runs these
tests on a TPU with backend "mosaic_tpu" (`PALLAS_EMB_TEST_BACKEND`).
"""

import functools
import os
import re
import types
from unittest import mock

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import adagrad_test
import gather_test
import optimizer_kernels_test
import pool_test
import pallas_emb as pe
from pallas_emb import kernels
from pallas_emb import validation
from pallas_emb.kernels import reference
from pallas_emb.kernels.mosaic_tpu import lookup
from pallas_emb.kernels.mosaic_tpu import row_write
from pallas_emb.kernels.mosaic_tpu import segment_sum
from pallas_emb.kernels.mosaic_tpu import sparse_update
from pallas_emb.kernels.mosaic_tpu import stored
from pallas_emb.kernels.mosaic_tpu import stream_update
from pallas_emb.optimizers import base

BF16 = test_util.BF16
F32 = np.float32
# The Mosaic kernels through the interpreter, or on the chip.
BACKEND = ("mosaic_tpu" if test_util.ON_TPU
           or os.environ.get("PALLAS_EMB_TEST_BACKEND") == "mosaic_tpu"
           else "mosaic_tpu_interpret")
EXACT = BACKEND == "mosaic_tpu_interpret"  # the chip's div/sqrt/exp may differ
# On the chip every (name, case) pair, unless PALLAS_EMB_TEST_PAIRS=turn
# (`bench/tpu_check.sh`'s quick run).
ALL_PAIRS = (BACKEND == "mosaic_tpu"
             and os.environ.get("PALLAS_EMB_TEST_PAIRS", "all") == "all")


def each_in_turn(names, cases):
  """Parameters: on the chip every (name, case); in the interpreter, which
  runs a kernel some hundred times slower, each name with one case, the
  cases taken in turn (each name and each case still runs)."""
  if ALL_PAIRS:
    return [dict(name=n, case=c) for n in names for c in cases]
  return [dict(name=names[i % len(names)], case=cases[i % len(cases)])
          for i in range(max(len(names), len(cases)))]


def assert_same(test, got, want, exact=EXACT):
  """Bit for bit in the interpreter; within a few ulps on the chip."""
  if exact:
    test_util.assert_bits_equal(test, got, want)
    return
  got, want = test_util.as_numpy(got), np.asarray(want)
  rtol = 1e-5 if got.dtype == F32 else 2**-7
  np.testing.assert_allclose(got.astype(F32), want.astype(F32), rtol=rtol,
                             atol=1e-6)


def xla_tpu_bf16_read(bits: np.ndarray) -> np.ndarray:
  """The bf16 bit patterns `bits` (uint16) as XLA:TPU reads them: on a
  v5e (JAX 0.10.2), a jitted `lax.bitcast_convert_type` of a bf16 array to
  uint16, or a jitted pad of it, gave the NaNs 0x7FC1 and 0xFFFF as
  0x7FC0 and the subnormals 0x0001 and 0x8001 as zeros of their sign, and
  kept infinities, -0 and normal values, while a device_put round trip
  and a Mosaic kernel's bitcast kept them all. Modelled for every NaN
  and subnormal (docs/tpu.md, "bf16 bits on a TPU")."""
  exponent, mantissa = bits & 0x7F80, bits & 0x007F
  out = np.where(exponent == 0, bits & 0x8000, bits)
  return np.where((exponent == 0x7F80) & (mantissa != 0), 0x7FC0,
                  out).astype(np.uint16)


class LookupKernelTest(parameterized.TestCase):

  @parameterized.product(width=(8, 64, 128, 200), dtype=(F32, BF16),
                         method=("xla", "dma"))
  def test_gather_matches_model(self, width, dtype, method):
    """Edge ids (negative, past the end, int32 extremes) and duplicates;
    37 ids: a partial last tile. From the stored table and the logical."""
    table = gather_test.random_table(width, 50, width, dtype)
    ids = gather_test.edge_ids(width, 37, 50)
    ids[-5:] = ids[:5]
    want = gather_test.np_gather(table, ids)
    kept = stored.to_stored(jnp.asarray(table))
    out = lookup.gather_rows(kept, jnp.asarray(ids), width=width,
                             method=method, interpret=EXACT)
    test_util.assert_bits_equal(self, out, want)
    out = kernels.gather_rows(jnp.asarray(table), jnp.asarray(ids),
                              backend=BACKEND)
    test_util.assert_bits_equal(self, out, want)

  def test_xla_tpu_bf16_read_model(self):
    """The model below: NaNs as the one quiet NaN, subnormals as zeros of
    their sign, every other pattern as it is."""
    got = xla_tpu_bf16_read(np.array(
        [0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x807F, 0x8000, 0x0080, 0xFF80,
         0x7F80, 0x3F80, 0xC000], np.uint16))
    np.testing.assert_array_equal(got, [
        0x7FC0, 0x7FC0, 0x7FC0, 0x0000, 0x8000, 0x8000, 0x0080, 0xFF80,
        0x7F80, 0x3F80, 0xC000])

  @parameterized.product(width=(8, 63, 64, 200, 256),
                         convert=("pairs", "matmul", "auto"),
                         leading=((9,), (2, 5)))
  def test_bf16_words_match_numpy_model(self, width, convert, leading):
    """Every bf16 bit pattern (NaNs, infinities, -0, subnormals) reaches
    its word and comes back, by either pairing: column 2j in word j's low
    half, 2j + 1 in its high half, zeros past the columns. On a TPU, as
    XLA:TPU reads bf16 (`xla_tpu_bf16_read`)."""
    rng = np.random.default_rng(width)
    bits = rng.integers(0, 1 << 16, size=leading + (width,)).astype(np.uint16)
    bits.reshape(-1)[:8] = [0x7FC1, 0xFF80, 0x8000, 0x0001, 0xFFFF, 0x7F80,
                            0x8001, 0x0080]
    table = bits.view(BF16)
    if jax.default_backend() == "tpu":
      bits = xla_tpu_bf16_read(bits)
    padded = np.zeros(leading + (stored.stored_width(width, BF16) * 2,),
                      np.uint32)
    padded[..., :width] = bits
    want = padded[..., 0::2] | padded[..., 1::2] << 16
    with mock.patch.object(stored, "BF16_CONVERT", convert):
      kept = stored.to_stored(jnp.asarray(table))
      back = stored.from_stored(kept, width, BF16)
    self.assertEqual(kept.dtype, jnp.uint32)
    np.testing.assert_array_equal(np.asarray(kept), want[..., :kept.shape[-1]])
    np.testing.assert_array_equal(np.asarray(back).view(np.uint16), bits)

  def test_auto_pairing_is_the_matmul_on_a_tpu_only(self):
    """"auto" lowers to "matmul" for a TPU (it compiled 20x faster there)
    and to "pairs" for a CPU (6x faster there), each a program with only
    its own pairing."""
    table = jax.ShapeDtypeStruct((10, 64), BF16)
    words = jax.ShapeDtypeStruct((10, 128), jnp.uint32)
    for platform, dots in (("tpu", 2), ("cpu", 0)):
      for fn, arg, n in ((stored.to_stored, table, dots),
                         (lambda w: stored.from_stored(w, 64, BF16), words,
                          dots // 2)):
        text = jax.jit(fn).trace(arg).lower(
            lowering_platforms=(platform,)).as_text()
        self.assertEqual(text.count("stablehlo.dot_general"), n,
                         (platform, fn))

  @parameterized.product(width=(8, 64, 200, 256), dtype=(F32, BF16))
  def test_stored_layout_round_trips(self, width, dtype):
    """Whole 128-lane rows of words; bf16 column 2j in a word's low half;
    the gradient layout's columns (`to_grads`) invert too."""
    table = jnp.asarray(gather_test.random_table(width, 9, width, dtype))
    kept = stored.to_stored(table)
    self.assertEqual(kept.shape[1] % 128, 0)
    words = np.asarray(kept)
    if dtype == BF16:
      self.assertEqual(kept.dtype, jnp.uint32)
      bits = np.asarray(table).view(np.uint16).astype(np.uint32)
      np.testing.assert_array_equal(words[:, 0], bits[:, 0] | bits[:, 1] << 16)
    test_util.assert_bits_equal(
        self, stored.from_stored(kept, width, dtype), np.asarray(table))
    grads = jnp.asarray(np.random.default_rng(0).normal(size=(9, width)),
                        jnp.float32)
    laid = stored.to_grads(grads, dtype)
    self.assertEqual(laid.shape[1], stored.grad_width(width, dtype))
    if dtype == BF16:  # up to 128 columns, one 128-lane row as for f32
      self.assertEqual(laid.shape[1], 128 if width <= 128 else 256)
    test_util.assert_bits_equal(self, stored.from_grads(laid, width, dtype),
                                np.asarray(grads))

  def test_grad_layout_matches_numpy_model(self):
    """`to_grads` of a bf16 gradient: its even columns, then its odd ones,
    each padded to `high_offset` (odd widths, one 128-lane row or two,
    3-D inputs)."""
    rng = np.random.default_rng(1)
    for shape in ((9, 7), (9, 64), (5, 128), (4, 3, 200), (6, 256)):
      grads = rng.standard_normal(shape).astype(F32)
      half = stored.high_offset(shape[-1], BF16)
      pad = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1)
                             + [(0, half - x.shape[-1])])
      want = np.concatenate([pad(grads[..., 0::2]), pad(grads[..., 1::2])],
                            axis=-1)
      test_util.assert_bits_equal(
          self, stored.to_grads(jnp.asarray(grads), BF16), want)

  def test_gather_empty(self):
    out = kernels.gather_rows(jnp.ones((5, 8)), jnp.zeros((0,), jnp.int32),
                              backend=BACKEND)
    self.assertEqual(out.shape, (0, 8))

  @parameterized.product(width=(8, 64, 128), dtype=(jnp.float32,
                                                     jnp.bfloat16),
                         method=("dma", "xla", "xla_loop"))
  def test_pool_matches_model_and_twin(self, width, dtype, method):
    """29 bags of 0-5 entries (weights 0 on a fifth, ids out of range);
    "xla_loop": the xla pool's loop over positions, not unrolled."""
    rng = np.random.default_rng(width)
    args = pool_test.random_case(rng, 37, width, 29, 5, dtype)
    unroll = 0 if method == "xla_loop" else lookup.XLA_POOL_UNROLL
    with mock.patch.object(lookup, "POOL_METHOD", method[:3]), \
        mock.patch.object(lookup, "XLA_POOL_UNROLL", unroll):
      out = kernels.pool_rows(*args, max_len=5, backend=BACKEND)
    assert_same(self, out, test_util.as_numpy(
        reference.pool_rows(*args, max_len=5)))
    want, scale = pool_test.model(*(np.asarray(a) for a in args))
    ulp = 0.0 if dtype == jnp.float32 else 2.0**-8
    err = np.abs(test_util.as_numpy(out).astype(np.float64) - want)
    self.assertTrue((err <= ulp * np.abs(want) + 8 * 2.0**-24 * scale
                     + 1e-30).all(), err.max())

  @parameterized.product(method=("dma", "xla"), dtype=(jnp.float32,
                                                       jnp.bfloat16))
  def test_pool_of_full_bags(self, method, dtype):
    """Bags all of one length known before tracing: no mask; inside a jit
    (bag starts traced), the masked form: the same bits."""
    rng = np.random.default_rng(11)
    table = jnp.asarray(rng.standard_normal((40, 64)), dtype)
    rows = jnp.asarray(rng.integers(-42, 43, 13 * 4), jnp.int32)
    weights = jnp.asarray(rng.standard_normal(13 * 4), jnp.float32)
    starts = np.arange(0, 13 * 4 + 1, 4, dtype=np.int32)
    want = test_util.as_numpy(reference.pool_rows(
        table, rows, weights, jnp.asarray(starts), max_len=4))
    with mock.patch.object(lookup, "POOL_METHOD", method):
      pool = lambda s: kernels.pool_rows(table, rows, weights, s, max_len=4,
                                         backend=BACKEND)
      assert_same(self, pool(starts), want)
      assert_same(self, jax.jit(pool)(starts), want)

  def test_pool_of_bags_too_long_for_a_tile(self):
    """16 bags x 600 entries x 256 columns pass the tile limit: the xla
    backend's pooling, the same bits."""
    rng = np.random.default_rng(3)
    args = pool_test.random_case(rng, 50, 256, 5, 600, jnp.float32)
    out = kernels.pool_rows(*args, max_len=600, backend=BACKEND)
    test_util.assert_bits_equal(self, out, test_util.as_numpy(
        reference.pool_rows(*args, max_len=600)))
    # "auto" pools bags of at most XLA_POOL_UNROLL entries by XLA's gathers.
    for max_len, method, kernel in ((600, "dma", False), (5, "dma", True),
                                    (5, "auto", False), (40, "auto", True)):
      # A new function each time: jit would reuse the trace of the same one.
      pool = lambda *a, max_len: kernels.pool_rows(*a, max_len=max_len,
                                                   backend="mosaic_tpu")
      with mock.patch.object(lookup, "POOL_METHOD", method):
        text = jax.jit(pool, static_argnames="max_len").trace(
            *args, max_len=max_len).lower(
                lowering_platforms=("tpu",)).as_text()
      self.assertEqual("pallas_emb_pool_tpu" in text, kernel,
                       (max_len, method))

  def test_pool_f32_output_of_a_bf16_table(self):
    rng = np.random.default_rng(7)
    args = pool_test.random_case(rng, 20, 16, 9, 3, jnp.bfloat16)
    out = kernels.pool_rows(*args, max_len=3, backend=BACKEND,
                            out_dtype=jnp.float32)
    self.assertEqual(out.dtype, jnp.float32)
    assert_same(self, out, test_util.as_numpy(reference.pool_rows(
        *args, max_len=3, out_dtype=jnp.float32)))


def _update_fn(opt, backend, width, sorted_tokens, table, rows, elements,
               tokens, grad_accum, row_sq, apply, scalars):
  args = (opt, table, rows, elements, tokens, grad_accum, row_sq, apply,
          jnp.int32(optimizer_kernels_test.STEP), scalars)
  emb_width = optimizer_kernels_test.RANKS * width
  if backend == "reference":
    return reference.sparse_update(*args, emb_width=emb_width)
  return kernels.sparse_update_rows(*args, emb_width=emb_width,
                                    backend=backend,
                                    sorted_tokens=sorted_tokens)


def _update_args(opt, args, apply):
  step = jnp.int32(optimizer_kernels_test.STEP)
  return tuple(args) + (jnp.asarray(apply), opt.scalars(step))


def _update(opt, backend, args, width, apply=True, sorted_tokens=False):
  """One update with the scalars traced, as a step computes them (a
  constant learning rate folded into a division is rewritten by XLA, which
  the kernel, opaque to it, is not)."""
  out = jax.jit(functools.partial(_update_fn, opt, backend, width,
                                  sorted_tokens))(
                                      *_update_args(opt, args, apply))
  return jax.tree.map(np.asarray, out)


def _sorted_inputs(opt, width, dtype, vocab, distinct=None, seed=0):
  """A table of `vocab` rows, its optimizer's states and a dedup's buffer:
  `distinct` ascending rows (a zero gradient among them), three rows past
  the table, then fill values; gradients zero past the kept rows."""
  rng = np.random.default_rng(seed)
  distinct = distinct or vocab // 3
  size = distinct + distinct // 8 + 8
  tokens = np.full(size, np.iinfo(np.int32).max, np.int32)
  tokens[:distinct] = np.sort(rng.choice(vocab, distinct, replace=False))
  tokens[distinct:distinct + 3] = vocab + np.array([0, 5, 9])
  table = rng.standard_normal((vocab, width)).astype(F32).astype(dtype)
  rows, elements = [], []
  for slot in opt.slots():
    shape = (vocab,) if slot.kind == base.ROW else (vocab, width)
    if np.dtype(slot.dtype) == np.int32:
      array = rng.integers(0, optimizer_kernels_test.STEP + 1, shape)
      array = array.astype(np.int32)
    elif slot.name in ("m", "linear"):  # signed state
      array = rng.standard_normal(shape).astype(F32)
    else:  # accumulators and second moments are positive
      array = rng.uniform(0.05, 2.0, shape).astype(F32)
    (rows if slot.kind == base.ROW else elements).append(array)
  grad_accum = rng.standard_normal((size, width)).astype(F32)
  grad_accum[distinct // 2] = 0
  grad_accum[distinct:] = 0
  row_sq = (adagrad_test.np_round(grad_accum, dtype) ** 2).sum(
      axis=1).astype(F32) * optimizer_kernels_test.RANKS
  return table, tuple(rows), tuple(elements), tokens, grad_accum, row_sq


class GradSumsKernelTest(parameterized.TestCase):
  """`segment_sum.grad_sums` against a float32 numpy model (products rounded
  on their own, summed per slot in entry order) and its jnp twin
  (`jax.ops.segment_sum` of the weighted rows), over several entry blocks
  and several passes of slots (both made small here), in its windowed and
  its sorted form (slot buffers of U not a multiple of 8, few live slots),
  and the sorted form's walk given the entries in slot order (entries of
  no slot among them, as the dedup leaves a full region's)."""

  @parameterized.parameters((128, 40, 40, "windowed"), (256, 40, 23, "windowed"),
                            (128, 43, 43, "sorted"), (256, 45, 37, "sorted"),
                            (128, 6, 5, "sorted"), (128, 43, 40, "slot_sorted"),
                            (256, 9, 9, "slot_sorted"))
  def test_matches_model_and_twin(self, width, num_slots, live, method):
    rng = np.random.default_rng(width + live)
    num_rows = 150
    entry_rows = np.repeat(np.arange(num_rows, dtype=np.int32),
                           rng.integers(0, 4, num_rows))
    n = entry_rows.size
    rows = rng.standard_normal((num_rows, width)).astype(F32)
    weights = rng.standard_normal(n).astype(F32)
    slots = rng.integers(0, live, n).astype(np.int32)
    slots[rng.random(n) < 0.1] = -1  # entries that take no slot
    slots[rng.random(n) < 0.05] = num_slots  # past the buffer: none either
    # Every live slot is taken (a dedup's slots are a prefix).
    slots[rng.choice(n, live, replace=False)] = np.arange(live)
    given = (entry_rows, slots, weights)
    if method == "slot_sorted":
      # Stable by slot, then the no-slot entries spread between the slots'
      # runs (a full region's keys sort between the kept ones).
      order = np.argsort(np.where((slots >= 0) & (slots < num_slots), slots,
                                  num_slots), kind="stable")
      taken = order[(slots[order] >= 0) & (slots[order] < num_slots)]
      run_starts = np.flatnonzero(np.diff(slots[taken], prepend=-2))
      order = np.insert(taken, rng.choice(run_starts, n - taken.size),
                        np.setdiff1d(order, taken))
      given = (entry_rows[order], slots[order], weights[order])
    with mock.patch.object(segment_sum, "ENTRY_BLOCK", 64), \
         mock.patch.object(segment_sum, "SUMS_BYTES", 4 * width * 16):
      got = segment_sum.grad_sums(
          jnp.asarray(rows), jnp.asarray(given[0]), jnp.asarray(given[1]),
          jnp.asarray(given[2]), num_slots, jnp.int32(live),
          method="sorted" if method == "slot_sorted" else method,
          slot_sorted=method == "slot_sorted",
          interpret=BACKEND == "mosaic_tpu_interpret")
    want = np.zeros((num_slots, width), F32)
    for e in range(n):
      if 0 <= slots[e] < num_slots:
        want[slots[e]] += weights[e] * rows[entry_rows[e]]
    # The sorted form leaves the slots past the live ones unwritten.
    shown = num_slots if method == "windowed" else live
    test_util.assert_bits_equal(self, got[:shown], want[:shown])
    keep = (slots >= 0) & (slots < num_slots)
    twin = jax.ops.segment_sum(
        jnp.where(keep[:, None], weights[:, None] * rows[entry_rows], 0.0),
        np.where(keep, slots, 0), num_segments=num_slots)
    np.testing.assert_allclose(np.asarray(got[:shown]),
                               np.asarray(twin[:shown]), rtol=1e-5, atol=1e-5)


  @parameterized.parameters((F32, 64, 40, 29), (BF16, 64, 40, 17),
                            (F32, 200, 24, 24), (BF16, 16, 9, 0))
  def test_row_norms_stop_at_the_used_slots(self, dtype, width, num_slots,
                                            used):
    """`update.logical_row_sums` never reads the slots the sorted form
    leaves unwritten (NaN here), in one piece and a chunk at a time."""
    rng = np.random.default_rng(used)
    logical = rng.standard_normal((num_slots, width)).astype(F32)
    sums = np.array(stored.to_grads(jnp.asarray(logical), dtype))
    sums[used:] = np.nan
    # A float64 model: the rounded columns' squares summed per used slot.
    rounded = np.asarray(jnp.asarray(logical).astype(dtype).astype(F32),
                         np.float64)
    want = np.where(np.arange(num_slots) < used, (rounded ** 2).sum(1), 0)
    for chunk in (64, 8):
      with mock.patch.object(pe.update, "ROW_SUM_CHUNK", chunk):
        got = np.asarray(pe.update.logical_row_sums(
            jnp.asarray(sums), width, dtype, jnp.int32(used)))
      np.testing.assert_allclose(got[:-1], want, rtol=1e-5)
      np.testing.assert_allclose(got[-1], want.sum(), rtol=1e-5)


  @parameterized.parameters(2, 4, 8, 16, 32, 64, 128, 256)
  def test_row_norms_from_split_columns_have_the_same_bits(self, width):
    """`ROW_SUMS_SPLIT`: a bf16 stack's norms from its even and odd
    gradient columns as they are, bit for bit the logical columns' (every
    power-of-two width; large, tiny, infinite and NaN values; in one piece
    and by chunks)."""
    rng = np.random.default_rng(width)
    logical = (rng.standard_normal((40, width))
               * 10.0 ** rng.integers(-30, 30, (40, width))).astype(F32)
    logical[3, 0], logical[5, -1], logical[7, width // 2] = (
        np.inf, np.nan, -np.inf)
    sums = stored.to_grads(jnp.asarray(logical), BF16)
    for used, chunk in ((None, 64), (jnp.int32(29), 64), (jnp.int32(29), 8)):
      got = {}
      for split in (False, True):
        with mock.patch.object(pe.update, "ROW_SUMS_SPLIT", split), \
            mock.patch.object(pe.update, "ROW_SUM_CHUNK", chunk):
          got[split] = np.asarray(pe.update.logical_row_sums(
              sums, width, BF16, used))
      np.testing.assert_array_equal(got[True].view(np.uint32),
                                    got[False].view(np.uint32))


class SparseUpdateTest(parameterized.TestCase):

  @parameterized.parameters(*each_in_turn(
      list(optimizer_kernels_test.OPTIMIZERS),
      ((F32, 8), (BF16, 64), (F32, 128), (BF16, 8), (BF16, 128))))
  def test_matches_twin(self, name, case):
    """The 14 slots of adagrad_test (every token rule, a zero gradient)."""
    dtype, width = case
    opt = optimizer_kernels_test.OPTIMIZERS[name]
    args = optimizer_kernels_test.inputs(opt, width, width, dtype)
    got = _update(opt, BACKEND, args, width)
    want = _update(opt, "reference", args, width)
    # Partial row-wise Adam's `m / correction1 / denominator`: XLA's
    # simplifier regroups the twin's divisions (one rounding fewer), the
    # interpreter runs the kernel's as written; a float32 numpy model of the
    # formula agrees with the kernel where they differ (1-8 ulps).
    exact = EXACT and name != "partial_rowwise_adam"
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert_same(self, g, w, exact)
    trained = (optimizer_kernels_test.TRAINED
               + [optimizer_kernels_test.ZERO_GRAD_ROW] * opt.updates_zero_rows)
    keep = sorted(set(range(adagrad_test.VOCAB)) - set(trained))
    for new, old in zip(jax.tree.leaves(got), jax.tree.leaves(args[:3])):
      test_util.assert_bits_equal(self, new[keep], np.asarray(old)[keep])
    self.assertFalse(np.array_equal(got[0][3], args[0][3]))

  @parameterized.product(hp=list(adagrad_test.HPARAMS), dtype=(F32, BF16))
  def test_rowwise_adagrad_matches_numpy_model(self, hp, dtype):
    hparams = adagrad_test.HPARAMS[hp]
    args = adagrad_test.adagrad_inputs(3, 24, dtype, lazy=hparams.lazy)
    got = adagrad_test.run_adagrad(BACKEND, args, hparams)
    want = adagrad_test.np_adagrad(*args, apply=True, step=9, lr=0.1,
                                   hp=hparams)
    for g, w in zip(got, want):
      if w is not None:
        rtol = 1e-6 if g.dtype == F32 else 2**-7
        np.testing.assert_allclose(g.astype(F32), w.astype(F32), rtol=rtol,
                                   atol=1e-6)

  @parameterized.parameters(*each_in_turn(
      list(optimizer_kernels_test.OPTIMIZERS),
      ((F32, 64, 2500), (BF16, 16, 2048), (F32, 200, 700), (BF16, 128, 3000),
       (BF16, 200, 1100))))
  def test_stream_matches_twin(self, name, case):
    """The table streamed (`stream_update`, tokens ascending): several
    blocks (a partial last one unless V is a multiple of the block), rows
    past the table and fill values skipped, a zero gradient; untouched
    rows keep their bits."""
    dtype, width, vocab = case
    opt = optimizer_kernels_test.OPTIMIZERS[name]
    args = _sorted_inputs(opt, width, dtype, vocab)
    with mock.patch.object(sparse_update, "STREAM", "always"):
      got = _update(opt, BACKEND, args, width, sorted_tokens=True)
    want = _update(opt, "reference", args, width)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert_same(self, g, w)
    trained = np.asarray(args[3])[np.asarray(args[3]) < vocab]
    keep = sorted(set(range(vocab)) - set(trained.tolist()))
    for new, old in zip(jax.tree.leaves(got), jax.tree.leaves(args[:3])):
      test_util.assert_bits_equal(self, new[keep], np.asarray(old)[keep])
    self.assertFalse(np.array_equal(got[0][trained[1]],
                                    np.asarray(args[0])[trained[1]]))

  def test_stream_not_applied_changes_nothing(self):
    opt = optimizer_kernels_test.OPTIMIZERS["rowwise_adagrad_lazy"]
    args = _sorted_inputs(opt, 16, BF16, 2048)
    with mock.patch.object(sparse_update, "STREAM", "always"):
      got = _update(opt, BACKEND, args, 16, apply=False, sorted_tokens=True)
    for g, given in zip(jax.tree.leaves(got), jax.tree.leaves(args[:3])):
      test_util.assert_bits_equal(self, g, given)

  def test_stream_is_picked_by_the_share_of_rows_touched(self):
    """"auto" streams a table when the batch touches enough of it: the
    same bits either way, and the TPU program holds both kernels."""
    opt = pe.RowwiseAdagrad(0.1)
    for distinct in (3, 1500):  # rows, then the stream
      args = _sorted_inputs(opt, 64, F32, 2500, distinct=distinct)
      got = _update(opt, BACKEND, args, 64, sorted_tokens=True)
      want = _update(opt, "reference", args, 64)
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same(self, g, w)
    used = lambda n: stream_update.worth_streaming(2500, 4 * 129, 1, 1,
                                                   jnp.int32(n))
    self.assertFalse(bool(used(3)))
    self.assertTrue(bool(used(1500)))
    text = jax.jit(functools.partial(
        _update_fn, opt, "mosaic_tpu", 64, True)).trace(
            *_update_args(opt, args, True)).lower(
                lowering_platforms=("tpu",)).as_text()
    for kernel in ("pallas_emb_adagrad_tpu", "pallas_emb_adagrad_stream_tpu"):
      self.assertIn(kernel, text)

  def test_not_applied_changes_nothing(self):
    opt = optimizer_kernels_test.OPTIMIZERS["adam"]
    args = optimizer_kernels_test.inputs(opt, 3, 16, BF16)
    got = _update(opt, BACKEND, args, 16, apply=False)
    for g, given in zip(jax.tree.leaves(got), jax.tree.leaves(args[:3])):
      test_util.assert_bits_equal(self, g, given)


class RowWriteKernelTest(parameterized.TestCase):
  """The host tier's swap writes its rows into the cache by DMA."""

  @parameterized.parameters(
      (1000, 128, 37, F32), (64, 256, 64, np.uint32), (5000, 128, 600, F32),
      (40, 128, 0, F32))
  def test_matches_numpy_model_and_twin(self, rows, width, n, dtype):
    rng = np.random.default_rng(rows + n)
    draw = lambda shape: rng.integers(0, 2**32, shape, np.uint32).view(dtype)
    array, values = draw((rows, width)), draw((n, width))
    # Unique slots, some outside the array (skipped: the swap's padding).
    slots = (rng.permutation(rows + 20)[:n] - 10).astype(np.int32)
    want = array.copy()
    for k, slot in enumerate(slots):
      if 0 <= slot < rows:
        want[slot] = values[k]
    got = jax.jit(functools.partial(
        row_write.write_rows, interpret=BACKEND != "mosaic_tpu"),
                  donate_argnums=0)(jnp.asarray(array), slots, values)
    test_util.assert_bits_equal(self, got, want)
    test_util.assert_bits_equal(
        self, row_write.write_rows_twin(jnp.asarray(array), slots, values),
        want)

  def test_refuses_arrays_it_cannot_write(self):
    with self.assertRaisesRegex(ValueError, r"float32\[10, 64\].*128"):
      row_write.write_rows(jnp.zeros((10, 64)), jnp.zeros(2, jnp.int32),
                           jnp.zeros((2, 64)))

  def test_lowers_for_tpu_in_place(self):
    text = jax.jit(row_write.write_rows, donate_argnums=0).trace(
        jax.ShapeDtypeStruct((4096, 128), F32),
        jax.ShapeDtypeStruct((300,), np.int32),
        jax.ShapeDtypeStruct((300, 128), F32)).lower(
            lowering_platforms=("tpu",)).as_text()
    self.assertEqual(set(MOSAIC_KERNELS.findall(text)),
                     {"pallas_emb_write_rows_tpu"})
    self.assertIn("output_operand_alias", text)


def _collection(backend, dtype, width, placement="column",
                optimizer=pe.RowwiseAdagrad(0.1),
                ranks=min(2, jax.device_count())):  # a v5e host: 1 chip
  tables = [pe.TableSpec("items", 300, width, optimizer=optimizer,
                         dtype=dtype, placement=placement),
            pe.TableSpec("tags", 40, width, optimizer=optimizer, dtype=dtype,
                         placement=placement)]
  features = [pe.FeatureSpec("history", "items"),
              pe.FeatureSpec("tags", "tags", combiner="mean"),
              pe.FeatureSpec("clicks", "items", combiner="sum")]
  return pe.EmbeddingCollection(tables, features,
                                test_util.mesh({"x": ranks}), "x",
                                backend=backend)


def _batch(seed, batch=8):
  rng = np.random.default_rng(seed)
  return {"history": jnp.asarray(rng.integers(-2, 300, (batch, 6)),
                                 jnp.int32),
          "tags": jnp.asarray(rng.integers(0, 40, (batch, 3)), jnp.int32),
          "clicks": jnp.asarray(rng.integers(0, 300, (batch, 5)), jnp.int32)}


def _step(coll, state, batch):
  emb, routing = coll.lookup_and_route(state, batch)
  grads = jax.grad(lambda e: sum(
      jnp.sum(jnp.sin(v.astype(jnp.float32))) for v in e.values()))(emb)
  return coll.apply_gradients(state, routing, grads)[0], emb


class CollectionStepTest(parameterized.TestCase):
  """A whole step (lookup, exchange, dedup, update) on the Mosaic kernels
  equals the xla backend's."""

  @parameterized.parameters(*each_in_turn(
      ("rowwise_adagrad", "adam"),
      ((jnp.float32, 64, "column"), (jnp.bfloat16, 128, "column"),
       (jnp.float32, 16, "row"), (jnp.bfloat16, 16, "table"),
       (jnp.float32, 16, "replicated"),
       # A whole 128-column bf16 table on a rank: its gradient layout has
       # 128 columns too (only the backend tells the two apart).
       (jnp.bfloat16, 128, "table"))))
  def test_two_steps_match_xla(self, name, case):
    """These tables are small: "auto" streams them (`stream_update`)."""
    self._check_two_steps(name, case)

  @parameterized.parameters(*each_in_turn(
      ("rowwise_adagrad", "adam"),
      ((jnp.float32, 64, "column"), (jnp.bfloat16, 128, "table"))))
  def test_two_steps_by_rows_match_xla(self, name, case):
    """The row kernel (each touched row by DMA), never the stream."""
    with mock.patch.object(sparse_update, "STREAM", "never"):
      self._check_two_steps(name, case)

  def _check_two_steps(self, name, case):
    dtype, width, placement = case
    opt = {"rowwise_adagrad": pe.RowwiseAdagrad(0.1),
           "adam": pe.Adam(0.01)}[name]
    tables = {}
    for backend in ("xla", BACKEND):
      coll = _collection(backend, dtype, width, placement, opt)
      state = coll.init(jax.random.key(0))
      step = jax.jit(lambda s, b, coll=coll: _step(coll, s, b))
      for seed in (1, 2):
        state, emb = step(state, _batch(seed))
      tables[backend] = coll.table_arrays(state)
      tables[backend + "_emb"] = emb
      tables[backend + "_opt"] = coll.optimizer_arrays(state)
    for name in ("items", "tags"):
      assert_same(self, tables[BACKEND][name], tables["xla"][name])
    for name, emb in tables[BACKEND + "_emb"].items():
      assert_same(self, emb, tables["xla_emb"][name])
    for got, want in zip(jax.tree.leaves(tables[BACKEND + "_opt"]),
                         jax.tree.leaves(tables["xla_opt"])):
      assert_same(self, got, want)

  @parameterized.product(dtype=(jnp.float32, jnp.bfloat16),
                         placement=("column", "row"))
  def test_state_is_stored_and_converts_at_the_edges(self, dtype, placement):
    """The state holds whole 128-lane rows of words (bf16 packed, each
    rank's columns on their own); its logical tables and optimizer state
    move to the xla backend and back bit for bit (what checkpoints do).
    No step: `test_two_steps_match_xla` runs those."""
    coll = _collection(BACKEND, dtype, 48, placement, pe.Adam(0.01))
    other = _collection("xla", dtype, 48, placement, pe.Adam(0.01))
    state = test_util.random_state(other, 4)
    rng = np.random.default_rng(5)
    tables = other.table_arrays(state)
    opts = jax.tree.map(  # random moments, not zeros
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        if x.ndim == 2 else x, other.optimizer_arrays(state))
    kept = coll.state_from_arrays(tables, opts)
    stack = coll.plan.stacks[0]
    table = kept.stacks[stack.name].table
    ranks = stack.ranks if placement == "column" else 1
    self.assertEqual(table.shape, (stack.total_rows, 128 * ranks))
    self.assertEqual(table.dtype, jnp.uint32 if dtype == jnp.bfloat16
                     else jnp.float32)
    for got, want in zip(jax.tree.leaves((coll.table_arrays(kept),
                                          coll.optimizer_arrays(kept))),
                         jax.tree.leaves((tables, opts))):
      test_util.assert_bits_equal(self, got, want)
    if placement == "column" and ranks > 1:  # rank 1's block: column 24 on
      words = np.asarray(table)[:300]
      logical = np.asarray(tables["items"])
      if dtype == jnp.bfloat16:
        bits = logical.view(np.uint16).astype(np.uint32)
        np.testing.assert_array_equal(words[:, 128], bits[:, 24]
                                      | bits[:, 25] << 16)
      else:
        np.testing.assert_array_equal(words[:, 128], logical[:, 24])


MOSAIC_KERNELS = re.compile(r'kernel_name = "(pallas_emb_\w+_tpu)"')


class TpuLoweringTest(parameterized.TestCase):
  """The step lowers for TPU from a CPU, with the Mosaic kernels in it."""

  @parameterized.product(dtype=(jnp.float32, jnp.bfloat16),
                         width=(64, 128),
                         optimizer=("rowwise_adagrad", "lazy_decay", "ftrl"))
  def test_step_lowers_with_mosaic_calls(self, dtype, width, optimizer):
    opt = {"rowwise_adagrad": pe.RowwiseAdagrad(0.1),
           # `common.decay_exp` in the kernels' row-wise part.
           "lazy_decay": pe.RowwiseAdagrad(0.1, lazy=True,
                                           weight_decay=0.01),
           "ftrl": pe.Ftrl(0.1)}[optimizer]
    coll = _collection("mosaic_tpu", dtype, width, optimizer=opt)
    state = jax.eval_shape(coll.init, jax.random.key(0))
    batch = jax.eval_shape(lambda: _batch(0, batch=64))
    text = jax.jit(lambda s, b: _step(coll, s, b)).trace(
        state, batch).lower(lowering_platforms=("tpu",)).as_text()
    # The sequence gather and the pool of short bags are XLA's
    # (`lookup.GATHER_METHOD`, `POOL_METHOD`); the gradient rows fit in VMEM
    # (`segment_sum.SORTED_ROWS_BYTES`); the update by rows or by streaming
    # the table, picked at run time (`sparse_update.STREAM`).
    self.assertEqual(
        set(MOSAIC_KERNELS.findall(text)),
        {"pallas_emb_sorted_grad_sums_tpu", opt.kernel_name + "_tpu",
         opt.kernel_name + "_stream_tpu"})
    self.assertNotIn("triton", text)

  @parameterized.parameters("row", "table", "replicated")
  def test_every_placement_lowers_with_mosaic_calls(self, placement):
    coll = _collection("mosaic_tpu", jnp.float32, 64, placement,
                       pe.Adam(0.01))
    state = jax.eval_shape(coll.init, jax.random.key(0))
    batch = jax.eval_shape(lambda: _batch(0, batch=64))
    with mock.patch.object(lookup, "POOL_METHOD", "dma"):  # the kernel too
      text = jax.jit(lambda s, b: _step(coll, s, b)).trace(
          state, batch).lower(lowering_platforms=("tpu",)).as_text()
    kernels_in = set(MOSAIC_KERNELS.findall(text))
    self.assertIn("pallas_emb_adam_tpu", kernels_in)
    self.assertIn("pallas_emb_pool_tpu", kernels_in)
    self.assertNotIn("triton", text)


def _fake_mesh(platform):
  device = types.SimpleNamespace(platform=platform)
  return types.SimpleNamespace(devices=np.array([device], dtype=object))


class BackendResolutionTest(parameterized.TestCase):

  @parameterized.parameters(
      ("cpu", None, "xla"), ("cpu", "auto", "xla"), ("gpu", None, "triton"),
      ("cuda", "pallas", "triton"), ("tpu", None, "mosaic_tpu"),
      ("tpu", "pallas", "mosaic_tpu"), ("tpu", "mosaic_tpu", "mosaic_tpu"),
      ("cpu", "mosaic_tpu", "mosaic_tpu"), ("cpu", "triton", "triton"),
      ("tpu", "interpret", "interpret"), ("gpu", "xla", "xla"))
  def test_resolves(self, platform, backend, want):
    self.assertEqual(
        validation.resolve_backend(_fake_mesh(platform), backend), want)

  @parameterized.parameters(
      ("cpu", "pallas", "has no Pallas backend on platform 'cpu'"),
      ("tpu", "triton", "backend='triton' does not run on platform 'tpu'"),
      ("gpu", "mosaic_tpu",
       "backend='mosaic_tpu' does not run on platform 'gpu'"),
      ("cpu", "cuda", "backend='cuda' is not one of"))
  def test_unsupported_pairs_name_both(self, platform, backend, message):
    with self.assertRaisesRegex(pe.InputError, re.escape(message)):
      validation.resolve_backend(_fake_mesh(platform), backend)

  @absltest.skipIf(jax.devices()[0].platform != "cpu", "a CPU mesh")
  def test_collection_on_cpu_refuses_pallas(self):
    with self.assertRaisesRegex(pe.InputError, "no Pallas backend"):
      _collection("pallas", jnp.float32, 8)


if __name__ == "__main__":
  absltest.main()
