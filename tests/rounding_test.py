"""`kernels.common.round_to` and `narrow`: the bf16 rounding every backend
shares.

It must equal a real f32 -> bf16 -> f32 conversion (ml_dtypes, ties to
even, subnormals, infinities, NaN) bit for bit, and survive compilation:
XLA:GPU folds a plain `convert` pair away as excess precision.
"""

import test_util

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.kernels import common

F32 = np.float32


def some_floats() -> np.ndarray:
  """Random bit patterns (every exponent, subnormals, NaNs) and edge values."""
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, np.uint64)
  edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-45,
                    np.finfo(F32).max, -np.finfo(F32).max, 3.3895e38,
                    1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], F32)
  return np.concatenate([bits.astype(np.uint32).view(F32), edges])


class RoundToTest(absltest.TestCase):

  def test_bf16_equals_a_real_conversion_bit_for_bit(self):
    x = some_floats()
    got = np.asarray(jax.jit(common.round_to, static_argnums=1)(
        x, jnp.bfloat16))
    with np.errstate(invalid="ignore"):
      want = x.astype(test_util.BF16).astype(F32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32),
                                  want[~nan].view(np.uint32))

  def test_narrow_equals_a_real_conversion_bit_for_bit(self):
    """`narrow` to bf16: ml_dtypes' conversion, a NaN the quiet NaN of its
    sign (as XLA's own convert gives)."""
    x = some_floats()
    got = np.asarray(jax.jit(common.narrow, static_argnums=1)(
        x, jnp.bfloat16)).view(np.uint16)
    with np.errstate(invalid="ignore"):
      want = x.astype(test_util.BF16).view(np.uint16)
    nan = np.isnan(x)
    sign = (x.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
    want = np.where(nan, sign | np.uint16(0x7FC0), want)
    np.testing.assert_array_equal(got, want)
    xla_convert = jax.jit(lambda v: v.astype(jnp.bfloat16))(x)
    np.testing.assert_array_equal(got, np.asarray(xla_convert).view(np.uint16))
    self.assertIs(common.narrow(x, jnp.float32).dtype, np.dtype(F32))

  def test_rounding_survives_a_fused_program(self):
    """Rounded, squared and summed in one jit: the rounding is not folded."""
    x = np.random.default_rng(1).standard_normal((64, 33)).astype(F32)
    got = jax.jit(lambda v: jnp.sum(
        jnp.square(common.round_to(v * 3, jnp.bfloat16)), axis=1))(x)
    rounded = (x * 3).astype(test_util.BF16).astype(np.float64)
    np.testing.assert_allclose(got, (rounded**2).sum(axis=1), rtol=1e-6)
    unrounded = ((x * 3).astype(np.float64)**2).sum(axis=1)
    self.assertFalse(np.allclose(got, unrounded, rtol=1e-6))

  def test_f32_is_the_identity_and_other_dtypes_are_refused(self):
    x = some_floats()
    self.assertIs(common.round_to(x, jnp.float32), x)
    with self.assertRaisesRegex(ValueError, "float16"):
      common.round_to(jnp.asarray(x), jnp.float16)


if __name__ == "__main__":
  absltest.main()
