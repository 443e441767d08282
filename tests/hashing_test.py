"""Tests for pallas_emb.hashing against a pure-python big-integer model."""

import itertools

import test_util  # pylint: disable=unused-import  # before jax

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import hashing
from pallas_emb.errors import InputError

P = 2**31 - 1
M64 = 2**64 - 1


def model_splitmix64(seed, n):
  """The n-th splitmix64 output, written out from the published algorithm."""
  z = (seed + n * 0x9E3779B97F4A7C15) & M64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
  return z ^ (z >> 31)


def model_params(num_hashes, seed):
  a = [1 + model_splitmix64(seed, 2 * k + 1) % (P - 1)
       for k in range(num_hashes)]
  b = [model_splitmix64(seed, 2 * k + 2) % P for k in range(num_hashes)]
  return a, b


def model_hash(x, a, b, rows):
  """h(x) = ((a x + b) mod p) mod (rows - 1) + 1, and 0 -> 0 (big ints)."""
  return 0 if x == 0 else (a * x + b) % P % (rows - 1) + 1


def model_hash_ids(ids, num_hashes, rows, seed):
  a, b = model_params(num_hashes, seed)
  ids = np.asarray(ids, dtype=object)  # exact python ints, never floats
  flat = [[model_hash(int(x), a[k], b[k], rows) for k in range(num_hashes)]
          for x in ids.ravel()]
  return np.asarray(flat, np.int64).reshape(np.shape(ids) + (num_hashes,))


# Ids around the limb and word boundaries of the 32-bit device hash.
EDGE_IDS = sorted({0, 1, 2, 3, 2**15 - 1, 2**15, 2**15 + 1, 2**16 - 1, 2**16,
                   2**16 + 1, 2**17, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 3,
                   2**31 - 2, 2**31 - 1, 123456789, 0x55555555, 0x2AAAAAAA})
EDGE_A = [1, 2, 2**15 - 1, 2**15, 2**16 - 1, 2**16, 2**16 + 1, 2**30,
          P - 2, P - 1, 0x5A5A5A5A]
EDGE_B = [0, 1, 2**16, P - 2, P - 1]
EDGE_ROWS = [2, 3, 7, 1000, 2**16, 2**16 + 1, 2**31 - 1, 2**31]


class ParamsTest(absltest.TestCase):

  def test_splitmix64_published_vector(self):
    # Seed 0: the first three outputs of the reference implementation.
    self.assertEqual([hashing.splitmix64(0, n) for n in (1, 2, 3)],
                     [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                      0x06C45D188009454F])

  def test_params_follow_documented_derivation(self):
    for seed in (0, 1, 42, 2**63 + 5, 2**64 - 1):
      a, b = hashing.hash_params(5, seed)
      self.assertEqual((list(a), list(b)), model_params(5, seed))
      self.assertTrue(all(1 <= x < P for x in a))
      self.assertTrue(all(0 <= x < P for x in b))
    # More functions extend the list: h_k does not depend on num_hashes.
    self.assertEqual(hashing.hash_params(2, 7)[0],
                     hashing.hash_params(4, 7)[0][:2])


class NumpyHashTest(parameterized.TestCase):

  @parameterized.parameters(2, 3, 1000, 2**20 + 7, 2**31)
  def test_matches_bigint_model(self, rows):
    rng = np.random.default_rng(rows)
    ids = np.concatenate([
        np.asarray(EDGE_IDS, np.int64),
        np.asarray([P, P + 1, 2 * P, 2**32, 2**40 + 3, 2**62, 2**63 - 1],
                   np.int64),
        rng.integers(0, 2**63 - 1, 300, dtype=np.int64),
        rng.integers(0, 2**31, 300, dtype=np.int64)]).reshape(3, -1)
    for seed in (0, 9):
      got = hashing.hash_ids(ids, num_hashes=3, rows=rows, seed=seed)
      self.assertIsInstance(got, np.ndarray)
      self.assertEqual(got.dtype, np.int32)
      self.assertEqual(got.shape, ids.shape + (3,))
      np.testing.assert_array_equal(got, model_hash_ids(ids, 3, rows, seed))

  def test_uint64_ids_beyond_int64(self):
    ids = np.asarray([2**64 - 1, 2**63, 5], np.uint64)
    np.testing.assert_array_equal(
        hashing.hash_ids(ids, num_hashes=2, rows=97, seed=3),
        model_hash_ids([2**64 - 1, 2**63, 5], 2, 97, 3))

  def test_lists_and_scalars(self):
    np.testing.assert_array_equal(
        hashing.hash_ids([[4, 0]], num_hashes=1, rows=11),
        model_hash_ids([[4, 0]], 1, 11, 0))
    self.assertEqual(hashing.hash_ids(7, num_hashes=2, rows=11).shape, (2,))


class JaxHashTest(parameterized.TestCase):

  def test_x64_is_off(self):
    # The device hash must not rely on 64-bit integers.
    self.assertFalse(jax.config.jax_enable_x64)

  def test_edge_params_ids_rows_bit_identical(self):
    ids = np.asarray(EDGE_IDS, np.int32)
    pairs = list(itertools.product(EDGE_A, EDGE_B))
    a = tuple(p[0] for p in pairs)
    b = tuple(p[1] for p in pairs)
    for rows in EDGE_ROWS:
      want = np.asarray(
          [[model_hash(int(x), ak, bk, rows) for ak, bk in pairs]
           for x in ids])
      np.testing.assert_array_equal(
          hashing._hash_numpy(ids, a, b, rows), want, err_msg=f"{rows=}")
      got = jax.jit(hashing._hash_jax, static_argnums=(1, 2, 3))(
          jnp.asarray(ids), a, b, rows)
      self.assertEqual(got.dtype, jnp.int32)
      np.testing.assert_array_equal(np.asarray(got), want,
                                    err_msg=f"{rows=}")

  @parameterized.parameters(2, 1000, 2**31)
  def test_random_int32_ids_match_numpy(self, rows):
    rng = np.random.default_rng(rows)
    ids = rng.integers(0, 2**31, (4, 50_000), dtype=np.int64).astype(np.int32)
    ids[0, :len(EDGE_IDS)] = EDGE_IDS
    for seed in (0, 2**64 - 1):
      want = hashing.hash_ids(ids, num_hashes=2, rows=rows, seed=seed)
      got = jax.jit(lambda v, s=seed: hashing.hash_ids(
          v, num_hashes=2, rows=rows, seed=s))(jnp.asarray(ids))
      np.testing.assert_array_equal(np.asarray(got), want)
      eager = hashing.hash_ids(jnp.asarray(ids), num_hashes=2, rows=rows,
                               seed=seed)
      np.testing.assert_array_equal(np.asarray(eager), want)
    # A sample against the big-integer model too.
    np.testing.assert_array_equal(
        want[0, :300], model_hash_ids(ids[0, :300], 2, rows, 2**64 - 1))

  def test_narrow_dtypes(self):
    ids = np.arange(0, 300, dtype=np.int16)
    want = model_hash_ids(ids, 2, 50, 1)
    for dtype in (jnp.int16, jnp.uint16, jnp.int32):
      np.testing.assert_array_equal(np.asarray(hashing.hash_ids(
          jnp.asarray(ids, dtype), num_hashes=2, rows=50, seed=1)), want)

  def test_traced_negative_ids_hash_to_padding(self):
    got = jax.jit(lambda v: hashing.hash_ids(v, num_hashes=2, rows=10))(
        jnp.asarray([-1, -(2**31), 0, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got)[:3], 0)
    np.testing.assert_array_equal(np.asarray(got)[3],
                                  model_hash_ids([4], 2, 10, 0)[0])


class SpreadTest(absltest.TestCase):

  def test_padding_only_for_zero_and_range(self):
    ids = np.arange(0, 200_000, dtype=np.int64)
    got = hashing.hash_ids(ids, num_hashes=3, rows=64)
    np.testing.assert_array_equal(got[0], 0)
    self.assertGreaterEqual(got[1:].min(), 1)
    self.assertLess(got.max(), 64)

  def test_uniform_over_rows(self):
    # Pearson chi-square over the rows - 1 buckets, for consecutive ids and
    # for random 64-bit ids: with 100 degrees of freedom, mean 100 and sd
    # 14, a fair hash stays far below 200; a skewed one does not.
    rows = 102
    rng = np.random.default_rng(0)
    for ids in (np.arange(1, 100_001, dtype=np.int64),
                rng.integers(1, 2**62, 100_000, dtype=np.int64)):
      got = hashing.hash_ids(ids, num_hashes=2, rows=rows, seed=5)
      for k in range(2):
        counts = np.bincount(got[:, k], minlength=rows)[1:]
        expected = ids.size / (rows - 1)
        chi2 = ((counts - expected) ** 2 / expected).sum()
        self.assertLess(chi2, 200, msg=f"hash {k}: {counts}")

  def test_functions_differ_and_collide_independently(self):
    rows = 1001
    ids = np.arange(1, 50_001, dtype=np.int64)
    got = hashing.hash_ids(ids, num_hashes=4, rows=rows, seed=0)
    for k, l in itertools.combinations(range(4), 2):
      agree = np.mean(got[:, k] == got[:, l])
      self.assertLess(agree, 3 / (rows - 1), msg=f"h_{k} vs h_{l}")
    # Ids that collide under h_0 mostly do not under h_1: the pair is
    # what makes two-hash embeddings tell ids apart.
    same0 = got[:-1, 0][:, None] == got[:-1, 0][None, :200]
    pairs = np.argwhere(same0)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    self.assertNotEmpty(pairs)
    both = np.mean(got[pairs[:, 0], 1] == got[pairs[:, 1], 1])
    self.assertLess(both, 0.02)
    other_seed = hashing.hash_ids(ids, num_hashes=1, rows=rows, seed=1)
    self.assertLess(np.mean(other_seed[:, 0] == got[:, 0]), 3 / (rows - 1))


class ErrorTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("rows_1", dict(num_hashes=1, rows=1), "rows=1"),
      ("rows_too_big", dict(num_hashes=1, rows=2**31 + 1), "rows=2147483649"),
      ("rows_float", dict(num_hashes=1, rows=10.0), "rows=10.0"),
      ("num_hashes_0", dict(num_hashes=0, rows=10), "num_hashes=0"),
      ("num_hashes_bool", dict(num_hashes=True, rows=10), "num_hashes=True"),
      ("seed_negative", dict(num_hashes=1, rows=10, seed=-1), "seed=-1"),
      ("seed_too_big", dict(num_hashes=1, rows=10, seed=2**64), "seed="))
  def test_bad_arguments(self, kwargs, match):
    with self.assertRaisesRegex(InputError, f"^pallas_emb hash_ids {match}"):
      hashing.hash_ids(np.arange(3), **kwargs)

  def test_bad_ids(self):
    with self.assertRaisesRegex(InputError, "negative id -3"):
      hashing.hash_ids(np.asarray([1, -3]), num_hashes=1, rows=10)
    with self.assertRaisesRegex(InputError, "negative id -3"):
      hashing.hash_ids(jnp.asarray([1, -3]), num_hashes=1, rows=10)
    with self.assertRaisesRegex(InputError, "dtype float"):
      hashing.hash_ids(np.asarray([1.0]), num_hashes=1, rows=10)
    with self.assertRaisesRegex(InputError, "dtype bool"):
      hashing.hash_ids(np.asarray([True]), num_hashes=1, rows=10)
    with self.assertRaisesRegex(InputError, "dtype object"):
      hashing.hash_ids([2**70], num_hashes=1, rows=10)
    with self.assertRaisesRegex(InputError, "uint32.*on the host"):
      hashing.hash_ids(jnp.asarray([1], jnp.uint32), num_hashes=1, rows=10)
    with self.assertRaisesRegex(InputError, "dtype float32"):
      hashing.hash_ids(jnp.asarray([1.0]), num_hashes=1, rows=10)


if __name__ == "__main__":
  absltest.main()
