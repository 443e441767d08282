"""Serving tables (`pallas_emb.quantize`) against a numpy model.

int8: codes, scale and bias equal a float32 numpy model of FBGEMM's fused
8-bit row-wise semantics bit for bit; read back, every element is within
the documented bound `scale / 2 + 16 * 2**-24 * max(|min|, |max|)` of the
original. bfloat16 / float16 are numpy casts. Column-sharded tables keep
their sharding; non-finite tables are rejected.
"""

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np

from pallas_emb import errors
from pallas_emb import quantize

F32 = np.float32
U = 2.0**-24  # f32 unit roundoff


def np_quantize(table):
  """FBGEMM's fused 8-bit row-wise quantization, in float32 numpy."""
  x = np.asarray(table, F32)
  lo = x.min(axis=1)
  span = x.max(axis=1) - lo
  scale = span * F32(1 / 255)
  with np.errstate(divide="ignore"):
    inverse = np.where(span > 0, F32(255) / span, F32(0))
  codes = np.rint((x - lo[:, None]) * inverse[:, None])
  return np.clip(codes, 0, 255).astype(np.uint8), scale, lo


def np_dequantize(codes, scale, bias):
  """`codes * scale + bias`, each operation rounded to float32."""
  product = codes.astype(F32) * scale[:, None]
  return product + bias[:, None]


def assert_codes_equal(test, got, table, want):
  """Bit for bit on CPU. On a GPU, XLA's f32 division may be an ulp off, so
  a code may differ by one where the scaled value is within a few ulps of a
  rounding tie (x.5), and nowhere else."""
  got = np.asarray(got)
  if not test_util.ON_GPU:
    test_util.assert_bits_equal(test, got, want)
    return
  x = np.asarray(table, np.float64)
  lo = x.min(axis=1, keepdims=True)
  span = x.max(axis=1, keepdims=True) - lo
  scaled = np.divide((x - lo) * 255, span, out=np.zeros_like(x),
                     where=span > 0)
  near_tie = np.abs(scaled - np.floor(scaled) - 0.5) <= 1e-4
  diff = got.astype(np.int64) - want.astype(np.int64)
  test.assertTrue(np.all(np.abs(diff) <= 1) and np.all(diff[~near_tie] == 0),
                  f"codes differ at {np.argwhere(diff != 0)[:5].tolist()}")


def edge_table(seed, vocab, width, dtype=F32):
  """Random rows plus a constant row, a far-from-zero row, a tiny range."""
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((vocab, width)).astype(F32)
  table[1] = 0.75  # constant: scale 0
  table[2] = 1e6 + rng.standard_normal(width).astype(F32)
  table[3] = 1.0 + 1e-6 * rng.standard_normal(width).astype(F32)
  table[4] = np.linspace(-3, 5, width, dtype=F32)  # hits the ties
  table[5] = -2.5e37 + 4e37 * rng.random(width).astype(F32)
  return table.astype(dtype)


def bits(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


class QuantizeTest(parameterized.TestCase):

  @parameterized.product(width=(1, 3, 64, 130), dtype=(F32, test_util.BF16))
  def test_int8_matches_numpy_model(self, width, dtype):
    table = edge_table(width, 23, width, dtype)
    out = quantize.quantize_rows(table, "int8")
    self.assertIsInstance(out, quantize.QuantizedRows)
    codes, scale, bias = np_quantize(table)
    assert_codes_equal(self, out.codes, table, codes)
    test_util.assert_bits_equal(self, out.scale, scale)
    test_util.assert_bits_equal(self, out.bias, bias)
    test_util.assert_bits_equal(self, quantize.dequantize_rows(out),
                                np_dequantize(np.asarray(out.codes), scale,
                                              bias))
    # The same under jit (no concrete checks, same arithmetic).
    jitted = jax.jit(lambda t: quantize.quantize_rows(t, "int8"))(table)
    assert_codes_equal(self, jitted.codes, table, codes)

  @parameterized.parameters(1, 3, 64, 130)
  def test_int8_error_bound(self, width):
    table = edge_table(width + 1, 23, width)
    out = quantize.quantize_rows(table, "int8")
    back = np.asarray(quantize.dequantize_rows(out), np.float64)
    x = table.astype(np.float64)
    scale = np.asarray(out.scale, np.float64)[:, None]
    amax = np.abs(x).max(axis=1, keepdims=True)
    bound = scale / 2 + 16 * U * amax
    err = np.abs(back - x)
    self.assertTrue(np.all(err <= bound),
                    f"max excess {np.max(err - bound)} at "
                    f"{np.unravel_index(np.argmax(err - bound), err.shape)}")
    # A constant row reads back exactly; codes span the range [0, 255].
    np.testing.assert_array_equal(back[1], x[1])
    np.testing.assert_array_equal(np.asarray(out.codes)[1], 0)
    if width > 1:
      codes = np.asarray(out.codes)
      np.testing.assert_array_equal(codes[4, [0, -1]], [0, 255])

  def test_code_is_nearest_level(self):
    """Row [0, 255]: scale 1, so value v must get code round-half-even(v)."""
    row = np.array([[0, 255, 2.5, 3.5, 100.49, 100.51, 254.6]], F32)
    out = quantize.quantize_rows(row, "int8")
    assert_codes_equal(self, out.codes, row,
                       np.array([[0, 255, 2, 4, 100, 101, 255]], np.uint8))
    self.assertEqual(float(out.scale[0]), 1.0)

  @parameterized.parameters("bfloat16", "float16", jnp.bfloat16, np.float16)
  def test_float_casts(self, dtype):
    table = edge_table(7, 11, 5)[[0, 1, 3, 4, 6]]  # all within float16
    out = quantize.quantize_rows(table, dtype)
    want = table.astype(ml_dtypes.bfloat16 if np.dtype(dtype).name ==
                        "bfloat16" else np.float16)
    test_util.assert_bits_equal(self, out, want)

  def test_column_sharded_table(self):
    """Row min / max over the full row; codes keep the column sharding."""
    mesh = test_util.mesh({"x": 8})
    table = edge_table(3, 40, 16)
    sharded = jax.device_put(table, NamedSharding(mesh, P(None, "x")))
    out = quantize.quantize_rows(sharded, "int8")
    self.assertTrue(out.codes.sharding.is_equivalent_to(sharded.sharding, 2))
    self.assertTrue(out.scale.sharding.is_equivalent_to(
        NamedSharding(mesh, P()), 1))
    codes, scale, bias = np_quantize(table)
    test_util.assert_bits_equal(self, out.codes, codes)
    test_util.assert_bits_equal(self, out.scale, scale)
    test_util.assert_bits_equal(self, out.bias, bias)
    cast = quantize.quantize_rows(sharded, "bfloat16")
    self.assertTrue(cast.sharding.is_equivalent_to(sharded.sharding, 2))

  @parameterized.named_parameters(
      ("nan", np.nan, "a NaN or an infinity"),
      ("inf", np.inf, "a NaN or an infinity"),
      ("overflow", -3e38, "max - min overflows float32"))
  def test_rejects_non_finite_rows(self, value, why):
    table = np.ones((6, 4), F32) * 3e38
    table[:, 1:] = 1.0
    table[4, 2] = value
    if value == -3e38:
      table[:4, 0] = 1.0  # only row 4 overflows
    else:
      table[:, 0] = 1.0
    with self.assertRaisesRegex(
        errors.InputError, rf"quantize_rows: 1 table row cannot be served "
        rf"as int8 \(row 4: {why}\)"):
      quantize.quantize_rows(table, "int8")
    # Under jit nothing is concrete: the row reads back as NaN, not silently.
    out = jax.jit(lambda t: quantize.quantize_rows(t, "int8"))(table)
    back = np.asarray(quantize.dequantize_rows(out))
    self.assertTrue(np.all(np.isnan(back[4])))
    self.assertTrue(np.all(np.isfinite(back[:4])))

  @parameterized.product(ranks=(2, 8), explicit=(False, True))
  def test_non_finite_rows_of_a_column_sharded_table(self, ranks, explicit):
    """XLA:CPU's min and max over the sharded columns drop a NaN: every
    NaN and infinity is still found (all rows named), and under jit such a
    row still reads back as NaN."""
    mesh = test_util.mesh({"x": ranks}, explicit=explicit)
    table = edge_table(5, 40, 8)
    table[7, 1], table[9, 6], table[30, 0], table[30, 7] = (
        np.nan, np.inf, np.nan, -np.inf)
    sharded = jax.device_put(table, NamedSharding(mesh, P(None, "x")))
    with self.assertRaisesRegex(
        errors.InputError, r"3 table rows cannot be served as int8 "
        r"\(rows \[7, 9, 30\]: a NaN or an infinity\)"):
      quantize.quantize_rows(sharded, "int8")
    out = jax.jit(lambda t: quantize.quantize_rows(t, "int8"))(sharded)
    back = np.asarray(quantize.dequantize_rows(out))
    bad = np.isin(np.arange(40), [7, 9, 30])
    self.assertTrue(np.all(np.isnan(back[bad])))
    self.assertTrue(np.all(np.isfinite(back[~bad])))

  @parameterized.parameters(("float16", 1e5, "65504"),
                            ("float16", -65520.0, "65504"),
                            ("bfloat16", 3.4e38, "3.3895e\\+38"))
  def test_casts_reject_values_beyond_their_range(self, dtype, value,
                                                  largest):
    """A finite value that the cast would make infinite (float16 above
    65504; bfloat16 above ~3.3962e38 from f32) is named; a NaN or an
    infinity is cast as it is."""
    table = np.random.default_rng(9).standard_normal((12, 4)).astype(F32)
    table[[2, 8], 1] = value
    table[5, 0], table[6, 3] = np.nan, np.inf
    with self.assertRaisesRegex(
        errors.InputError, rf"2 table rows cannot be served as {dtype} "
        rf"\(rows \[2, 8\]: a finite value beyond {dtype}'s range "
        rf"\(largest {largest}\)"):
      quantize.quantize_rows(table, dtype)
    table[[2, 8], 1] = 0
    want = table.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else
                        np.float16)
    test_util.assert_bits_equal(self, quantize.quantize_rows(table, dtype),
                                want)

  def test_argument_checks(self):
    with self.assertRaisesRegex(errors.InputError,
                                r"dtype='int4' is not a serving dtype"):
      quantize.quantize_rows(np.ones((2, 2), F32), "int4")
    with self.assertRaisesRegex(errors.InputError,
                                r"table is float32\[4\]; expected a 2-D"):
      quantize.quantize_rows(np.ones(4, F32), "int8")
    with self.assertRaisesRegex(errors.InputError,
                                r"table is int32\[2, 2\]"):
      quantize.quantize_rows(np.ones((2, 2), np.int32), "int8")


if __name__ == "__main__":
  absltest.main()
