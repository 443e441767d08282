"""The segment-sum kernels against a numpy model and their jnp twin.

Backends: the twin (`xla`, a scatter-add), the kernels through the
interpreter everywhere, and the Triton kernels on a GPU. The hot-id (Zipf)
cases force long runs to be split into many pieces (tiny `piece_rows`) and
check the result exactly (integer-valued rows, so any summation order gives
the same f32 sum) and for determinism. Also: the run bounds of the sort,
config and int32 checks, and the CUDA lowering (on CPU, no GPU needed).
"""

import functools

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import kernels
from pallas_emb.kernels import reference
from pallas_emb.kernels import xla
from pallas_emb.kernels.triton import segment_sum

BF16 = test_util.BF16
F32 = np.float32
# The kernel backends under test: interpret, plus pallas on a GPU, or the one
# PALLAS_EMB_TEST_BACKEND names (the interpreter when that is "xla").
KERNEL_BACKENDS = tuple(
    b for b in test_util.backends() if b != "xla") or ("interpret",)
TRITON_CALL = "__gpu$xla.gpu.triton"


def np_round(x, dtype):
  x = np.asarray(x, F32)
  return x if np.dtype(dtype) == F32 else x.astype(BF16).astype(F32)


def np_segment_sum(grads, segment_ids, num_segments, round_dtype):
  """float64 row loop: `grad_accum[U, S]` (as f32) and `row_sq[U + 1]`."""
  grads = np.asarray(grads).astype(np.float64)
  accum = np.zeros((num_segments, grads.shape[1]), np.float64)
  for row, seg in enumerate(np.asarray(segment_ids)):
    if 0 <= seg < num_segments:
      accum[seg] += grads[row]
  accum = accum.astype(F32)
  row_sq = (np_round(accum, round_dtype).astype(np.float64) ** 2).sum(axis=1)
  return accum, np.append(row_sq, row_sq.sum())


def segment_inputs(seed, num_rows, width, num_segments, dtype, integer=False):
  """Rows with dropped ids (-1, U, beyond), a hot segment and empty ones."""
  rng = np.random.default_rng(seed)
  # Segment 0 is hot (~half the rows); the last two segments stay empty.
  ids = np.where(rng.random(num_rows) < 0.5, 0,
                 rng.integers(0, max(1, num_segments - 2), num_rows))
  drops = rng.random(num_rows)
  ids = np.where(drops < 0.08, -1, ids)
  ids = np.where((drops >= 0.08) & (drops < 0.12), num_segments, ids)
  ids = np.where((drops >= 0.12) & (drops < 0.14), num_segments + 7, ids)
  if integer:
    grads = rng.integers(-4, 5, (num_rows, width))
  else:
    grads = rng.standard_normal((num_rows, width))
  return grads.astype(dtype), ids.astype(np.int32)


def zipf_segments(seed, num_rows, num_segments, exponent=1.05):
  """Segment ids of a Zipf batch: segment 0 is the top id, then rank order."""
  rng = np.random.default_rng(seed)
  weights = np.arange(1, num_segments + 1, dtype=np.float64) ** -exponent
  ids = rng.choice(num_segments, num_rows, p=weights / weights.sum())
  return rng.permutation(ids).astype(np.int32)


def bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def run(backend, grads, ids, num_segments, round_dtype, config=None):
  if config is None:
    fn = functools.partial(kernels.segment_sum_rows, num_segments=num_segments,
                           round_dtype=round_dtype, backend=backend)
  else:
    fn = functools.partial(segment_sum.segment_sum_rows,
                           num_segments=num_segments, round_dtype=round_dtype,
                           interpret=backend == "interpret", config=config)
  accum, row_sq = jax.jit(fn)(jnp.asarray(grads), jnp.asarray(ids))
  return np.asarray(accum), np.asarray(row_sq)


# Tiny tiles: pieces of 4 sorted rows, several programs per kernel, column
# blocks, partial last blocks.
TINY = segment_sum.SegmentSumConfig(piece_rows=4, block_segments=4,
                                    block_cols=4, piece_block_rows=2,
                                    num_warps=1, piece_num_warps=1)


class SegmentSumTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{backend}_{np.dtype(dtype).name}_w{width}_n{rows}_u{segs}", backend,
       (width, dtype, rows, segs))
      for backend in ("xla",) + KERNEL_BACKENDS
      for width, dtype, rows, segs in ((1, F32, 128, 7), (3, BF16, 100, 10),
                                       (8, F32, 64, 5), (12, BF16, 96, 20),
                                       (64, F32, 48, 6), (300, BF16, 40, 4)))
  def test_matches_numpy(self, backend, case):
    width, dtype, num_rows, num_segments = case
    grads, ids = segment_inputs(width, num_rows, width, num_segments, dtype)
    round_dtype = jnp.bfloat16 if dtype == BF16 else jnp.float32
    accum, row_sq = run(backend, grads, ids, num_segments, round_dtype)
    want_accum, want_sq = np_segment_sum(grads, ids, num_segments,
                                         round_dtype)
    self.assertEqual(accum.dtype, np.float32)
    self.assertEqual(accum.shape, (num_segments, width))
    self.assertEqual(row_sq.shape, (num_segments + 1,))
    # f32 sums in some order vs the float64 model: a few ulps of the sum of
    # magnitudes.
    scale = np.abs(np.asarray(grads, F32)).sum(axis=0).max()
    np.testing.assert_allclose(accum, want_accum, rtol=1e-6,
                               atol=1e-6 * scale)
    np.testing.assert_allclose(row_sq, want_sq, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(accum[-2:], 0)  # empty segments

  @parameterized.product(backend=("xla",) + KERNEL_BACKENDS,
                         unique=(False, True))
  def test_exact(self, backend, unique):
    """Integer-valued rows, or one row per segment: every backend is exact."""
    num_segments, width = 24, 5
    grads, ids = segment_inputs(1, 64, width, num_segments, F32,
                                integer=not unique)
    if unique:
      ids = np.random.default_rng(2).permutation(64).astype(np.int32) - 8
    accum, row_sq = run(backend, grads, ids, num_segments, jnp.float32)
    want_accum, want_sq = np_segment_sum(grads, ids, num_segments, F32)
    np.testing.assert_array_equal(accum, want_accum)
    if not unique:  # small integers: the squares sum exactly too
      np.testing.assert_array_equal(row_sq, want_sq)
    else:  # one row per segment: a copy, bit for bit (signed zeros too)
      twin, _ = run("xla", grads, ids, num_segments, jnp.float32)
      np.testing.assert_array_equal(bits(accum), bits(twin))

  @parameterized.product(backend=KERNEL_BACKENDS, width=(3, 8))
  def test_hot_zipf_runs_are_split_exactly(self, backend, width):
    """The top id (~10% of rows) spans many pieces; sums stay exact.

    With piece_rows=4 every run of more than 4 rows crosses piece
    boundaries, so its sum is a head + piece sums; runs that start on a
    boundary, end on one, or fill a piece exactly all occur.
    """
    num_rows, num_segments = 300, 60
    ids = zipf_segments(0, num_rows, num_segments)
    ids[::17] = -1  # dropped rows sort last and are never read
    counts = np.bincount(ids[ids >= 0], minlength=num_segments)
    self.assertGreater(counts.max(), 6 * TINY.piece_rows)  # really hot
    grads = np.random.default_rng(1).integers(-8, 9, (num_rows, width))
    grads = grads.astype(F32)
    accum, row_sq = run(backend, grads, ids, num_segments, jnp.float32,
                        config=TINY)
    want_accum, want_sq = np_segment_sum(grads, ids, num_segments, F32)
    np.testing.assert_array_equal(accum, want_accum)
    np.testing.assert_array_equal(row_sq, want_sq)

  @parameterized.product(backend=KERNEL_BACKENDS)
  def test_hot_zipf_deterministic_and_close_to_twin(self, backend):
    """Normal rows: identical bits on every run, twin-equal up to order."""
    num_rows, num_segments, width = 256, 40, 12
    ids = zipf_segments(3, num_rows, num_segments)
    grads = np.random.default_rng(4).standard_normal(
        (num_rows, width)).astype(BF16)
    first = run(backend, grads, ids, num_segments, jnp.bfloat16, TINY)
    again = run(backend, grads, ids, num_segments, jnp.bfloat16, TINY)
    np.testing.assert_array_equal(bits(first[0]), bits(again[0]))
    np.testing.assert_array_equal(bits(first[1]), bits(again[1]))
    twin = run("xla", grads, ids, num_segments, jnp.bfloat16)
    scale = np.abs(np.asarray(grads, F32)).sum(axis=0).max()
    np.testing.assert_allclose(first[0], twin[0], rtol=1e-6,
                               atol=2e-7 * scale)
    want_accum, _ = np_segment_sum(grads, ids, num_segments, jnp.bfloat16)
    np.testing.assert_allclose(first[0], want_accum, rtol=1e-6,
                               atol=2e-7 * scale)

  @parameterized.product(backend=("xla",) + KERNEL_BACKENDS)
  def test_all_dropped(self, backend):
    grads = np.ones((16, 3), F32)
    ids = np.array([-1, 4, 9, -7] * 4, np.int32)
    accum, row_sq = run(backend, grads, ids, 4, jnp.float32)
    np.testing.assert_array_equal(accum, np.zeros((4, 3)))
    np.testing.assert_array_equal(row_sq, np.zeros(5))

  def test_run_bounds(self):
    """`sort_segments` against numpy: a stable order and each run's bounds."""
    ids = zipf_segments(5, 200, 30)
    ids[::7] = -1
    ids[::11] = 31
    keys, order, start, end = jax.jit(
        functools.partial(segment_sum.sort_segments, num_segments=30))(
            jnp.asarray(ids))
    want_keys = np.where((ids >= 0) & (ids < 30), ids, 30)
    want_order = np.argsort(want_keys, kind="stable")
    np.testing.assert_array_equal(order, want_order)
    np.testing.assert_array_equal(keys, want_keys[want_order])
    sorted_keys = want_keys[want_order]
    for u in range(30):
      lo = np.searchsorted(sorted_keys, u, "left")
      hi = np.searchsorted(sorted_keys, u, "right")
      self.assertEqual((start[u], end[u]), (lo, hi) if hi > lo else (0, 0))

  def test_twin_does_not_sort(self):
    """On CPU the twin is a scatter-add: no O(N log N) sort."""
    grads, ids = segment_inputs(0, 64, 8, 10, F32)
    hlo = jax.jit(lambda g, i: xla.segment_sum_rows(
        g, i, 10, round_dtype=jnp.bfloat16)).lower(grads, ids).as_text()
    self.assertNotIn("stablehlo.sort", hlo)

  def test_config_checks(self):
    with self.assertRaisesRegex(ValueError, "piece_rows must be a positive "
                                "power of two, got 3"):
      segment_sum.SegmentSumConfig(piece_rows=3)
    with self.assertRaisesRegex(ValueError, "tile 512 x 64"):
      segment_sum.SegmentSumConfig(block_segments=512, block_cols=64)
    config = segment_sum.resolve_config(segment_sum.SegmentSumConfig(
        block_cols=8), 1000, 100, 64)
    self.assertEqual(config.block_cols, 8)  # a pinned field is kept
    self.assertIsNotNone(config.piece_rows)

  @parameterized.product(width=(1, 8, 64, 512, 3000), num_segments=(
      1, 4097, 262145))
  def test_heuristic_tiles_fit(self, width, num_segments):
    c = segment_sum.resolve_config(None, num_segments, num_segments, width)
    self.assertLessEqual(c.block_segments * c.block_cols * 4, 8192)
    self.assertLessEqual(c.piece_block_rows * c.block_cols * 4, 16384)
    self.assertLessEqual(c.piece_block_rows, c.piece_rows)

  def test_int32_checks(self):
    fn = functools.partial(kernels.segment_sum_rows, round_dtype=jnp.float32,
                           backend="triton")
    with self.assertRaisesRegex(ValueError, r"segment_sum: gradient block "
                                r"\(33554432, 64\)"):
      jax.eval_shape(functools.partial(fn, num_segments=5),
                     jax.ShapeDtypeStruct((2**25, 64), jnp.bfloat16),
                     jax.ShapeDtypeStruct((2**25,), jnp.int32))
    with self.assertRaisesRegex(ValueError, r"segment_sum: grad_accum "
                                r"\(67108864, 64\)"):
      jax.eval_shape(functools.partial(fn, num_segments=2**26),
                     jax.ShapeDtypeStruct((16, 64), jnp.float32),
                     jax.ShapeDtypeStruct((16,), jnp.int32))

  @parameterized.parameters((12, jnp.float32), (3, jnp.bfloat16),
                            (130, jnp.bfloat16), (1000, jnp.float32))
  def test_cuda_lowering(self, width, dtype):
    """Two Triton kernels, one sort, and no search loop in the wrapper."""
    grads = jax.ShapeDtypeStruct((40, width), dtype)
    ids = jax.ShapeDtypeStruct((40,), jnp.int32)
    fn = lambda g, i: kernels.segment_sum_rows(
        g, i, 11, round_dtype=dtype, backend="triton")
    text = jax.jit(fn).trace(grads, ids).lower(
        lowering_platforms=("cuda",)).as_text()
    self.assertEqual(text.count(TRITON_CALL), 2)
    self.assertIn('name = "pallas_emb_segment_sum_pieces"', text)
    self.assertIn('name = "pallas_emb_segment_sum"', text)
    self.assertEqual(text.count("stablehlo.sort"), 1)
    self.assertNotIn("stablehlo.while", text)  # e.g. searchsorted's scan


if __name__ == "__main__":
  absltest.main()
