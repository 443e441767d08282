"""The gather kernel against a numpy model and its jnp twin.

Backends: the twin (`xla`), the kernel through the interpreter everywhere,
and the Triton kernel on a GPU. Also: the interpreter's masked-store hazard
that the kernels guard against (proved here on a bare pallas_call), the
config checks, the int32 offset checks, the scoped Triton warning filter,
and the CUDA lowering (on CPU, no GPU needed).
"""

import functools
import warnings

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

from pallas_emb import kernels
from pallas_emb.kernels import common
from pallas_emb.kernels.triton import gather
from pallas_emb.kernels import reference

BF16 = test_util.BF16
F32 = np.float32
# The kernel backends under test: interpret, plus pallas on a GPU, or the one
# PALLAS_EMB_TEST_BACKEND names (the interpreter when that is "xla").
KERNEL_BACKENDS = tuple(
    b for b in test_util.backends() if b != "xla") or ("interpret",)
TRITON_CALL = "__gpu$xla.gpu.triton"
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def np_gather(table, ids):
  """The lookup rule: wrap a negative id once, clamp into the table, copy the row."""
  ids = np.asarray(ids, np.int64)
  rows = np.where(ids < 0, ids + table.shape[0], ids)
  return table[np.clip(rows, 0, table.shape[0] - 1)]


def edge_ids(seed, num_ids, vocab_rows):
  """Random ids in [-2V, 2V) with every edge planted (int32 extremes too)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(-2 * vocab_rows, 2 * vocab_rows, num_ids)
  edges = [0, -1, vocab_rows - 1, vocab_rows, vocab_rows + 5, -vocab_rows,
           -vocab_rows - 1, INT32_MAX, INT32_MIN]
  ids[:len(edges)] = edges[:num_ids]
  return rng.permutation(ids).astype(np.int32)


def random_table(seed, vocab_rows, width, dtype):
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((vocab_rows, width)).astype(dtype)
  table[0, 0] = -0.0  # a signed zero must be copied bit for bit
  return table


def bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


class GatherTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (f"{backend}_{np.dtype(dtype).name}_w{width}_n{num_ids}", backend,
       width, dtype, num_ids)
      for backend in ("xla",) + KERNEL_BACKENDS
      for width, dtype, num_ids in ((1, F32, 70), (3, BF16, 33),
                                    (8, F32, 100), (12, BF16, 64),
                                    (64, F32, 19), (520, BF16, 9)))
  def test_matches_numpy(self, backend, width, dtype, num_ids):
    vocab_rows = 41
    table = random_table(width, vocab_rows, width, dtype)
    ids = edge_ids(width, num_ids, vocab_rows)
    out = jax.jit(functools.partial(kernels.gather_rows, backend=backend))(
        table, ids)
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_array_equal(bits(out), bits(np_gather(table, ids)))

  @parameterized.product(
      backend=KERNEL_BACKENDS,
      config=(dict(block_rows=1), dict(block_rows=2, block_cols=1),
              dict(block_rows=16, block_cols=4, num_warps=1),
              dict(block_rows=4, block_cols=8)),
      width_dtype=((3, F32), (12, BF16), (21, F32)))
  def test_configs_bit_exact_vs_twin(self, backend, config, width_dtype):
    """Tiny tiles: partial last row block, several column blocks, padding."""
    width, dtype = width_dtype
    table = random_table(1, 29, width, dtype)
    ids = edge_ids(2, 23, 29)
    out = gather.gather_rows(table, ids, config=gather.GatherConfig(**config),
                             interpret=backend == "interpret")
    twin = reference.gather_rows(jnp.asarray(table), jnp.asarray(ids))
    np.testing.assert_array_equal(bits(out), bits(twin))

  def test_dispatch_passes_config(self):
    table = random_table(3, 17, 6, F32)
    ids = edge_ids(3, 11, 17)
    out = kernels.gather_rows(table, ids, backend="interpret",
                              config=gather.GatherConfig(block_rows=2,
                                                         block_cols=2))
    np.testing.assert_array_equal(bits(out), bits(np_gather(table, ids)))
    with self.assertRaisesRegex(ValueError, "backend='tpu' is not one of"):
      kernels.gather_rows(table, ids, backend="tpu")

  def test_kernel_config_bundle(self):
    bundle = kernels.KernelConfig(gather=gather.GatherConfig(block_rows=8))
    self.assertIsNone(bundle.update)
    self.assertEqual(hash(bundle), hash(kernels.KernelConfig(
        gather=gather.GatherConfig(block_rows=8))))
    with self.assertRaises(AttributeError):
      bundle.gather = None  # frozen

  def test_config_checks(self):
    with self.assertRaisesRegex(ValueError, "block_rows must be a positive "
                                "power of two, got 3"):
      gather.GatherConfig(block_rows=3)
    with self.assertRaisesRegex(ValueError, "tile 256 x 128 = 32768 elements"):
      gather.GatherConfig(block_rows=256, block_cols=128)
    with self.assertRaisesRegex(ValueError, "num_stages must be >= 1"):
      gather.GatherConfig(num_stages=0)

  @parameterized.product(width=(1, 3, 8, 16, 100, 512, 4096),
                         dtype=(F32, BF16), num_ids=(1, 1000, 262144))
  def test_heuristic_tiles_fit(self, width, dtype, num_ids):
    """The heuristic's tile fits in registers and spans at most the row."""
    c = gather.resolve_config(None, num_ids, width, dtype)
    self.assertLessEqual(c.block_rows * c.block_cols * np.dtype(dtype).itemsize,
                         16384)
    self.assertLessEqual(c.block_cols, common.next_pow2(width))
    self.assertLessEqual(c.block_cols * np.dtype(dtype).itemsize, 1024)
    self.assertIn(c.num_warps, (1, 2, 4))
    if width <= 16 and num_ids >= 262144:  # narrow rows: many rows per block
      self.assertGreaterEqual(c.block_rows, 128)

  def test_int32_checks_table_and_output(self):
    """Every flat view the kernel addresses is checked before tracing."""
    fn = functools.partial(kernels.gather_rows, backend="triton")
    big_table = jax.ShapeDtypeStruct((2**27, 16), jnp.bfloat16)
    with self.assertRaisesRegex(ValueError, r"gather: table shard \(134217728"
                                r", 16\) has 2147483648 elements per rank.*"
                                "int32 offsets"):
      jax.eval_shape(fn, big_table, jax.ShapeDtypeStruct((8,), jnp.int32))
    # A small table, but 2**26 ids of 64 columns: a 2**32-element output.
    small = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
    with self.assertRaisesRegex(ValueError, r"gather: output \(67108864, 64\)"):
      jax.eval_shape(fn, small, jax.ShapeDtypeStruct((2**26,), jnp.int32))

  @parameterized.product(width=(3, 8, 512, 1000),
                         dtype=(jnp.float32, jnp.bfloat16))
  def test_cuda_lowering(self, width, dtype):
    table = jax.ShapeDtypeStruct((1000, width), dtype)
    ids = jax.ShapeDtypeStruct((300,), jnp.int32)
    fn = functools.partial(kernels.gather_rows, backend="triton")
    text = jax.jit(fn).trace(table, ids).lower(
        lowering_platforms=("cuda",)).as_text()
    self.assertIn(TRITON_CALL, text)
    self.assertIn('name = "pallas_emb_gather"', text)


class MaskedStoreTest(absltest.TestCase):
  """Why `common.store_offsets` sends masked lanes out of range in interpret.

  On a GPU a masked lane writes nothing. The interpreter discharges a masked
  store into `ref.at[offsets].set(where(mask, value, old))`: a masked lane
  writes the OLD value back. When a masked lane and a real lane of the same
  store share an offset, the scatter keeps one of them and the real write
  can be lost. Below, the real lane writes 10 at offset 0 and a masked lane
  also points at offset 0, once after it and once before it.
  """

  def store(self, masked_lane, guard):
    """Values 10, 20, 30, 40 to offsets 0, 1, 2, 0; lane `masked_lane` off."""
    def kernel(init_ref, out_ref):
      del init_ref  # aliased to out_ref
      lanes = jnp.arange(4)
      offs = lanes % 3
      ok = lanes != masked_lane
      if guard:
        offs = common.store_offsets(offs, ok, 4, interpret=True)
      plgpu.store(out_ref.at[offs], (lanes + 1).astype(jnp.float32) * 10,
                  mask=ok)

    return np.asarray(pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
        input_output_aliases={0: 0}, interpret=True)(
            jnp.full((4,), -1.0, jnp.float32)))

  def test_unguarded_masked_lane_clobbers_a_real_write(self):
    masked_after = self.store(3, guard=False)
    masked_before = self.store(0, guard=False)
    # Each case has exactly one real write at offset 0 (10, resp. 40).
    lost = [masked_after[0] != 10, masked_before[0] != 40]
    self.assertTrue(any(lost), f"no clobber seen: {masked_after} "
                    f"{masked_before}; if the interpreter no longer writes "
                    "masked lanes, common.store_offsets can become identity")

  def test_guarded_store_keeps_every_real_write(self):
    np.testing.assert_array_equal(
        self.store(3, guard=True),
        [10, 20, 30, -1])
    np.testing.assert_array_equal(
        self.store(0, guard=True),
        [40, 20, 30, -1])

  def test_gpu_offsets_are_untouched(self):
    offsets = jnp.arange(4)
    self.assertIs(common.store_offsets(offsets, offsets < 2, 4, False),
                  offsets)


class TritonWarningTest(absltest.TestCase):

  def test_filter_is_scoped_and_exact(self):
    before = list(warnings.filters)
    message = ("The Pallas Triton backend is deprecated and will be removed "
               "in a future JAX version. To keep using Pallas on GPU, ...")
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      with kernels.quiet_triton_deprecation():
        warnings.warn(message, DeprecationWarning)
        warnings.warn("something else is deprecated", DeprecationWarning)
        warnings.warn(message, UserWarning)  # same text, other category
      warnings.warn(message, DeprecationWarning)  # outside: shown
    self.assertEqual([(str(w.message)[:20], w.category) for w in seen],
                     [("something else is de", DeprecationWarning),
                      (message[:20], UserWarning),
                      (message[:20], DeprecationWarning)])
    kernels.gather_rows(np.ones((4, 2), F32), np.arange(3, dtype=np.int32),
                        backend="interpret")
    self.assertEqual(warnings.filters, before)  # nothing installed globally


if __name__ == "__main__":
  absltest.main()
