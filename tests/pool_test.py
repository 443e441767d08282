"""The pooled-gather kernel against its jnp twin and a numpy model (§11).

Interpret mode equals the twin bit for bit (same sums, same order, products
rounded on their own); both equal a float64 numpy model to f32 accumulation
(+ one rounding for bf16). The CUDA lowering through the public API
(`coll.lookup` of a pooled feature, backend="triton") compiles for sm_90a
with no spills and vector row accesses, as tests/ptx_test.py asks of every
kernel.
"""

import functools
import logging

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import pallas_emb as pe
import ptx_test
from pallas_emb import kernels
from pallas_emb.kernels.triton import pool
from pallas_emb.kernels import reference
from pallas_emb.testing import ptx


def random_case(rng, vocab, width, num_bags, max_len, dtype):
  table = jnp.asarray(rng.standard_normal((vocab, width)), dtype)
  lengths = rng.integers(0, max_len + 1, num_bags)
  starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  n = int(starts[-1]) + 2  # trailing entries belong to no bag
  rows = rng.integers(-vocab - 2, vocab + 3, n).astype(np.int32)
  weights = rng.standard_normal(n).astype(np.float32)
  weights[rng.random(n) < 0.2] = 0.0
  return table, jnp.asarray(rows), jnp.asarray(weights), jnp.asarray(starts)


def model(table, rows, weights, starts):
  """float64 sums and, per bag, the sum of |terms| (the error scale)."""
  t = np.asarray(table, np.float64)
  vocab = t.shape[0]
  r = np.clip(np.where(rows < 0, rows + vocab, rows), 0, vocab - 1)
  out = np.zeros((len(starts) - 1, t.shape[1]))
  scale = np.zeros_like(out)
  for m in range(len(starts) - 1):
    for e in range(starts[m], starts[m + 1]):
      out[m] += weights[e] * t[r[e]]
      scale[m] += abs(weights[e] * t[r[e]])
  return out, scale


class PoolKernelTest(parameterized.TestCase):

  @parameterized.product(width=[1, 3, 8, 64, 200],
                         dtype=[jnp.float32, jnp.bfloat16])
  def test_interpret_matches_twin_and_model(self, width, dtype):
    rng = np.random.default_rng(width)
    args = random_case(rng, 37, width, 29, 5, dtype)
    out = pool.pool_rows(*args, max_len=5, interpret=True)
    twin = reference.pool_rows(*args, max_len=5)
    test_util.assert_bits_equal(self, out, test_util.as_numpy(twin))
    want, scale = model(*(np.asarray(a) for a in args))
    ulp = 0.0 if dtype == jnp.float32 else 2.0**-8
    err = np.abs(test_util.as_numpy(out).astype(np.float64) - want)
    self.assertTrue((err <= ulp * np.abs(want) + 8 * 2.0**-24 * scale
                     + 1e-30).all(), err.max())

  def test_block_configs(self):
    rng = np.random.default_rng(1)
    args = random_case(rng, 50, 40, 33, 4, jnp.float32)
    twin = reference.pool_rows(*args, max_len=4)
    for config in (pool.PoolConfig(1, 8, 1), pool.PoolConfig(16, 16, 2),
                   pool.PoolConfig(4, 64, 4)):
      out = pool.pool_rows(*args, max_len=4, config=config, interpret=True)
      test_util.assert_bits_equal(self, out, test_util.as_numpy(twin))

  def test_f32_sums_of_a_bf16_table(self):
    """out_dtype=f32 returns the f32 sums unrounded: interpret, xla and the
    twin agree bit for bit, and rounding them to bf16 gives the default."""
    rng = np.random.default_rng(2)
    args = random_case(rng, 37, 24, 29, 5, jnp.bfloat16)
    twin = reference.pool_rows(*args, max_len=5, out_dtype=jnp.float32)
    self.assertEqual(twin.dtype, jnp.float32)
    for backend in ("interpret", "xla"):
      out = kernels.pool_rows(*args, max_len=5, backend=backend,
                              out_dtype=jnp.float32)
      test_util.assert_bits_equal(self, out, test_util.as_numpy(twin))
    test_util.assert_bits_equal(
        self, twin.astype(jnp.bfloat16),
        test_util.as_numpy(reference.pool_rows(*args, max_len=5)))

  def test_empty(self):
    table = jnp.ones((5, 4), jnp.float32)
    out = kernels.pool_rows(table, jnp.zeros((0,), jnp.int32),
                            jnp.zeros((0,), jnp.float32),
                            jnp.zeros((3,), jnp.int32), max_len=2,
                            backend="interpret")
    np.testing.assert_array_equal(out, np.zeros((2, 4)))

  def test_bad_config(self):
    with self.assertRaisesRegex(ValueError, "power of two"):
      pool.PoolConfig(block_bags=3)


def pooled_lookup_kernels(width, dtype):
  mesh = test_util.mesh({"x": 1})
  coll = pe.EmbeddingCollection(
      [pe.TableSpec("t", 100_000, width, optimizer=pe.RowwiseAdagrad(0.1),
                    dtype=dtype)],
      [pe.FeatureSpec("bag", "t", combiner="mean")], mesh, "x",
      backend="triton")
  state = jax.eval_shape(coll.init, jax.random.key(0))
  batch = {"bag": jax.ShapeDtypeStruct((4096, 20), jnp.int32)}
  return [k for k in ptx.capture(coll.lookup, state, batch)
          if k.name == "pallas_emb_pool"]


@absltest.skipIf(ptx_test.SKIP_REASON is not None,
                 f"PTX check skipped: {ptx_test.SKIP_REASON}")
class PoolPtxTest(parameterized.TestCase):

  @parameterized.product(width=ptx_test.WIDTHS, dtype=ptx_test.DTYPES)
  def test_no_spills_and_vector_rows(self, width, dtype):
    (kernel,) = pooled_lookup_kernels(width, dtype)
    report = ptx.compile_kernel(kernel)
    logging.info("w=%d %s %s", width, dtype, report.row())
    self.assertEqual(report.spill_bytes, 0, report.row())
    rows = {("table_ref", "load"), ("out_ref", "store")}
    per_row = {"starts_ref", "rows_ref", "weights_ref"}
    seen = set()
    for access in report.accesses:
      self.assertIn(access.ref, per_row | {r for r, _ in rows}, report.row())
      seen.add((access.ref, access.op))
      if access.ref in per_row:
        continue
      want = ptx_test.expected_bytes(access, report.num_warps)
      for kind in access.widths:
        self.assertGreaterEqual(ptx_test.access_bytes(kind), want,
                                f"{access.op} {access.ref}: {report.row()}")
    self.assertEmpty(rows - seen, report.row())


if __name__ == "__main__":
  absltest.main()
