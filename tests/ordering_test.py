"""ordering.after: the value is unchanged and now depends on every read."""

import test_util  # pylint: disable=unused-import

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import ordering


class AfterTest(absltest.TestCase):

  def test_value_unchanged_for_any_read(self):
    value = jnp.arange(5, dtype=jnp.int32)
    for first in (1.5, 0.0, -0.0, np.inf, -np.inf, np.nan):
      for read in (jnp.array([first, 2.0], jnp.float32),
                   jnp.array([2.0, first, 3.0], jnp.float32)):
        np.testing.assert_array_equal(
            jax.jit(ordering.after)(value, read, read.astype(jnp.bfloat16)),
            value)
    # Empty reads add nothing (a stack without that part).
    np.testing.assert_array_equal(
        ordering.after(value, jnp.zeros((0, 3))), value)

  def test_the_value_depends_on_each_read(self):
    # A read the value did not depend on would not appear in the jaxpr of
    # the value's computation.
    reads = (jnp.ones((2, 3)), jnp.ones((4,), jnp.bfloat16))
    jaxpr = jax.make_jaxpr(
        lambda v, a, b: ordering.after(v, a, b))(jnp.zeros(3, jnp.int32),
                                                *reads)
    (out,) = jaxpr.jaxpr.outvars
    needed, frontier = set(), [out]
    producers = {o: eqn for eqn in jaxpr.jaxpr.eqns for o in eqn.outvars}
    while frontier:
      var = frontier.pop()
      if var in needed or var not in producers and var not in set(
          jaxpr.jaxpr.invars):
        continue
      needed.add(var)
      if var in producers:
        frontier.extend(v for v in producers[var].invars
                        if hasattr(v, "aval") and not hasattr(v, "val"))
    for invar in jaxpr.jaxpr.invars:
      self.assertIn(invar, needed)

  def test_the_read_dies_before_the_update(self):
    # The update's temporaries reuse the read's buffer: the dependence is
    # computed once, not copied into every op of the update (which kept a
    # [B, W] read alive until the scatter: 2x the temporary memory).
    b, w = 1024, 32

    def step(table, ids, cotangent):
      emb = table[ids]
      loss = jnp.sum(emb * cotangent)
      ids = ordering.after(ids, emb)
      return table.at[ids].set(table[ids] * 0.5 + cotangent), loss

    compiled = jax.jit(step, donate_argnums=0).lower(
        jnp.zeros((4 * b, w)), jnp.zeros((b,), jnp.int32),
        jnp.zeros((b, w))).compile()
    self.assertLess(compiled.memory_analysis().temp_size_in_bytes,
                    1.5 * b * w * 4)


if __name__ == "__main__":
  absltest.main()
