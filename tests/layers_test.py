import test_util  # pylint: disable=g-bad-import-order  (8 CPU devices first)

# pallas_emb.flax.Embed / pallas_emb.haiku.Embed against nn.Embed / hk.Embed:
# same params from the same key, bit-identical lookups, column-sharded
# tables, and plain jax.grad + optax training with the same gradients.

import functools
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import flax as pe_flax
from pallas_emb import haiku as pe_haiku

VOCAB = 37
BF16 = jnp.bfloat16

# name -> (mesh shape, explicit axes)
LAYOUTS = {
    "8ranks": ({"x": 8}, False),
    "4ranks": ({"x": 4}, False),
    "8ranks_explicit": ({"x": 8}, True),
}


def make_ctx(layout, ids_shape, shard_width=2):
  shape, explicit = LAYOUTS[layout]
  mesh = test_util.mesh(shape, explicit=explicit)
  tokens = int(np.prod(ids_shape))
  return pe.make_context(mesh, "x", tokens_per_batch=tokens,
                         emb_width=shape["x"] * shard_width,
                         num_unique=tokens + 1)


def in_range_ids(ctx, ids_shape, seed=0):
  """Ids in [-VOCAB, VOCAB) (where nn.Embed is defined), on the token axes."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(-VOCAB, VOCAB, size=ids_shape).astype(np.int32)
  ids.reshape(-1)[:4] = [0, VOCAB - 1, -1, -VOCAB]
  return ids, jax.device_put(ids, pe.token_sharding(ctx))


def assert_table_sharded(test, ctx, x):
  test.assertTrue(x.sharding.is_equivalent_to(pe.table_sharding(ctx), 2),
                  f"table sharded as {x.sharding}")


# (param_dtype, dtype) of the Flax layer; Haiku's `dtype` is the param dtype.
DTYPES = {
    "f32": (jnp.float32, None),
    "bf16_params": (BF16, None),
    "f32_params_bf16_compute": (jnp.float32, BF16),
}
CASES = [
    dict(testcase_name=f"_{layout}_{dtypes}_{len(ids_shape)}d",
         layout=layout, dtypes=dtypes, ids_shape=ids_shape)
    for layout, dtypes, ids_shape in [
        ("8ranks", "f32", (16,)),
        ("8ranks", "bf16_params", (8, 2)),
        ("8ranks", "f32_params_bf16_compute", (16,)),
        ("4ranks", "bf16_params", (8, 2)),
        ("8ranks_explicit", "f32_params_bf16_compute", (8, 2)),
    ]
]


class FlaxEmbedTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_matches_nn_embed(self, layout, dtypes, ids_shape):
    param_dtype, dtype = DTYPES[dtypes]
    ctx = make_ctx(layout, ids_shape)
    ids, ids_dev = in_range_ids(ctx, ids_shape)
    kwargs = dict(num_embeddings=VOCAB, features=ctx.emb_width, dtype=dtype,
                  param_dtype=param_dtype)
    ref = nn.Embed(**kwargs)
    ref_vars = ref.init(jax.random.key(1), ids)
    expected = ref.apply(ref_vars, ids)
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        layer = pe_flax.Embed(ctx=ctx, backend=backend, **kwargs)
        variables = layer.init(jax.random.key(1), ids_dev)
        # Same key, same initializer -> same table as nn.Embed, sharded.
        table = variables["params"]["embedding"]
        self.assertIsInstance(table, nn.Partitioned)
        assert_table_sharded(self, ctx, table.value)
        test_util.assert_bits_equal(self, table.value,
                                    ref_vars["params"]["embedding"])
        out = jax.jit(layer.apply)(variables, ids_dev)
        self.assertEqual(out.shape, ids_shape + (ctx.emb_width,))
        test_util.assert_bits_equal(self, out, expected)
        self.assertTrue(out.sharding.is_equivalent_to(
            pe.token_sharding(ctx), out.ndim))
        if backend == "xla":  # Unboxed params (nn.Embed's pytree), eagerly.
          test_util.assert_bits_equal(
              self, layer.apply(nn.unbox(variables), ids_dev), expected)

  @parameterized.parameters(False, True)
  def test_init_and_partitioning(self, explicit):
    ctx = make_ctx("8ranks_explicit" if explicit else "8ranks", (16,))
    ids, ids_dev = in_range_ids(ctx, (16,))
    layer = pe_flax.Embed(64, ctx.emb_width, ctx, backend="xla")
    abstract = jax.eval_shape(layer.init, jax.random.key(0), ids_dev)
    self.assertEqual(
        nn.get_partition_spec(abstract),
        {"params": {"embedding": jax.sharding.PartitionSpec(None, "x")}})
    key = jax.random.key(0)
    # Flax's recipe, jit(init, out_shardings=nn.get_sharding(...)); plain jit;
    # eager init: all give the column-sharded table.
    shardings = nn.get_sharding(abstract, ctx.mesh)
    for variables in (jax.jit(layer.init, out_shardings=shardings)(key,
                                                                   ids_dev),
                      jax.jit(layer.init)(key, ids_dev),
                      layer.init(key, ids_dev)):
      table = variables["params"]["embedding"].value
      self.assertEqual(table.shape, (64, ctx.emb_width))
      self.assertEqual(table.dtype, jnp.float32)
      assert_table_sharded(self, ctx, table)
      ref = nn.Embed(64, ctx.emb_width).init(jax.random.key(0), ids)
      self.assertEqual(jax.tree.structure(nn.unbox(variables)),
                       jax.tree.structure(ref))
      test_util.assert_bits_equal(self, table, ref["params"]["embedding"])
    # Default init: variance_scaling(1, fan_in, normal, out_axis=0), i.e.
    # std 1/sqrt(features).
    self.assertAlmostEqual(float(np.std(table)), ctx.emb_width**-0.5,
                           delta=0.2 * ctx.emb_width**-0.5)
    # A custom initializer is used as given.
    init = nn.initializers.uniform(3.0)
    custom = pe_flax.Embed(64, ctx.emb_width, ctx, embedding_init=init).init(
        jax.random.key(2), ids_dev)
    ref = nn.Embed(64, ctx.emb_width, embedding_init=init).init(
        jax.random.key(2), ids)
    test_util.assert_bits_equal(self, custom["params"]["embedding"].value,
                                ref["params"]["embedding"])

  def test_out_of_range_ids_wrap_then_clamp(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.array([VOCAB, VOCAB + 5, -VOCAB - 1, 2**31 - 1, -2**31, -1, 0, 3],
                   np.int32)
    layer = pe_flax.Embed(VOCAB, ctx.emb_width, ctx, backend="xla")
    variables = layer.init(jax.random.key(0), ids)
    table = np.asarray(variables["params"]["embedding"].value)
    out = layer.apply(variables, jax.device_put(ids, pe.token_sharding(ctx)))
    # Wrap a negative id once (-VOCAB-1 -> -1), then clamp.
    rows = [VOCAB - 1, VOCAB - 1, 0, VOCAB - 1, 0, VOCAB - 1, 0, 3]
    test_util.assert_bits_equal(self, out, table[rows])
    flax_out = nn.Embed(VOCAB, ctx.emb_width).apply(nn.unbox(variables), ids)
    self.assertTrue(np.isnan(flax_out[:5]).all())  # nn.Embed: NaN fill.

  def test_attend(self):
    ctx = make_ctx("8ranks", (8,))
    layer = pe_flax.Embed(VOCAB, ctx.emb_width, ctx, backend="xla")
    variables = layer.init(jax.random.key(0), np.zeros(8, np.int32))
    query = np.random.default_rng(0).standard_normal(
        (3, ctx.emb_width)).astype(np.float32)
    out = layer.apply(variables, query, method="attend")
    expected = nn.Embed(VOCAB, ctx.emb_width).apply(
        nn.unbox(variables), query, method="attend")
    self.assertEqual(out.shape, (3, VOCAB))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)

  def test_errors(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.zeros(8, np.int32)
    with self.assertRaisesRegex(
        ValueError, r"pallas_emb.flax.Embed features=8 does not match the "
        r"context's emb_width=16\. Make the context with emb_width=8"):
      pe_flax.Embed(VOCAB, 8, ctx).init(jax.random.key(0), ids)
    with self.assertRaisesRegex(TypeError, "must be a pallas_emb.Embedding"):
      pe_flax.Embed(VOCAB, 16, ctx.mesh).init(jax.random.key(0), ids)
    with self.assertRaisesRegex(ValueError, "pass the plain initializer"):
      pe_flax.Embed(VOCAB, 16, ctx, embedding_init=nn.with_partitioning(
          pe_flax.default_embed_init, (None, "x"))).init(jax.random.key(0),
                                                         ids)
    with self.assertRaisesRegex(ValueError, "Input type must be an integer"):
      pe_flax.Embed(VOCAB, 16, ctx).init(jax.random.key(0), ids * 1.0)


class HaikuEmbedTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_matches_hk_embed(self, layout, dtypes, ids_shape):
    dtype = DTYPES[dtypes][0]
    ctx = make_ctx(layout, ids_shape)
    ids, ids_dev = in_range_ids(ctx, ids_shape)
    ref = hk.without_apply_rng(hk.transform(
        lambda i: hk.Embed(VOCAB, ctx.emb_width)(i)))
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        f = hk.without_apply_rng(hk.transform(
            lambda i, b=backend: pe_haiku.Embed(
                VOCAB, ctx.emb_width, ctx, dtype=dtype, backend=b)(i)))
        params = f.init(jax.random.key(3), ids_dev)
        self.assertEqual(list(params), ["embed"])
        table = params["embed"]["embeddings"]
        self.assertEqual(table.shape, (VOCAB, ctx.emb_width))
        self.assertEqual(table.dtype, dtype)
        assert_table_sharded(self, ctx, table)
        if dtype == jnp.float32:  # hk.Embed only makes f32 tables.
          test_util.assert_bits_equal(
              self, table, ref.init(jax.random.key(3), ids)["embed"]
              ["embeddings"])
        # hk.Embed on the same (host) params.
        expected = ref.apply(jax.device_get(params), ids)
        out = jax.jit(f.apply)(params, ids_dev)
        self.assertEqual(out.shape, ids_shape + (ctx.emb_width,))
        test_util.assert_bits_equal(self, out, expected)
        self.assertTrue(out.sharding.is_equivalent_to(
            pe.token_sharding(ctx), out.ndim))

  def test_init_stats_and_edge_ids(self):
    ctx = make_ctx("8ranks", (16,))
    ids = np.array([VOCAB, VOCAB + 5, -VOCAB - 1, 2**31 - 1, -2**31, -1, 0,
                    3] * 2, np.int32)
    ids_dev = jax.device_put(ids, pe.token_sharding(ctx))
    f = hk.without_apply_rng(hk.transform(
        lambda i: pe_haiku.Embed(64, ctx.emb_width, ctx, backend="xla")(i)))
    params = jax.jit(f.init)(jax.random.key(0), ids_dev)
    table = params["embed"]["embeddings"]
    assert_table_sharded(self, ctx, table)
    # TruncatedNormal(stddev=1) cut at 2 sigma: std 0.88, |w| <= 2.
    self.assertAlmostEqual(float(np.std(table)), 0.88, delta=0.1)
    self.assertLessEqual(float(np.abs(table).max()), 2.0)
    # Every int32 id, out of range included: the rows hk.Embed gives.
    ref = hk.without_apply_rng(hk.transform(
        lambda i: hk.Embed(64, ctx.emb_width)(i)))
    test_util.assert_bits_equal(self, f.apply(params, ids_dev),
                                ref.apply(jax.device_get(params), ids))

  def test_shard_params_recipe(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.arange(8, dtype=np.int32)
    ids_dev = jax.device_put(ids, pe.token_sharding(ctx))

    def tower(i, ours):
      embed = (pe_haiku.Embed(VOCAB, ctx.emb_width, ctx, backend="xla")
               if ours else hk.Embed(VOCAB, ctx.emb_width))
      e = embed(i)
      return e, hk.Linear(1)(e)

    f = hk.without_apply_rng(hk.transform(functools.partial(tower, ours=True)))
    ref = hk.without_apply_rng(hk.transform(
        functools.partial(tower, ours=False)))
    host_params = ref.init(jax.random.key(0), ids)  # not column-sharded
    # Uncommitted (fresh from init): the eager lookup places it itself.
    test_util.assert_bits_equal(self, f.apply(host_params, ids_dev)[0],
                                ref.apply(host_params, ids)[0])
    # A table committed elsewhere (e.g. to one device): a clear error.
    committed = {"embed": {"embeddings": jax.device_put(
        host_params["embed"]["embeddings"], jax.devices()[0])},
                 "linear": host_params["linear"]}
    with self.assertRaisesRegex(ValueError,
                                r"jax.device_put\(table, pallas_emb.table"):
      f.apply(committed, ids_dev)
    for params in (pe_haiku.shard_params(ctx, committed),
                   pe_haiku.shard_params(ctx, host_params, "embed")):
      assert_table_sharded(self, ctx, params["embed"]["embeddings"])
      self.assertIs(params["linear"]["w"], host_params["linear"]["w"])
      test_util.assert_bits_equal(self, f.apply(params, ids_dev)[0],
                                  ref.apply(host_params, ids)[0])
    with self.assertRaisesRegex(ValueError, "module 'linear' has no"):
      pe_haiku.shard_params(ctx, host_params, "linear")
    with self.assertRaisesRegex(ValueError, "found no 'embeddings' param"):
      pe_haiku.shard_params(ctx, {"linear": host_params["linear"]})

  def test_errors(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.zeros(8, np.int32)
    with self.assertRaisesRegex(
        ValueError, r"pallas_emb.haiku.Embed embed_dim=8 does not match the "
        r"context's emb_width=16\. Make the context with emb_width=8"):
      hk.transform(lambda i: pe_haiku.Embed(VOCAB, 8, ctx)(i)).init(
          jax.random.key(0), ids)
    with self.assertRaisesRegex(ValueError, "must take an array of integer"):
      hk.transform(lambda i: pe_haiku.Embed(VOCAB, 16, ctx)(i)).init(
          jax.random.key(0), ids * 1.0)


# --- training: embedding -> mean over L -> dense -> MSE ----------------------

B, L = 8, 2


class FlaxTower(nn.Module):
  ctx: pe.EmbeddingContext | None = None  # None: nn.Embed
  backend: str | None = None

  @nn.compact
  def __call__(self, ids):
    width = 16
    if self.ctx is None:
      embed = nn.Embed(VOCAB, width, name="embed")
    else:
      embed = pe_flax.Embed(VOCAB, width, self.ctx, backend=self.backend,
                            name="embed")
    return nn.Dense(1, name="dense")(embed(ids).mean(axis=1))[:, 0]


def haiku_tower(ids, ctx=None, backend=None):
  embed = (hk.Embed(VOCAB, 16) if ctx is None else
           pe_haiku.Embed(VOCAB, 16, ctx, backend=backend))
  return hk.Linear(1)(embed(ids).mean(axis=1))[:, 0]


def train(test, loss_fn, params, steps=30):
  opt = optax.adam(0.05)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = opt.init(params)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  test.assertTrue(np.isfinite(losses).all(), losses)
  test.assertLess(losses[-1], 0.5 * losses[0], losses)
  return params


def grads_close(test, ours, theirs):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  test.assertEqual(ours.shape, theirs.shape)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6,
                             atol=1e-6 * np.abs(theirs).max())


class TrainingTest(parameterized.TestCase):

  @parameterized.parameters("8ranks", "8ranks_explicit")
  def test_flax(self, layout):
    ctx = make_ctx(layout, (B, L), shard_width=16 // LAYOUTS[layout][0]["x"])
    ids, ids_dev = in_range_ids(ctx, (B, L), seed=4)
    target = np.random.default_rng(5).standard_normal(B).astype(np.float32)
    ref = FlaxTower()
    ref_params = ref.init(jax.random.key(0), ids)["params"]
    ref_loss = lambda p: jnp.mean((ref.apply({"params": p}, ids) - target)**2)
    ref_grad = jax.jit(jax.grad(ref_loss))(ref_params)
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        model = FlaxTower(ctx, backend)
        # Flax's recipe: every param on the mesh (the dense ones replicated,
        # which Explicit axes need for the dense layer's gradient).
        abstract = jax.eval_shape(model.init, jax.random.key(0), ids_dev)
        params = jax.jit(model.init,
                         out_shardings=nn.get_sharding(abstract, ctx.mesh))(
                             jax.random.key(0), ids_dev)["params"]
        test_util.assert_bits_equal(self, params["embed"]["embedding"].value,
                                    ref_params["embed"]["embedding"])
        loss = lambda p, m=model: jnp.mean(
            (m.apply({"params": p}, ids_dev) - target)**2)
        grad = jax.jit(jax.grad(loss))(params)
        emb_grad = grad["embed"]["embedding"].value
        assert_table_sharded(self, ctx, emb_grad)
        grads_close(self, emb_grad, ref_grad["embed"]["embedding"])
        grads_close(self, grad["dense"]["kernel"],
                    ref_grad["dense"]["kernel"])
        trained = train(self, loss, params)
        assert_table_sharded(self, ctx,
                             trained["embed"]["embedding"].value)

  @parameterized.parameters("8ranks", "8ranks_explicit")
  def test_haiku(self, layout):
    ctx = make_ctx(layout, (B, L), shard_width=2)
    ids, ids_dev = in_range_ids(ctx, (B, L), seed=6)
    target = np.random.default_rng(7).standard_normal(B).astype(np.float32)
    ref = hk.without_apply_rng(hk.transform(haiku_tower))
    ref_params = ref.init(jax.random.key(0), ids)
    ref_loss = lambda p: jnp.mean((ref.apply(p, ids) - target)**2)
    ref_grad = jax.jit(jax.grad(ref_loss))(ref_params)
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        f = hk.without_apply_rng(hk.transform(
            functools.partial(haiku_tower, ctx=ctx, backend=backend)))
        params = f.init(jax.random.key(0), ids_dev)
        assert_table_sharded(self, ctx, params["embed"]["embeddings"])
        # The dense params replicated on the mesh (Explicit axes need it for
        # the dense layer's gradient).
        params["linear"] = jax.device_put(params["linear"],
                                          pe.replicated_sharding(ctx))
        test_util.assert_bits_equal(self, params["embed"]["embeddings"],
                                    ref_params["embed"]["embeddings"])
        loss = lambda p, f=f: jnp.mean((f.apply(p, ids_dev) - target)**2)
        grad = jax.jit(jax.grad(loss))(params)
        assert_table_sharded(self, ctx, grad["embed"]["embeddings"])
        grads_close(self, grad["embed"]["embeddings"],
                    ref_grad["embed"]["embeddings"])
        grads_close(self, grad["linear"]["w"], ref_grad["linear"]["w"])
        trained = train(self, loss, params)
        assert_table_sharded(self, ctx, trained["embed"]["embeddings"])


class ShadowingTest(absltest.TestCase):

  def test_package_modules_do_not_shadow_frameworks(self):
    # pylint: disable=g-import-not-at-top
    import flax
    from pallas_emb.layers import flax as layers_flax
    from pallas_emb.layers import haiku as layers_haiku
    # pylint: enable=g-import-not-at-top
    self.assertIs(layers_flax.nn, flax.linen)
    self.assertIs(layers_haiku.hk, hk)
    self.assertIs(pe_flax.Embed, layers_flax.Embed)
    self.assertIs(pe_haiku.Embed, layers_haiku.Embed)
    self.assertNotIn("pallas_emb", flax.__file__)
    self.assertNotIn("pallas_emb", hk.__file__)

  def test_package_dir_on_sys_path_is_a_clear_error(self):
    package_dir = os.path.dirname(pe.__file__)
    for name in ("flax", "haiku"):
      result = subprocess.run(
          [sys.executable, "-c", f"import {name}"], capture_output=True,
          text=True, check=False,
          env=dict(os.environ, PYTHONPATH=package_dir))
      self.assertNotEqual(result.returncode, 0)
      self.assertIn(f"was imported as the top-level module `{name}`",
                    result.stderr)


if __name__ == "__main__":
  absltest.main()
