"""The dequantizing gather kernel against its jnp twin and a numpy model.

The twin (`xla` backend) equals a float32 numpy model of
`codes[r] * scale[r] + bias[r]` (r the id wrapped once, then clamped) bit
for bit; the kernel through the interpreter (and the Triton kernel on a
GPU) equals the twin bit for bit. The CUDA lowering compiles for sm_90a
with no spills and vector row accesses (tests/ptx_test.py).
"""

import functools

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import gather_test
from pallas_emb import kernels
from pallas_emb import quantize
from pallas_emb.kernels.triton import quantized_gather
from pallas_emb.kernels import reference

KERNEL_BACKENDS = gather_test.KERNEL_BACKENDS
F32 = np.float32


def np_gather_dequantized(codes, scale, bias, ids):
  """float32 numpy: wrap once, clamp, `codes * scale + bias` per row."""
  ids = np.asarray(ids, np.int64)
  vocab = codes.shape[0]
  rows = np.clip(np.where(ids < 0, ids + vocab, ids), 0, vocab - 1)
  product = codes[rows].astype(F32) * scale[rows][:, None]
  return product + bias[rows][:, None]


def random_rows(seed, vocab, width):
  """Codes over all of [0, 255], scales and biases of mixed magnitudes."""
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 256, (vocab, width)).astype(np.uint8)
  codes[0, 0], codes[-1, -1] = 0, 255
  scale = (rng.random(vocab) * 10.0 ** rng.integers(-6, 3, vocab)).astype(F32)
  scale[1] = 0  # a constant row
  bias = (rng.standard_normal(vocab) * 10.0 ** rng.integers(-3, 4, vocab)
          ).astype(F32)
  bias[2] = -0.0
  return codes, scale, bias


def np_pool_dequantized(codes, scale, bias, rows, weights, starts):
  """float32 numpy: per bag, `acc += w * (codes * scale + bias)` in entry
  order, every operation rounded to float32."""
  vocab = codes.shape[0]
  rows = np.clip(np.where(rows < 0, rows + vocab, rows), 0, vocab - 1)
  out = np.zeros((len(starts) - 1, codes.shape[1]), F32)
  for m in range(len(starts) - 1):
    for e in range(starts[m], starts[m + 1]):
      r = rows[e]
      values = codes[r].astype(F32) * scale[r] + bias[r]
      out[m] = out[m] + F32(weights[e]) * values
  return out


def random_bags(seed, vocab, num_bags, max_len):
  """CSR bags of 0..max_len entries, edge rows, some zero weights."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, max_len + 1, num_bags)
  starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  n = int(starts[-1]) + 2  # trailing entries belong to no bag
  rows = rng.integers(-vocab - 2, vocab + 3, n).astype(np.int32)
  weights = rng.standard_normal(n).astype(F32)
  weights[rng.random(n) < 0.2] = 0.0
  return rows, weights, starts


class QuantizedGatherTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{backend}_w{width}_n{num_ids}", backend, width, num_ids)
      for backend in ("xla",) + KERNEL_BACKENDS
      for width, num_ids in ((1, 70), (3, 33), (8, 100), (64, 19),
                             (130, 9), (130, 0)))
  def test_matches_numpy(self, backend, width, num_ids):
    vocab = 41
    codes, scale, bias = random_rows(width, vocab, width)
    ids = gather_test.edge_ids(width, num_ids, vocab)
    fn = jax.jit(functools.partial(kernels.gather_dequantized,
                                   backend=backend))
    out = fn(codes, scale, bias, ids)
    test_util.assert_bits_equal(
        self, out, np_gather_dequantized(codes, scale, bias, ids))

  @parameterized.product(
      backend=KERNEL_BACKENDS,
      config=(dict(block_rows=1), dict(block_rows=2, block_cols=1),
              dict(block_rows=16, block_cols=4, num_warps=1),
              dict(block_rows=4, block_cols=16)),
      width=(3, 21, 64))
  def test_configs_bit_exact_vs_twin(self, backend, config, width):
    """Tiny tiles: partial last row block, several column blocks, padding."""
    codes, scale, bias = random_rows(1, 29, width)
    ids = gather_test.edge_ids(2, 23, 29)
    out = quantized_gather.gather_dequantized(
        codes, scale, bias, ids,
        config=quantized_gather.QuantizedGatherConfig(**config),
        interpret=backend == "interpret")
    twin = reference.gather_dequantized(
        jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(bias),
        jnp.asarray(ids))
    test_util.assert_bits_equal(self, out, twin)

  def test_reads_back_quantized_table(self):
    """quantize_rows then gather = dequantize_rows then take."""
    table = np.random.default_rng(5).standard_normal((30, 12)).astype(F32)
    rows = quantize.quantize_rows(table, "int8")
    ids = gather_test.edge_ids(5, 40, 30)
    want = np.asarray(quantize.dequantize_rows(rows))[
        gather_test.np_gather(np.arange(30), ids)]
    for backend in ("xla",) + KERNEL_BACKENDS:
      out = kernels.gather_dequantized(*rows, ids, backend=backend)
      test_util.assert_bits_equal(self, out, want, backend)

  @parameterized.named_parameters(
      (f"{backend}_w{width}", backend, width)
      for backend in ("xla",) + KERNEL_BACKENDS
      for width in (1, 3, 8, 64, 130))
  def test_pooled_matches_numpy(self, backend, width):
    codes, scale, bias = random_rows(width, 37, width)
    rows, weights, starts = random_bags(width, 37, 29, 5)
    fn = jax.jit(functools.partial(kernels.pool_dequantized, max_len=5,
                                   backend=backend))
    out = fn(codes, scale, bias, rows, weights, starts)
    test_util.assert_bits_equal(
        self, out,
        np_pool_dequantized(codes, scale, bias, rows, weights, starts))

  @parameterized.product(
      backend=KERNEL_BACKENDS,
      config=(dict(block_rows=1, block_cols=8, num_warps=1),
              dict(block_rows=16, block_cols=16, num_warps=2),
              dict(block_rows=4, block_cols=64)),
      width=(5, 40))
  def test_pooled_configs_bit_exact_vs_twin(self, backend, config, width):
    codes, scale, bias = random_rows(3, 50, width)
    # Row 0 (what a masked lane reads) is NaN: masked lanes must add 0.
    scale[0] = np.nan
    rows, weights, starts = random_bags(4, 50, 33, 4)
    rows[rows % 50 == 0] = 1
    args = (codes, scale, bias, rows, weights, starts)
    out = quantized_gather.pool_dequantized(
        *args, max_len=4,
        config=quantized_gather.QuantizedGatherConfig(**config),
        interpret=backend == "interpret")
    twin = reference.pool_dequantized(
        *(jnp.asarray(a) for a in args), max_len=4)
    test_util.assert_bits_equal(self, out, test_util.as_numpy(twin))
    self.assertFalse(np.isnan(test_util.as_numpy(out)).any())

  def test_pooled_empty(self):
    codes, scale, bias = random_rows(0, 5, 4)
    for backend in ("xla",) + KERNEL_BACKENDS:
      out = kernels.pool_dequantized(
          codes, scale, bias, np.zeros(0, np.int32), np.zeros(0, F32),
          np.zeros(3, np.int32), max_len=2, backend=backend)
      test_util.assert_bits_equal(self, out, np.zeros((2, 4), F32))

  @parameterized.product(width=(1, 3, 8, 16, 64, 130, 512, 4096),
                         num_ids=(1, 1000, 262144))
  def test_heuristic_tiles(self, width, num_ids):
    """The f32 tile fits in registers; each thread holds 16 codes when the
    tile has them."""
    c = quantized_gather.resolve_config(None, num_ids, width)
    self.assertLessEqual(c.block_rows * c.block_cols, 4096)
    self.assertLessEqual(c.block_cols, min(256, 1 << (width - 1).bit_length()))
    self.assertIn(c.num_warps, (1, 2, 4))
    self.assertGreaterEqual(c.block_rows * c.block_cols,
                            min(512, 4096 // c.block_cols * c.block_cols))
    self.assertGreaterEqual(c.block_rows * c.block_cols // (32 * c.num_warps),
                            16)

  def test_argument_checks(self):
    codes, scale, bias = random_rows(0, 5, 4)
    ids = np.zeros(3, np.int32)
    with self.assertRaisesRegex(ValueError, r"codes float32\[5, 4\].*"
                                "expected uint8"):
      quantized_gather.gather_dequantized(codes.astype(F32), scale, bias, ids)
    with self.assertRaisesRegex(ValueError, r"scale \[4\], bias \[5\]"):
      quantized_gather.gather_dequantized(codes, scale[:4], bias, ids)
    with self.assertRaisesRegex(ValueError, r"code shard \(134217728, 32\)"):
      jax.eval_shape(
          functools.partial(kernels.gather_dequantized, backend="triton"),
          jax.ShapeDtypeStruct((2**27, 32), jnp.uint8),
          jax.ShapeDtypeStruct((2**27,), jnp.float32),
          jax.ShapeDtypeStruct((2**27,), jnp.float32),
          jax.ShapeDtypeStruct((8,), jnp.int32))

  @parameterized.parameters(1, 3, 64, 130, 1000)
  def test_cuda_lowering(self, width):
    codes = jax.ShapeDtypeStruct((1000, width), jnp.uint8)
    rows = jax.ShapeDtypeStruct((1000,), jnp.float32)
    ids = jax.ShapeDtypeStruct((300,), jnp.int32)
    fn = functools.partial(kernels.gather_dequantized, backend="triton")
    text = jax.jit(fn).trace(codes, rows, rows, ids).lower(
        lowering_platforms=("cuda",)).as_text()
    self.assertIn(gather_test.TRITON_CALL, text)
    self.assertIn('name = "pallas_emb_quantized_gather"', text)

  def test_bench_smoke(self):
    """bench/quantized.py at a tiny size: it checks its int8 gather itself."""
    from bench import quantized  # pylint: disable=g-import-not-at-top
    out = quantized.main(["--rows=300", "--width=24", "--tokens=64",
                          "--reps=1", "--rounds=1", "--backend=interpret"])
    self.assertEqual(sorted(out["cases"]), ["bfloat16", "float32", "int8"])
    self.assertGreater(out["int8_over_f32"], 0)


if __name__ == "__main__":
  absltest.main()
