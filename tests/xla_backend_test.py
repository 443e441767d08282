"""The `xla` backend (kernels/xla.py, tuned for XLA:CPU) equals the plain
oracles of kernels/reference.py: bit for bit where the arithmetic is the
same (gather, pool, the sparse update of every optimizer, the segment sums),
to f32 rounding where the sums meet in another order (row norms). A bf16
table given as its uint16 bits (how a collection state holds it on this
backend) gives the oracle's results on the bf16 table, bit for bit."""

import contextlib

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import optimizer_kernels_test
import pool_test
import segment_sum_test
from pallas_emb.kernels import common
from pallas_emb.kernels import reference
from pallas_emb.kernels import xla

DTYPES = (np.float32, test_util.BF16)
WIDTH = 6  # Of the sparse updates' tables.


def bits(table):
  """A bf16 table as its uint16 bits."""
  return jax.lax.bitcast_convert_type(table, jnp.uint16)


def update(impl, opt, apply, table, rows, elements, tokens, grad_accum,
           row_sq):
  """One jitted `impl.sparse_update` (xla or reference) of width-6 rows."""
  step = jnp.int32(optimizer_kernels_test.STEP)
  return jax.jit(lambda *a: impl.sparse_update(
      opt, *a, apply, step, opt.scalars(step),
      emb_width=optimizer_kernels_test.RANKS * WIDTH))(
          table, rows, elements, tokens, grad_accum, row_sq)


class XlaBackendTest(parameterized.TestCase):

  @parameterized.product(dtype=DTYPES, width=(1, 8, 33))
  def test_pool_rows(self, dtype, width):
    args = pool_test.random_case(np.random.default_rng(width), 41, width, 23,
                                 6, dtype)
    got = jax.jit(lambda *a: xla.pool_rows(*a, max_len=6))(*args)
    want = jax.jit(lambda *a: reference.pool_rows(*a, max_len=6))(*args)
    test_util.assert_bits_equal(self, got, test_util.as_numpy(want))

  @parameterized.product(dtype=DTYPES, width=(1, 8, 33),
                         rows_per_chunk=(None, 7))
  def test_segment_sum_rows(self, dtype, width, rows_per_chunk):
    """The oracle's sums bit for bit, with the 96 gradient rows scattered
    all at once or (bf16: made f32) 7 at a time."""
    grads, ids = segment_sum_test.segment_inputs(width, 96, width, 20, dtype)
    fn = lambda impl: jax.jit(lambda g, i: impl.segment_sum_rows(
        g, i, 20, round_dtype=dtype))(grads, ids)
    with (test_util.update_in_chunks(32768, rows=rows_per_chunk)
          if rows_per_chunk else contextlib.nullcontext()):
      got_sums, got_sq = fn(xla)
    want_sums, want_sq = fn(reference)
    test_util.assert_bits_equal(self, got_sums, test_util.as_numpy(want_sums))
    # Halving adds vs a row reduce: f32 sums of positive terms.
    np.testing.assert_allclose(np.asarray(got_sq), np.asarray(want_sq),
                               rtol=4e-7 * np.log2(max(width, 2)) + 1e-7)

  @parameterized.parameters(*test_util.all_pairs(
      name=tuple(optimizer_kernels_test.OPTIMIZERS), dtype=DTYPES,
      apply=(True, False)))
  def test_sparse_update(self, name, dtype, apply):
    opt = optimizer_kernels_test.OPTIMIZERS[name]
    args = tuple(map(jax.tree.map, [jnp.asarray] * 6,
                     optimizer_kernels_test.inputs(opt, 3, WIDTH, dtype)))
    for got, want in zip(jax.tree.leaves(update(xla, opt, apply, *args)),
                         jax.tree.leaves(update(reference, opt, apply,
                                                *args))):
      test_util.assert_bits_equal(self, got, test_util.as_numpy(want))

  @parameterized.parameters(*(
      (name, (3, 4, 5)[i % 3], True)
      for i, name in enumerate(optimizer_kernels_test.OPTIMIZERS)),
                            ("adagrad", 4, False))
  def test_sparse_update_in_chunks(self, name, chunk, apply):
    """A buffer over `CHUNK_SLOTS` is updated a chunk at a time up to its
    last slot in the table (the last chunk overlaps the one before: 14
    slots): the oracle's bits. The 14 slots hold wrapped, out-of-table and
    FILL tokens, rotated so that the overlaps hold rows of the table, and
    then the last 4 or 5 slots unused (FILL), as a batch's buffer."""
    opt = optimizer_kernels_test.OPTIMIZERS[name]
    table, rows, elements, tokens, grad_accum, row_sq = map(
        jax.tree.map, [jnp.asarray] * 6,
        optimizer_kernels_test.inputs(opt, 7, WIDTH, np.float32))
    tokens, grad_accum, row_sq = (jnp.roll(a, -4, axis=0)
                                  for a in (tokens, grad_accum, row_sq))
    run = lambda impl, ids: update(impl, opt, apply, table, rows, elements,
                                   ids, grad_accum, row_sq)
    for unused in (0, 4, 5):
      ids = tokens.at[tokens.shape[0] - unused:].set(np.iinfo(np.int32).max)
      with test_util.update_in_chunks(chunk):
        got = run(xla, ids)
      for a, b in zip(jax.tree.leaves(got),
                      jax.tree.leaves(run(reference, ids))):
        test_util.assert_bits_equal(self, a, test_util.as_numpy(b))

  @parameterized.product(chunk=(3, 17), width=(1, 8))
  def test_row_square_sums_in_chunks(self, chunk, width):
    """Row norms computed a chunk at a time up to the last used slot (the
    last two of the 20 slots are unused): the same bits as over the whole
    buffer; the total is summed in another order (f32 rounding)."""
    grads, ids = segment_sum_test.segment_inputs(chunk, 96, width, 20,
                                                 np.float32)
    fn = lambda: jax.jit(lambda g, i: xla.segment_sum_rows(
        g, i, 20, round_dtype=np.float32))(grads, ids)
    with test_util.update_in_chunks(chunk):
      (got_sums, got_sq) = fn()
    want_sums, want_sq = map(test_util.as_numpy, fn())
    test_util.assert_bits_equal(self, got_sums, want_sums)
    test_util.assert_bits_equal(self, got_sq[:20], want_sq[:20])
    np.testing.assert_allclose(got_sq[20], want_sq[20], rtol=20 * 2.0**-24)

  @parameterized.product(dtype=DTYPES, weighted=(False, True),
                         chunk=(3, 5))
  def test_scatter_add_rows_in_chunks(self, dtype, weighted, chunk):
    """Rows made f32 (bf16, or scaled by weights) are scatter-added a chunk
    at a time (14 rows: the last chunk overlaps the one before): the bits
    of one scatter of all of them, with repeated and dropped slots."""
    rng = np.random.default_rng(chunk)
    rows = jnp.asarray(rng.standard_normal((14, WIDTH)).astype(dtype))
    weights = jnp.asarray(rng.uniform(-2, 2, 14).astype(np.float32)
                          ) if weighted else None
    slots = jnp.asarray(np.r_[rng.integers(0, 4, 10), 5, 5, 2, 5],
                        dtype=jnp.int32)  # 5 slots: index 5 is dropped
    accum = jnp.asarray(rng.standard_normal((5, WIDTH)), jnp.float32)
    f32_rows = rows.astype(jnp.float32)
    want = accum.at[slots].add(
        f32_rows if weights is None else
        common.unfused_product(f32_rows, weights[:, None]), mode="drop")
    with test_util.update_in_chunks(chunk):
      got = jax.jit(xla.scatter_add_rows)(accum, slots, rows, weights)
    test_util.assert_bits_equal(self, got, test_util.as_numpy(want))

  def test_gather_and_pool_of_bf16_bits(self):
    table, rows, weights, starts = pool_test.random_case(
        np.random.default_rng(5), 41, 8, 23, 6, test_util.BF16)
    for out_dtype in (None, jnp.float32):
      pool = lambda t, d=out_dtype: xla.pool_rows(t, rows, weights, starts,
                                                  max_len=6, out_dtype=d)
      got = jax.jit(pool)(bits(table))
      want = jax.jit(lambda t, d=out_dtype: reference.pool_rows(
          t, rows, weights, starts, max_len=6, out_dtype=d))(table)
      test_util.assert_bits_equal(self, got, test_util.as_numpy(want))
    got = jax.jit(xla.gather_rows)(bits(table), rows)
    want = jax.jit(reference.gather_rows)(table, rows)
    test_util.assert_bits_equal(self, got, test_util.as_numpy(want))

  @parameterized.product(name=tuple(optimizer_kernels_test.OPTIMIZERS))
  def test_sparse_update_of_bf16_bits(self, name):
    opt = optimizer_kernels_test.OPTIMIZERS[name]
    table, *args = map(jax.tree.map, [jnp.asarray] * 6,
                       optimizer_kernels_test.inputs(opt, 3, WIDTH,
                                                     test_util.BF16))
    got = update(xla, opt, True, bits(table), *args)
    want = update(reference, opt, True, table, *args)
    self.assertEqual(got[0].dtype, jnp.uint16)
    got = (jax.lax.bitcast_convert_type(got[0], jnp.bfloat16),) + got[1:]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      test_util.assert_bits_equal(self, a, test_util.as_numpy(b))


if __name__ == "__main__":
  absltest.main()
