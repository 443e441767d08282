"""pallas_emb.haiku: Embed against hk.Embed, the EmbeddingCollection module.

Models the tests compare against (never pallas_emb itself): `hk.Embed` (same
params from the same key, the same rows for every int32 id, the same
gradients under plain `jax.grad`) and numpy / jnp `table[ids]` for the
collection module.
"""

import test_util  # pylint: disable=g-bad-import-order  (8 CPU devices first)

import functools
import os
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
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
  """Ids in [-VOCAB, VOCAB), on the token axes."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(-VOCAB, VOCAB, size=ids_shape).astype(np.int32)
  ids.reshape(-1)[:4] = [0, VOCAB - 1, -1, -VOCAB]
  return ids, jax.device_put(ids, pe.token_sharding(ctx))


def assert_table_sharded(test, mesh, x):
  expected = jax.sharding.NamedSharding(mesh,
                                        jax.sharding.PartitionSpec(None, "x"))
  test.assertTrue(x.sharding.is_equivalent_to(expected, 2),
                  f"table sharded as {x.sharding}")


CASES = [
    dict(testcase_name=f"_{layout}_{dtype.__name__}_{len(ids_shape)}d",
         layout=layout, dtype=dtype, ids_shape=ids_shape)
    for layout, dtype, ids_shape in [
        ("8ranks", jnp.float32, (16,)),
        ("8ranks", BF16, (8, 2)),
        ("4ranks", BF16, (8, 2)),
        ("8ranks_explicit", jnp.float32, (8, 2)),
    ]
]


def grads_close(test, ours, theirs):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  test.assertEqual(ours.shape, theirs.shape)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6,
                             atol=1e-6 * np.abs(theirs).max())


def train_with_optax(test, loss_fn, params, steps=30):
  """Plain jax.grad + optax.adam; asserts the loss halves."""
  opt = optax.adam(0.05)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = test_util.on_mesh_of(opt.init(params), params)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  test.assertTrue(np.isfinite(losses).all(), losses)
  test.assertLess(losses[-1], 0.5 * losses[0], losses)
  return params


def transform(fn):
  return hk.without_apply_rng(hk.transform(fn))


class EmbedTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_matches_hk_embed(self, layout, dtype, ids_shape):
    ctx = make_ctx(layout, ids_shape)
    ids, ids_dev = in_range_ids(ctx, ids_shape)
    ref = transform(lambda i: hk.Embed(VOCAB, ctx.emb_width)(i))
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        f = transform(lambda i, b=backend: pe_haiku.Embed(
            VOCAB, ctx.emb_width, ctx, dtype=dtype, backend=b)(i))
        params = f.init(jax.random.key(3), ids_dev)
        self.assertEqual(list(params), ["embed"])
        table = params["embed"]["embeddings"]
        self.assertEqual(table.shape, (VOCAB, ctx.emb_width))
        self.assertEqual(table.dtype, dtype)
        assert_table_sharded(self, ctx.mesh, table)
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
    f = transform(
        lambda i: pe_haiku.Embed(64, ctx.emb_width, ctx, backend="xla")(i))
    params = jax.jit(f.init)(jax.random.key(0), ids_dev)
    table = params["embed"]["embeddings"]
    assert_table_sharded(self, ctx.mesh, table)
    # TruncatedNormal(stddev=1) cut at 2 sigma: std 0.88, |w| <= 2.
    self.assertAlmostEqual(float(np.std(table)), 0.88, delta=0.1)
    self.assertLessEqual(float(np.abs(table).max()), 2.0)
    # Every int32 id, out of range included: the rows hk.Embed gives.
    ref = transform(lambda i: hk.Embed(64, ctx.emb_width)(i))
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

    f = transform(functools.partial(tower, ours=True))
    ref = transform(functools.partial(tower, ours=False))
    host_params = ref.init(jax.random.key(0), ids)  # not column-sharded
    # Uncommitted (fresh from init): the eager lookup places it itself.
    test_util.assert_bits_equal(self, f.apply(host_params, ids_dev)[0],
                                ref.apply(host_params, ids)[0])
    # A table committed elsewhere (e.g. to one device): a clear error.
    committed = {"embed": {"embeddings": jax.device_put(
        host_params["embed"]["embeddings"], jax.devices()[0])},
                 "linear": host_params["linear"]}
    with self.assertRaisesRegex(pe.ShardingError,
                                r"jax.device_put\(table, pallas_emb.table"):
      f.apply(committed, ids_dev)
    for params in (pe_haiku.shard_params(ctx, committed),
                   pe_haiku.shard_params(ctx, host_params, "embed")):
      assert_table_sharded(self, ctx.mesh, params["embed"]["embeddings"])
      self.assertIs(params["linear"]["w"], host_params["linear"]["w"])
      test_util.assert_bits_equal(self, f.apply(params, ids_dev)[0],
                                  ref.apply(host_params, ids)[0])
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.haiku.shard_params: module 'linear' has "
        r"no 'embeddings' param; modules with params are \['embed', "
        r"'linear'\]"):
      pe_haiku.shard_params(ctx, host_params, "linear")
    with self.assertRaisesRegex(
        pe.InputError, r"found no 'embeddings' param of width 16 \(the "
        r"context's emb_width\) in modules \['linear'\]\. Pass modules="):
      pe_haiku.shard_params(ctx, {"linear": host_params["linear"]})

  def test_errors(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.zeros(8, np.int32)
    key = jax.random.key(0)

    def init(ids, *args, **kwargs):
      return transform(lambda i: pe_haiku.Embed(*args, **kwargs)(i)).init(
          key, ids)

    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.haiku.Embed embed_dim=8 does not match "
        r"the context's emb_width=16\. Make the context with emb_width=8"):
      init(ids, VOCAB, 8, ctx)
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.haiku.Embed ctx must be a "
        r"pallas_emb.EmbeddingContext; got Mesh"):
      init(ids, VOCAB, 16, ctx.mesh)
    with self.assertRaisesRegex(
        pe.InputError, r"needs a positive vocab_size and embed_dim; got "
        r"vocab_size=0"):
      init(ids, 0, 16, ctx)
    # hk.Embed's sentence (a ValueError too), then how to fix it.
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.haiku.Embed's __call__ method must take "
        r"an array of integer dtype but was called with an array of float32; "
        r"cast the ids"):
      init(ids * 1.0, VOCAB, 16, ctx)
    with self.assertRaisesRegex(pe.InputError,
                                r"expected tokens_per_batch=8 ids"):
      init(np.zeros(16, np.int32), VOCAB, 16, ctx)
    with self.assertRaisesRegex(pe.InputError,
                                r"padding_id=1.5 must be an int id or None"):
      init(ids, VOCAB, 16, ctx, padding_id=1.5)


# --- plain jax.grad + optax training ---------------------------------------

B, L = 8, 2


def haiku_tower(ids, ctx=None, backend=None, padding_id=None):
  embed = (hk.Embed(VOCAB, 16) if ctx is None else
           pe_haiku.Embed(VOCAB, 16, ctx, backend=backend,
                          padding_id=padding_id))
  return hk.Linear(1)(embed(ids).mean(axis=1))[:, 0]


class GradTrainingTest(parameterized.TestCase):

  @parameterized.parameters("8ranks", "8ranks_explicit")
  def test_same_gradients_as_hk_embed_and_learns(self, layout):
    ctx = make_ctx(layout, (B, L), shard_width=2)
    ids, ids_dev = in_range_ids(ctx, (B, L), seed=6)
    target = np.random.default_rng(7).standard_normal(B).astype(np.float32)
    ref = transform(haiku_tower)
    ref_params = ref.init(jax.random.key(0), ids)
    ref_loss = lambda p: jnp.mean((ref.apply(p, ids) - target)**2)
    ref_grad = jax.jit(jax.grad(ref_loss))(ref_params)
    # Row 0 is looked up (in_range_ids starts with it) and has a gradient.
    self.assertTrue(np.any(ref_grad["embed"]["embeddings"][0] != 0))
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        f = transform(functools.partial(haiku_tower, ctx=ctx,
                                        backend=backend))
        params = f.init(jax.random.key(0), ids_dev)
        assert_table_sharded(self, ctx.mesh, params["embed"]["embeddings"])
        # The dense params replicated on the mesh (Explicit axes need it for
        # the dense layer's gradient).
        params["linear"] = jax.device_put(params["linear"],
                                          pe.replicated_sharding(ctx))
        test_util.assert_bits_equal(self, params["embed"]["embeddings"],
                                    ref_params["embed"]["embeddings"])
        loss = lambda p, f=f: jnp.mean((f.apply(p, ids_dev) - target)**2)
        grad = jax.jit(jax.grad(loss))(params)
        assert_table_sharded(self, ctx.mesh, grad["embed"]["embeddings"])
        grads_close(self, grad["embed"]["embeddings"],
                    ref_grad["embed"]["embeddings"])
        grads_close(self, grad["linear"]["w"], ref_grad["linear"]["w"])
        trained = train_with_optax(self, loss, params)
        assert_table_sharded(self, ctx.mesh, trained["embed"]["embeddings"])

  def test_padding_id_gets_no_gradient(self):
    # padding_id=3: row 3 is looked up as usual but gets no gradient; every
    # other row gets hk.Embed's gradient.
    ctx = make_ctx("8ranks", (B, L))
    ids, _ = in_range_ids(ctx, (B, L), seed=6)
    ids[1, :] = 3
    ids_dev = jax.device_put(ids, pe.token_sharding(ctx))
    target = np.random.default_rng(7).standard_normal(B).astype(np.float32)
    f = transform(functools.partial(haiku_tower, ctx=ctx, backend="xla",
                                    padding_id=3))
    params = f.init(jax.random.key(0), ids_dev)
    ref = transform(haiku_tower)
    host = jax.device_get(params)
    ref_grad = jax.jit(jax.grad(
        lambda p: jnp.mean((ref.apply(p, ids) - target)**2)))(host)
    expected = np.array(ref_grad["embed"]["embeddings"])
    self.assertTrue(np.any(expected[3] != 0))
    expected[3] = 0
    embed = transform(lambda i: pe_haiku.Embed(VOCAB, 16, ctx,
                                               padding_id=3)(i))
    hk_embed = transform(lambda i: hk.Embed(VOCAB, 16)(i))
    test_util.assert_bits_equal(self, embed.apply(params, ids_dev),
                                hk_embed.apply(host, ids))
    grad = jax.jit(jax.grad(
        lambda p: jnp.mean((f.apply(p, ids_dev) - target)**2)))(params)
    grads_close(self, grad["embed"]["embeddings"], expected)
    grads_close(self, grad["linear"]["w"], ref_grad["linear"]["w"])


# --- the EmbeddingCollection module ------------------------------------------

SEQ = 3


def three_table_collection(mesh, backend, placements=("column",) * 3):
  """3 tables (users + items stack, genre alone), 4 features: "item" and
  the [B, SEQ] "history" share the items table."""
  opt = pe.RowwiseAdagrad(0.2)
  users, items, genre = placements
  return pe.EmbeddingCollection(
      [pe.TableSpec("users", 23, 16, optimizer=opt, placement=users),
       pe.TableSpec("items", 29, 16, optimizer=opt, placement=items),
       pe.TableSpec("genre", 7, 8, optimizer=opt, placement=genre)],
      [pe.FeatureSpec("user", "users"), pe.FeatureSpec("item", "items"),
       pe.FeatureSpec("history", "items"), pe.FeatureSpec("genre", "genre")],
      mesh, "x", backend=backend)


def collection_batch(mesh, batch_size, seed):
  rng = np.random.default_rng(seed)
  batch = {"user": rng.integers(0, 23, batch_size),
           "item": rng.integers(0, 29, batch_size),
           "history": rng.integers(-29, 29, (batch_size, SEQ)),
           "genre": rng.integers(0, 7, batch_size)}
  batch = {k: v.astype(np.int32) for k, v in batch.items()}
  batch["item"][:2] = 0
  batch["label"] = rng.standard_normal(batch_size).astype(np.float32)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  return batch, jax.device_put(batch, sharding)


def head(emb):
  x = jnp.concatenate([emb["user"], emb["item"],
                       jnp.mean(emb["history"], axis=1), emb["genre"]],
                      axis=-1)
  return hk.Linear(1, name="out")(jax.nn.relu(hk.Linear(8, name="hidden")(
      x)))[:, 0]


def gathered(coll, tables, batch):
  """`table[ids]` per feature (ids wrapped once: all in range)."""
  out = {}
  for name, spec in coll.features.items():
    rows = coll.tables[spec.table].vocab_rows
    ids = batch[name]
    out[name] = tables[spec.table][jnp.where(ids < 0, ids + rows, ids)]
  return out


class EmbeddingCollectionModuleTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh({"x": 8})
    cls.host, cls.batch = collection_batch(cls.mesh, 16, 0)

  def _logical(self, coll, stacks):
    return coll.table_arrays(coll.state_from_stacks(stacks))

  def test_init_and_lookup(self):
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        coll = three_table_collection(self.mesh, backend)
        f = transform(lambda b, c=coll: pe_haiku.EmbeddingCollection(
            c, name="embed")(b))
        params = jax.jit(f.init)(jax.random.key(0), self.batch)
        self.assertEqual(list(params), ["embed"])
        self.assertEqual(set(params["embed"]), {"stack0", "stack1"})
        for stack in coll.plan.stacks:
          table = params["embed"][stack.name]
          self.assertEqual(table.shape, (stack.total_rows, stack.emb_width))
          self.assertEqual(table.dtype, stack.dtype)
          assert_table_sharded(self, self.mesh, table)
        tables = self._logical(coll, params["embed"])
        for name, spec in coll.tables.items():
          # Each table from its own initializer (nn.Embed's by default).
          self.assertAlmostEqual(float(np.std(tables[name])),
                                 spec.emb_width**-0.5,
                                 delta=0.3 * spec.emb_width**-0.5, msg=name)
        out = jax.jit(f.apply)(params, self.batch)
        expected = gathered(coll, jax.device_get(tables), self.host)
        self.assertEqual(set(out), set(coll.features))
        self.assertEqual(out["history"].shape, (16, SEQ, 16))
        for name in coll.features:
          test_util.assert_bits_equal(self, out[name],
                                      np.asarray(expected[name]), name)
        # Another batch size works (read from the ids at each call).
        small_host, small = collection_batch(self.mesh, 8, 1)
        out = jax.jit(f.apply)(params, small)
        expected = gathered(coll, jax.device_get(tables), small_host)
        for name in coll.features:
          test_util.assert_bits_equal(self, out[name],
                                      np.asarray(expected[name]), name)

  def test_jax_grad_and_optax(self):
    coll = three_table_collection(self.mesh, "xla")

    def model(batch):
      return head(pe_haiku.EmbeddingCollection(coll, name="embed")(batch))

    f = transform(model)
    params = jax.jit(f.init)(jax.random.key(0), self.batch)
    params = {k: v if k == "embed" else jax.device_put(
        v, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
              for k, v in params.items()}

    def loss(p, batch):
      return jnp.mean((f.apply(p, batch) - batch["label"])**2)

    # The reference: the same head on jnp gathers of the logical tables.
    ref_f = transform(lambda tables, batch: head(gathered(coll, tables,
                                                          batch)))

    def ref_loss(tables, dense, batch):
      return jnp.mean((ref_f.apply(dense, tables, batch) - batch["label"])**2)

    tables = jax.device_get(self._logical(coll, params["embed"]))
    dense = jax.device_get({k: v for k, v in params.items() if k != "embed"})
    ref_tables_grad, ref_dense_grad = jax.grad(ref_loss, argnums=(0, 1))(
        tables, dense, self.host)
    grad = jax.jit(jax.grad(loss))(params, self.batch)
    for stack in coll.plan.stacks:
      assert_table_sharded(self, self.mesh, grad["embed"][stack.name])
    grad_tables = self._logical(coll, grad["embed"])
    for name in coll.tables:
      self.assertTrue(np.any(np.asarray(ref_tables_grad[name]) != 0), name)
      grads_close(self, grad_tables[name], ref_tables_grad[name])
    grads_close(self, grad["out"]["w"], ref_dense_grad["out"]["w"])
    trained = train_with_optax(self, functools.partial(loss,
                                                       batch=self.batch),
                               params)
    for stack in coll.plan.stacks:
      assert_table_sharded(self, self.mesh, trained["embed"][stack.name])

  def test_mixed_placements(self):
    """Row, table and replicated tables: each stack's param lies as the
    collection places it, the lookup is `table[ids]` of the logical
    tables, and plain jax.grad gives the reference's table gradients."""
    mesh = test_util.mesh({"x": 2})
    host, batch = collection_batch(mesh, 4, 2)
    coll = three_table_collection(mesh, "xla",
                                  ("row", "table", "replicated"))
    self.assertEqual([s.placement for s in coll.plan.stacks],
                     ["row", "table", "replicated"])
    f = transform(lambda b: head(pe_haiku.EmbeddingCollection(
        coll, name="embed")(b)))
    params = jax.jit(f.init)(jax.random.key(0), batch)
    for stack in coll.plan.stacks:
      self.assertTrue(params["embed"][stack.name].sharding.is_equivalent_to(
          coll.stack_sharding(stack), 2), stack.name)
    tables = jax.device_get(self._logical(coll, params["embed"]))
    emb = jax.jit(transform(lambda b: pe_haiku.EmbeddingCollection(
        coll, name="embed")(b)).apply)({"embed": params["embed"]},
                                       batch)
    expected = gathered(coll, tables, host)
    for name in coll.features:
      test_util.assert_bits_equal(self, emb[name], np.asarray(expected[name]),
                                  name)
    dense = jax.device_get({k: v for k, v in params.items() if k != "embed"})
    ref_f = transform(lambda tables, batch: head(gathered(coll, tables,
                                                          batch)))
    ref_grad = jax.grad(lambda t: jnp.mean((ref_f.apply(
        dense, t, host) - host["label"])**2))(tables)
    params = {k: v if k == "embed" else jax.device_put(
        v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
              for k, v in params.items()}
    grad = jax.jit(jax.grad(lambda p: jnp.mean(
        (f.apply(p, batch) - batch["label"])**2)))(params)
    grad_tables = self._logical(coll, grad["embed"])
    for name in coll.tables:
      self.assertTrue(np.any(np.asarray(ref_grad[name]) != 0), name)
      grads_close(self, grad_tables[name], ref_grad[name])

  def test_errors(self):
    coll = three_table_collection(self.mesh, "xla")
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.haiku.EmbeddingCollection collection is "
        r"a CollectionPlan; expected a pallas_emb.EmbeddingCollection"):
      transform(lambda b: pe_haiku.EmbeddingCollection(coll.plan)(b)).init(
          jax.random.key(0), self.batch)


class ShadowingTest(absltest.TestCase):

  def test_does_not_shadow_haiku(self):
    self.assertIs(pe_haiku.hk, hk)
    self.assertNotIn("pallas_emb", hk.__file__)
    for cls in (pe_haiku.Embed, pe_haiku.EmbeddingCollection):
      self.assertEqual(cls.__module__, "pallas_emb.haiku")

  def test_package_dir_on_sys_path_is_a_clear_error(self):
    package_dir = os.path.dirname(pe.__file__)
    result = subprocess.run(
        [sys.executable, "-c", "import haiku"], capture_output=True,
        text=True, check=False, env=dict(os.environ, PYTHONPATH=package_dir))
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("was imported as the top-level module `haiku`",
                  result.stderr)



class WideIdsTest(absltest.TestCase):
  """uint32 ids past int32 are never wrapped onto another row."""

  def test_uint32_ids(self):
    ctx = make_ctx("8ranks", (8,))
    values = np.array([2**32 - 2, 2**31 + 5, 2**31, 2**31 - 1, 5, 0, 63, 1],
                      np.uint32)
    f = transform(
        lambda i: pe_haiku.Embed(64, ctx.emb_width, ctx, backend="xla")(i))
    params = f.init(jax.random.key(0), np.zeros(8, np.int32))
    table = np.asarray(params["embed"]["embeddings"])
    ids = jax.device_put(jnp.asarray(values), pe.token_sharding(ctx))
    # Traced: past int32 is past the table, clamped onto the last row; a
    # cast would wrap 2**32 - 2 onto row 62.
    out = jax.jit(f.apply)(params, ids)
    rows = np.minimum(values.astype(np.int64), 63)
    test_util.assert_bits_equal(self, out, table[rows])
    # Concrete: checked before tracing.
    with self.assertRaisesRegex(pe.InputError, "^pallas_emb haiku.Embed ids "
                                r"holds ids in \[0, 4294967294\], outside "
                                "int32"):
      f.apply(params, ids)

  def test_numpy_int64_ids(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.array([2**32 + 3, 0, 1, 2, 3, 4, 5, 6], np.int64)
    f = transform(
        lambda i: pe_haiku.Embed(64, ctx.emb_width, ctx, backend="xla")(i))
    params = f.init(jax.random.key(0), np.zeros(8, np.int32))
    # jnp.asarray(ids) would be [3, 0, ...] (x64 off): a real row.
    with self.assertRaisesRegex(pe.InputError, re.escape(
        "ids holds ids in [0, 4294967299], outside int32")):
      f.apply(params, ids)
    ids[0] = 7  # in range: the same rows as int32 ids
    test_util.assert_bits_equal(self, f.apply(params, ids),
                                f.apply(params, ids.astype(np.int32)))


if __name__ == "__main__":
  absltest.main()
