"""lookup against a numpy model of the lookup rule, on every backend and layout."""

import functools
import re

import test_util

import chex
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import numpy_model
import pallas_emb as pe
from pallas_emb import kernels
from pallas_emb.kernels.triton import gather
from pallas_emb.kernels import reference

VOCAB = 37

# (mesh shape, table_axis, data_axis)
LAYOUTS = {
    "1rank": ({"x": 1}, ("x",), ("x",)),
    "2ranks": ({"x": 2}, ("x",), ("x",)),
    "4ranks": ({"x": 4}, ("x",), ("x",)),
    "8ranks": ({"x": 8}, ("x",), ("x",)),
    "extra_size1_data_axis": ({"x": 4, "r": 1}, ("x",), ("x", "r")),
    "two_table_axes": ({"a": 2, "b": 4}, ("a", "b"), ("a", "b")),
    "two_table_axes_reversed": ({"a": 2, "b": 4}, ("b", "a"), ("a", "b")),
}


def model_lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """The lookup rule: wrap a negative id once, clamp, copy the row."""
  rows = np.where(ids < 0, ids + table.shape[0], ids)
  return table[np.clip(rows, 0, table.shape[0] - 1)]


def model_table_grad(table, ids, cotangent, padding_id=0):
  """The dense cotangent: a scatter-add over the ids that train
  (`numpy_model.resolve`: wrapped once and inside the table; the padding
  row gets nothing), as the sparse update trains them."""
  rows, trains, _ = numpy_model.resolve(ids.reshape(-1), table.shape[0],
                                        padding_id)
  grad = np.zeros(table.shape, np.float64)
  np.add.at(grad, rows[trains],
            cotangent.reshape(-1, table.shape[1])[trains])
  return grad


def edge_ids(rng, shape, vocab):
  """Random ids with the edge cases planted: 0, -1, -vocab, past the end."""
  ids = rng.integers(-vocab, vocab, size=shape).reshape(-1)
  edges = [0, -1, vocab - 1, vocab, vocab + 5, -vocab, -vocab - 3,
           2**31 - 1, -2**31]
  ids[:len(edges)] = edges[:ids.size]
  return rng.permutation(ids).reshape(shape).astype(np.int32)


def make_case(layout, dtype, shard_width, ids_shape, explicit=False, seed=0):
  shape, table_axis, data_axis = LAYOUTS[layout]
  mesh = test_util.mesh(shape, explicit=explicit)
  group = int(np.prod([shape[a] for a in table_axis]))
  tokens = int(np.prod(ids_shape))
  ctx = pe.make_context(mesh, table_axis, data_axis=data_axis,
                        tokens_per_batch=tokens,
                        emb_width=group * shard_width, num_unique=tokens + 1)
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((VOCAB, ctx.emb_width)).astype(dtype)
  ids = edge_ids(rng, ids_shape, VOCAB)
  return ctx, table, ids


class LookupTest(parameterized.TestCase):

  @parameterized.parameters(*test_util.all_pairs(
      layout=list(LAYOUTS),
      dtype=[np.float32, test_util.BF16],
      shard_width=[3, 8],
      explicit=[False, True]))
  def test_matches_model(self, layout, dtype, shard_width, explicit):
    ids_shape = (16, 2) if shard_width == 3 else (32,)
    ctx, table, ids = make_case(layout, dtype, shard_width, ids_shape,
                                explicit=explicit)
    table_dev = jax.device_put(table, pe.table_sharding(ctx))
    ids_dev = jax.device_put(ids, pe.token_sharding(ctx))
    expected = model_lookup(table, ids)
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        f = jax.jit(functools.partial(pe.lookup, ctx, backend=backend))
        out = f(table_dev, ids_dev)
        self.assertEqual(out.shape, ids_shape + (ctx.emb_width,))
        self.assertEqual(out.dtype, table.dtype)
        test_util.assert_bits_equal(self, out, expected)
        self.assertTrue(out.sharding.is_equivalent_to(
            pe.token_sharding(ctx), out.ndim))

  @parameterized.product(layout=["1rank", "4ranks", "two_table_axes_reversed"],
                         dtype=[np.float32, test_util.BF16])
  def test_dense_gradient(self, layout, dtype):
    ctx, table, ids = make_case(layout, dtype, 3, (16,), seed=1)
    rng = np.random.default_rng(2)
    cot = rng.standard_normal(ids.shape + (ctx.emb_width,)).astype(dtype)
    table_dev = jax.device_put(table, pe.table_sharding(ctx))
    ids_dev = jax.device_put(ids, pe.token_sharding(ctx))
    cot_dev = jax.device_put(cot, pe.token_sharding(ctx))
    expected = model_table_grad(table, ids, cot.astype(np.float64))
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        loss = lambda t: jnp.vdot(pe.lookup(ctx, t, ids_dev, backend=backend
                                            ).astype(jnp.float32),
                                  cot_dev.astype(jnp.float32))
        grad = jax.jit(jax.grad(loss))(table_dev)
        self.assertEqual(grad.dtype, table.dtype)
        self.assertTrue(grad.sharding.is_equivalent_to(
            pe.table_sharding(ctx), 2))
        # f32 accumulation in an unspecified order, then one rounding to the
        # table dtype: f32 sums agree to a few ulps, bf16 to one rounding.
        rtol = 1e-6 if dtype == np.float32 else 2**-8
        np.testing.assert_allclose(
            test_util.as_numpy(grad).astype(np.float64), expected,
            rtol=rtol, atol=rtol * np.abs(expected).max())

  def test_errors_before_tracing(self):
    ctx, table, ids = make_case("4ranks", np.float32, 2, (16,))
    with self.assertRaisesRegex(pe.InputError, "token_ids has dtype float32"):
      pe.lookup(ctx, table, ids.astype(np.float32))
    with self.assertRaisesRegex(pe.InputError, r"table has shape \(37, 4\)"):
      pe.lookup(ctx, table[:, :4], ids)
    with self.assertRaisesRegex(pe.InputError,
                                "expected tokens_per_batch=16"):
      pe.lookup(ctx, table, ids[:8])
    with self.assertRaisesRegex(pe.InputError, "expected tokens_per_batch=16"):
      pe.lookup(ctx, table, np.zeros((4, 3), np.int32))
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        "pallas_emb tokens_per_batch=2 does not shard evenly over the 4-rank "
        "communicator")):
      pe.lookup(ctx, table, ids.reshape(2, 8))

  @parameterized.parameters(
      ("list", lambda ids: ids.tolist()),
      ("list_2d", lambda ids: ids.reshape(8, 2).tolist()),
      ("numpy_int64", lambda ids: ids.astype(np.int64)),
      ("jnp_unplaced_2d", lambda ids: jnp.asarray(ids.reshape(8, 2))),
      ("jnp_uint8", lambda ids: jnp.asarray(ids % 30, jnp.uint8)))
  def test_array_likes_are_converted_and_placed(self, _, convert):
    for explicit in (False, True):
      ctx, table, ids = make_case("4ranks", np.float32, 2, (16,),
                                  explicit=explicit)
      given = convert(ids)
      out = pe.lookup(ctx, table, given)
      expected = model_lookup(table, np.asarray(given).astype(np.int64))
      test_util.assert_bits_equal(self, out, expected)
      self.assertTrue(out.sharding.is_equivalent_to(pe.token_sharding(ctx),
                                                    out.ndim))

  def test_replicated_layout(self):
    ctx = pe.make_context(test_util.mesh({"replica": 2, "x": 4}), "x",
                          replica_axis="replica", tokens_per_batch=16,
                          emb_width=8, num_unique=17)
    table = np.random.default_rng(1).standard_normal((VOCAB, 8)).astype(
        np.float32)
    ids = np.arange(-8, 8, dtype=np.int32) * 3
    out = pe.lookup(ctx, jax.device_put(table, pe.table_sharding(ctx)),
                    jax.device_put(ids, pe.token_sharding(ctx)))
    test_util.assert_bits_equal(self, out, model_lookup(table, ids))

  def test_out_of_range_checking_mode(self):
    ctx, table, _ = make_case("4ranks", np.float32, 2, (16,))
    ids = jnp.array([0, 5, -1, -VOCAB, VOCAB, -VOCAB - 1, 2**31 - 1, 3] * 2,
                    jnp.int32)
    count = jax.jit(pe.count_out_of_range, static_argnums=1)(ids, VOCAB)
    self.assertEqual(int(count), 6)
    with self.assertRaisesRegex(pe.IdOutOfRangeError,
                                r"batch has 6 token ids outside \[-37, 37\)"):
      pe.raise_if_out_of_range(count, VOCAB)
    pe.raise_if_out_of_range(pe.count_out_of_range(ids % VOCAB, VOCAB), VOCAB)
    # Defined behaviour without checking: wrap once, then clamp.
    test_util.assert_bits_equal(self, pe.lookup(ctx, table, ids),
                                model_lookup(table, np.asarray(ids)))


class LookupVariantsTest(chex.TestCase):
  """lookup eagerly and under jit: the same bits."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("2ranks", "two_table_axes_reversed")
  def test_matches_model(self, layout):
    ctx, table, ids = make_case(layout, test_util.BF16, 3, (16, 2))
    out = self.variant(functools.partial(pe.lookup, ctx))(
        jax.device_put(table, pe.table_sharding(ctx)),
        jax.device_put(ids, pe.token_sharding(ctx)))
    test_util.assert_bits_equal(self, out, model_lookup(table, ids))


class GatherKernelTest(parameterized.TestCase):

  @parameterized.product(width=[1, 3, 8, 12, 64],
                         dtype=[np.float32, test_util.BF16],
                         num_ids=[1, 37, 128])
  def test_interpret_matches_twin(self, width, dtype, num_ids):
    rng = np.random.default_rng(width * 1000 + num_ids)
    table = jnp.asarray(rng.standard_normal((VOCAB, width)).astype(dtype))
    ids = jnp.asarray(edge_ids(rng, (num_ids,), VOCAB))
    out = gather.gather_rows(table, ids, interpret=True)
    test_util.assert_bits_equal(self, out, reference.gather_rows(table, ids))
    test_util.assert_bits_equal(self, out, model_lookup(np.asarray(table),
                                                         np.asarray(ids)))

  def test_block_config(self):
    table = jnp.arange(40 * 5, dtype=jnp.float32).reshape(40, 5)
    ids = jnp.arange(-3, 30, dtype=jnp.int32)
    for block_rows in (1, 16, 256):
      out = gather.gather_rows(table, ids, interpret=True,
                               config=gather.GatherConfig(block_rows=block_rows))
      test_util.assert_bits_equal(self, out, reference.gather_rows(table, ids))

  @parameterized.product(width=[3, 16], dtype=[jnp.float32, jnp.bfloat16])
  def test_cuda_lowering(self, width, dtype):
    table = jax.ShapeDtypeStruct((1000, width), dtype)
    ids = jax.ShapeDtypeStruct((300,), jnp.int32)
    f = functools.partial(kernels.gather_rows, backend="triton")
    lowered = jax.jit(f).trace(table, ids).lower(lowering_platforms=("cuda",))
    self.assertIn("__gpu$xla.gpu.triton", lowered.as_text())

  def test_flat_size_limit(self):
    table = jax.ShapeDtypeStruct((2**28, 16), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    with self.assertRaisesRegex(ValueError, "int32 offsets"):
      jax.eval_shape(functools.partial(kernels.gather_rows, backend="triton"),
                     table, ids)


if __name__ == "__main__":
  absltest.main()
