"""pallas_emb.flax: Embed, the EmbeddingCollection module and FlaxTrainer.

Models the tests compare against (never pallas_emb itself):
  * `nn.Embed`: same params from the same key, bit-identical lookups for
    in-range ids, the same gradients under plain `jax.grad`;
  * numpy `table[ids]` for the collection module's lookups;
  * the TwoTower model on `nn.Embed` trained with `jax.grad`, its tables
    updated by row-wise Adagrad in jnp on the dense table
    gradient (one step late when pipelined), for FlaxTrainer;
  * `pallas_emb.Trainer` on the same collection (bit for bit) for FlaxTrainer
    over an `EmbeddingCollection` module.
"""

import test_util  # pylint: disable=g-bad-import-order  (8 CPU devices first)

import functools
import importlib
import os
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import datasets
from pallas_emb import flax as pe_flax

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


def assert_table_sharded(test, ctx_or_mesh, x):
  mesh = getattr(ctx_or_mesh, "mesh", ctx_or_mesh)
  expected = jax.sharding.NamedSharding(mesh,
                                        jax.sharding.PartitionSpec(None, "x"))
  test.assertTrue(x.sharding.is_equivalent_to(expected, 2),
                  f"table sharded as {x.sharding}")


# (param_dtype, dtype) of the layer.
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


# --- Embed against nn.Embed --------------------------------------------------


class EmbedTest(parameterized.TestCase):

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
    ref = nn.Embed(64, ctx.emb_width).init(jax.random.key(0), ids)
    for variables in (jax.jit(layer.init, out_shardings=shardings)(key,
                                                                   ids_dev),
                      jax.jit(layer.init)(key, ids_dev),
                      layer.init(key, ids_dev)):
      table = variables["params"]["embedding"].value
      self.assertEqual(table.shape, (64, ctx.emb_width))
      self.assertEqual(table.dtype, jnp.float32)
      assert_table_sharded(self, ctx, table)
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
    key = jax.random.key(0)
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.flax.Embed features=8 does not match the "
        r"context's emb_width=16\. Make the context with emb_width=8"):
      pe_flax.Embed(VOCAB, 8, ctx).init(key, ids)
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.flax.Embed ctx must be a "
        r"pallas_emb.EmbeddingContext; got Mesh\. Build one with "
        r"pallas_emb.make_context"):
      pe_flax.Embed(VOCAB, 16, ctx.mesh).init(key, ids)
    with self.assertRaisesRegex(pe.InputError, "pass the plain initializer"):
      pe_flax.Embed(VOCAB, 16, ctx, embedding_init=nn.with_partitioning(
          pe_flax.default_embed_init, (None, "x"))).init(key, ids)
    # nn.Embed's sentence, then what was given and how to fix it.
    with self.assertRaisesRegex(
        pe.InputError, r"Input type must be an integer or unsigned integer; "
        r"pallas_emb.flax.Embed got ids of dtype float32\. Cast them"):
      pe_flax.Embed(VOCAB, 16, ctx).init(key, ids * 1.0)
    with self.assertRaisesRegex(pe.InputError,
                                r"expected tokens_per_batch=8 ids"):
      pe_flax.Embed(VOCAB, 16, ctx).init(key, np.zeros(16, np.int32))
    with self.assertRaisesRegex(pe.InputError,
                                r"padding_id='0' must be an int id or None"):
      pe_flax.Embed(VOCAB, 16, ctx, padding_id="0").init(key, ids)


# --- plain jax.grad + optax training ------------------------------------------

B, L = 8, 2


class Tower(nn.Module):
  """embedding -> mean over L -> dense: nn.Embed (ctx None) or ours."""
  ctx: pe.EmbeddingContext | None = None
  backend: str | None = None
  padding_id: int | None = None

  @nn.compact
  def __call__(self, ids):
    width = 16
    if self.ctx is None:
      embed = nn.Embed(VOCAB, width, name="embed")
    else:
      embed = pe_flax.Embed(VOCAB, width, self.ctx, backend=self.backend,
                            padding_id=self.padding_id, name="embed")
    return nn.Dense(1, name="dense")(embed(ids).mean(axis=1))[:, 0]


class GradTrainingTest(parameterized.TestCase):

  @parameterized.parameters("8ranks", "8ranks_explicit")
  def test_same_gradients_as_nn_embed_and_learns(self, layout):
    ctx = make_ctx(layout, (B, L), shard_width=16 // LAYOUTS[layout][0]["x"])
    ids, ids_dev = in_range_ids(ctx, (B, L), seed=4)
    target = np.random.default_rng(5).standard_normal(B).astype(np.float32)
    ref = Tower()
    ref_params = ref.init(jax.random.key(0), ids)["params"]
    ref_loss = lambda p: jnp.mean((ref.apply({"params": p}, ids) - target)**2)
    ref_grad = jax.jit(jax.grad(ref_loss))(ref_params)
    # Row 0 is looked up (in_range_ids starts with it) and has a gradient.
    self.assertTrue(np.any(ref_grad["embed"]["embedding"][0] != 0))
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        model = Tower(ctx, backend)
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
        trained = train_with_optax(self, loss, params)
        assert_table_sharded(self, ctx,
                             trained["embed"]["embedding"].value)

  def test_padding_id_gets_no_gradient(self):
    # padding_id=3: row 3 is looked up as usual but gets no gradient; every
    # other row gets nn.Embed's gradient.
    ctx = make_ctx("8ranks", (B, L))
    ids, ids_dev = in_range_ids(ctx, (B, L), seed=4)
    ids[1, :] = 3
    ids_dev = jax.device_put(ids, pe.token_sharding(ctx))
    target = np.random.default_rng(5).standard_normal(B).astype(np.float32)
    ref = Tower()
    params = nn.unbox(Tower(ctx, "xla", padding_id=3).init(
        jax.random.key(0), ids_dev))["params"]
    ref_loss = lambda p: jnp.mean((ref.apply({"params": p}, ids) - target)**2)
    ref_grad = jax.jit(jax.grad(ref_loss))(jax.device_get(params))
    self.assertTrue(np.any(ref_grad["embed"]["embedding"][3] != 0))
    expected = np.array(ref_grad["embed"]["embedding"])
    expected[3] = 0
    model = Tower(ctx, "xla", padding_id=3)
    # The same rows, padding included.
    embed = {"params": params["embed"]}
    test_util.assert_bits_equal(
        self, pe_flax.Embed(VOCAB, 16, ctx, padding_id=3).apply(embed,
                                                                ids_dev),
        nn.Embed(VOCAB, 16).apply(jax.device_get(embed), ids))
    grad = jax.jit(jax.grad(lambda p: jnp.mean(
        (model.apply({"params": p}, ids_dev) - target)**2)))(params)
    grads_close(self, grad["embed"]["embedding"], expected)
    grads_close(self, grad["dense"]["kernel"], ref_grad["dense"]["kernel"])


# --- FlaxTrainer over Embed layers: TwoTower ----------------------------------

BATCH = 64
WIDTH = 16
STEPS = 50
USERS, ITEMS = 40, 30
TABLE_FEATURES = {"user_embed": "user", "tower/item_embed": "item"}


class ItemTower(nn.Module):
  embed: callable

  @nn.compact
  def __call__(self, ids):
    return self.embed(ITEMS + 1, WIDTH, name="item_embed")(ids)


class TwoTower(nn.Module):
  """user/item embeddings -> concat -> MLP -> a rating.

  The item table is nested (module path "tower/item_embed").
  """
  embed: callable  # (num_embeddings, features, name) -> module

  @nn.compact
  def __call__(self, batch):
    u = self.embed(USERS + 1, WIDTH, name="user_embed")(batch["user"])
    v = ItemTower(self.embed, name="tower")(batch["item"])
    x = jnp.concatenate([u, v, u * v], axis=-1).astype(jnp.float32)
    x = nn.relu(nn.Dense(16, name="hidden")(x))
    return nn.Dense(1, name="out")(x)[:, 0]


def mse(pred, batch):
  loss = jnp.mean((pred - batch["label"]) ** 2)
  return loss, {"mse": loss}


def embed_fn(ctx, backend, **kwargs):
  return lambda n, f, name: pe_flax.Embed(n, f, ctx, name=name,
                                          backend=backend, **kwargs)


def nn_embed(n, f, name):
  return nn.Embed(n, f, name=name)


def make_collection(mesh, opt, backend, dtype=jnp.float32, padding_id=None):
  """The TwoTower's tables, named after their Embeds' module paths."""
  return pe.EmbeddingCollection(
      [pe.TableSpec("user_embed", USERS + 1, WIDTH, optimizer=opt,
                    dtype=dtype, padding_id=padding_id),
       pe.TableSpec("tower/item_embed", ITEMS + 1, WIDTH, optimizer=opt,
                    dtype=dtype, padding_id=padding_id)],
      [pe.FeatureSpec("user", "user_embed"),
       pe.FeatureSpec("item", "tower/item_embed")], mesh, "x",
      backend=backend)


def make_batches(mesh, steps=STEPS + 1):
  """Synthetic ratings; ids shifted down by one, so id 0 is a real (the most
  popular) user and item and row 0 must train."""
  ds = datasets.synthetic(BATCH * steps, USERS, ITEMS, rank=2,
                          noise_std=0.05, zipf_exponent=0.5, seed=1)
  host = []
  for b in datasets.batches(ds, BATCH, seed=0, epochs=1):
    host.append(dict(b, user=b["user"] - 1, item=b["item"] - 1))
  assert (host[0]["user"] == 0).any() and (host[0]["item"] == 0).any()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  return host, [jax.device_put(b, sharding) for b in host]


def dense_rowwise_adagrad(opt, table, row_state, grad, ids, padding_id=None):
  """Row-wise Adagrad, eager mode, on a dense [vocab, width] gradient (f32)."""
  hp = opt.hparams(table.shape[1])
  present = jnp.zeros(table.shape[0], bool).at[ids].set(True)
  if padding_id is not None:
    present = present.at[padding_id].set(False)
  row_sq = jnp.sum(grad * grad, axis=1)
  accum = jnp.where(present, row_state * hp.decay_factor +
                    row_sq * hp.inv_width, row_state)
  wd = jnp.where(row_sq > 0, hp.weight_decay_factor, 1.0)
  lr_scale = -opt.learning_rate / (jnp.sqrt(accum) + hp.eps)
  new = table * wd[:, None] + lr_scale[:, None] * grad
  return jnp.where(present[:, None], new, table), accum


def dense_reference(params, batches, opt, dense_opt, late, padding_id=None):
  """nn.Embed + jax.grad; tables: dense_rowwise_adagrad (late: a step late)."""
  model = TwoTower(nn_embed)
  flat = traverse_util.flatten_dict(params, sep="/")
  tables = {k: flat.pop(k + "/embedding") for k in TABLE_FEATURES}
  dense = traverse_util.unflatten_dict(flat, sep="/")
  rows = {k: jnp.zeros(t.shape[0], jnp.float32) for k, t in tables.items()}
  dense_state = dense_opt.init(dense)

  def loss_fn(tables, dense, batch):
    p = traverse_util.flatten_dict(dense, sep="/")
    p.update({k + "/embedding": t for k, t in tables.items()})
    p = traverse_util.unflatten_dict(p, sep="/")
    return mse(model.apply({"params": p}, batch), batch)[0]

  @jax.jit
  def grads(tables, dense, dense_state, batch):
    loss, (g_tab, g_dense) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        tables, dense, batch)
    updates, dense_state = dense_opt.update(g_dense, dense_state, dense)
    return loss, g_tab, optax.apply_updates(dense, updates), dense_state

  @jax.jit
  def apply(tables, rows, g_tab, batch):
    out = {k: dense_rowwise_adagrad(opt, tables[k], rows[k], g_tab[k],
                                    batch[f], padding_id)
           for k, f in TABLE_FEATURES.items()}
    return ({k: o[0] for k, o in out.items()},
            {k: o[1] for k, o in out.items()})

  staged, losses = None, []
  for batch in batches:
    loss, g_tab, dense, dense_state = grads(tables, dense, dense_state, batch)
    losses.append(float(loss))
    if not late:
      tables, rows = apply(tables, rows, g_tab, batch)
      continue
    if staged is not None:
      tables, rows = apply(tables, rows, *staged)
    staged = (g_tab, batch)
  if late:  # the flush
    tables, rows = apply(tables, rows, *staged)
  return tables, rows, dense, losses


def run_trainer(trainer, params, batches):
  """Every batch once (pipelined: each with the next), then the flush."""
  pipelined = trainer.pipelined
  state = trainer.init(jax.tree.map(jnp.copy, params),
                       batches[0] if pipelined else None)
  step = jax.jit(trainer.step, donate_argnums=0)
  losses = []
  for t, batch in enumerate(batches):
    args = (batch, batches[min(t + 1, len(batches) - 1)]) if pipelined else (
        batch,)
    state, metrics = step(state, *args)
    losses.append(float(metrics.loss))  # also keeps XLA:CPU in lock step
  state, _ = trainer.flush(state)
  return state, losses


class FlaxTrainerTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh({"x": 8})
    cls.ctx = pe.make_context(cls.mesh, "x", tokens_per_batch=BATCH,
                              emb_width=WIDTH, num_unique=BATCH + 1)
    cls.host_batches, cls.batches = make_batches(cls.mesh)
    model = TwoTower(embed_fn(cls.ctx, "xla"))
    cls.params = nn.unbox(model.init(jax.random.key(0),
                                     cls.batches[0])["params"])
    cls.opt = pe.RowwiseAdagrad(0.3, half_life_steps=20.0,
                                weight_decay=1e-3)
    cls.dense_opt = optax.adam(1e-2)

  def _host_params(self):
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), self.params)

  def _trainer(self, backend="xla", pipelined=True, model=None, coll=None,
               **coll_kwargs):
    model = model or TwoTower(embed_fn(self.ctx, backend))
    coll = coll or make_collection(self.mesh, self.opt, backend,
                                   **coll_kwargs)
    return pe_flax.FlaxTrainer(model, coll, mse, self.dense_opt,
                               pipelined=pipelined)

  def _compare(self, trainer, state, losses, reference):
    ref_tables, ref_rows, ref_dense, ref_losses = reference
    coll = trainer.collection
    tables = coll.table_arrays(state.embedding)
    rows = coll.optimizer_arrays(state.embedding)
    # f32 everywhere; only the order of the gradient sums differs (the
    # observed gap is ~1e-6, far inside bf16's 8e-3).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    for key in TABLE_FEATURES:
      np.testing.assert_allclose(np.asarray(tables[key]),
                                 np.asarray(ref_tables[key]),
                                 rtol=1e-4, atol=1e-5, err_msg=key)
      np.testing.assert_allclose(np.asarray(rows[key].row_state),
                                 np.asarray(ref_rows[key]),
                                 rtol=1e-4, atol=1e-8, err_msg=key)
    for a, b in zip(jax.tree.leaves(state.dense_params),
                    jax.tree.leaves(ref_dense)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                 atol=1e-5)
    # Back to a plain params tree: the original model reproduces apply.
    params = trainer.params(state)
    batch = self.batches[0]
    np.testing.assert_allclose(
        np.asarray(trainer.model.apply({"params": params}, batch)),
        np.asarray(jax.jit(trainer.apply)(state, batch)), rtol=1e-6,
        atol=1e-6)

  @parameterized.parameters(False, True)
  def test_matches_dense_gradient_training(self, pipelined):
    reference = dense_reference(self._host_params(), self.host_batches,
                                self.opt, self.dense_opt, late=pipelined)
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        trainer = self._trainer(backend, pipelined)
        state, losses = run_trainer(trainer, self.params, self.batches)
        self._compare(trainer, state, losses, reference)
        # It learns: the last steps' loss is well below the first's.
        self.assertLess(np.mean(losses[-5:]), 0.5 * np.mean(losses[:5]))

  def test_row_zero_trains(self):
    # As with nn.Embed, row 0 trains: layers and tables default to
    # padding_id=None, so id 0 is a row like any other.
    batches = self.batches[:3]
    reference = dense_reference(self._host_params(), self.host_batches[:3],
                                self.opt, self.dense_opt, late=False)
    trainer = self._trainer(pipelined=False)
    state, _ = run_trainer(trainer, self.params, batches)
    tables = trainer.collection.table_arrays(state.embedding)
    initial = traverse_util.flatten_dict(self.params, sep="/")
    for key in TABLE_FEATURES:
      before = np.asarray(initial[key + "/embedding"][0])
      after = np.asarray(tables[key][0])
      self.assertFalse(np.allclose(after, before, rtol=1e-3, atol=1e-4), key)
      np.testing.assert_allclose(after, np.asarray(reference[0][key][0]),
                                 rtol=1e-4, atol=1e-5, err_msg=key)

  def test_padding_id(self):
    # A padding id on both the Embeds and the tables: row 0 is looked up but
    # never trains, as the reference with row 0 masked.
    batches = self.batches[:4]
    reference = dense_reference(self._host_params(), self.host_batches[:4],
                                self.opt, self.dense_opt, late=False,
                                padding_id=0)
    trainer = self._trainer(
        pipelined=False, padding_id=0,
        model=TwoTower(embed_fn(self.ctx, "xla", padding_id=0)))
    state, losses = run_trainer(trainer, self.params, batches)
    tables = trainer.collection.table_arrays(state.embedding)
    for key in TABLE_FEATURES:
      np.testing.assert_array_equal(
          np.asarray(tables[key][0]),
          np.asarray(traverse_util.flatten_dict(self.params, sep="/")[
              key + "/embedding"][0]))
    np.testing.assert_allclose(losses, reference[3], rtol=1e-4, atol=1e-6)
    for key in TABLE_FEATURES:
      np.testing.assert_allclose(np.asarray(tables[key]),
                                 np.asarray(reference[0][key]),
                                 rtol=1e-4, atol=1e-5, err_msg=key)
    # The Embeds' padding_id must be the tables': a mismatch is an error.
    mismatched = self._trainer(  # the tables: padding_id=None
        pipelined=False,
        model=TwoTower(embed_fn(self.ctx, "xla", padding_id=0)))
    with self.assertRaisesRegex(
        pe.InputError, r"FlaxTrainer table 'user_embed': its Embed has "
        r"padding_id=0 but its TableSpec has padding_id=None"):
      jax.jit(mismatched.step)(mismatched.init(self.params), batches[0])

  def test_bf16_tables_learn(self):
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(jnp.bfloat16)
        if path[-1].key == "embedding" else x, self.params)
    trainer = self._trainer(
        model=TwoTower(embed_fn(self.ctx, "xla", param_dtype=jnp.bfloat16)),
        dtype=jnp.bfloat16)
    state, losses = run_trainer(trainer, params, self.batches)
    tables = trainer.collection.table_arrays(state.embedding)
    self.assertEqual(tables["user_embed"].dtype, jnp.bfloat16)
    self.assertEqual(
        trainer.params(state)["user_embed"]["embedding"].dtype, jnp.bfloat16)
    self.assertLess(np.mean(losses[-5:]), 0.5 * np.mean(losses[:5]))

  def test_params_apply_and_eval_batch_size(self):
    trainer = self._trainer(pipelined=False)
    state, _ = run_trainer(trainer, self.params, self.batches[:3])
    params = trainer.params(state)
    # A plain flax params tree: nn.Embed's model reproduces the trainer's
    # forward, on the training batch size and on an eval batch of 24.
    self.assertEqual(jax.tree.structure(params),
                     jax.tree.structure(self.params))
    ref = TwoTower(nn_embed)
    for batch in (self.host_batches[5],
                  jax.tree.map(lambda x: x[:24], self.host_batches[6])):
      placed = jax.device_put(batch, pe.token_sharding(self.ctx))
      np.testing.assert_allclose(
          np.asarray(jax.jit(trainer.apply)(state, placed)),
          np.asarray(ref.apply({"params": jax.device_get(params)}, batch)),
          rtol=1e-6, atol=1e-6)
    # The pe_flax model itself, on the training batch size.
    np.testing.assert_allclose(
        np.asarray(trainer.model.apply({"params": params}, self.batches[5])),
        np.asarray(ref.apply({"params": jax.device_get(params)},
                             self.host_batches[5])), rtol=1e-6, atol=1e-6)

  def test_contract_errors(self):
    batch = self.batches[0]
    sgd = optax.sgd(0.1)

    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb FlaxTrainer collection is a dict; "
        r"expected a pallas_emb.EmbeddingCollection"):
      pe_flax.FlaxTrainer(TwoTower(embed_fn(self.ctx, "xla")),
                          {"user_embed": self.opt}, mse, sgd)

    # A table whose name is no Embed's module path.
    misnamed = pe.EmbeddingCollection(
        [pe.TableSpec("user", USERS + 1, WIDTH, optimizer=self.opt),
         pe.TableSpec("tower/item_embed", ITEMS + 1, WIDTH,
                      optimizer=self.opt)],
        [pe.FeatureSpec("user", "user"),
         pe.FeatureSpec("item", "tower/item_embed")], self.mesh, "x")
    with self.assertRaisesRegex(
        pe.InputError, r"FlaxTrainer table 'user': params have no "
        r"'user/embedding' \(Embed params found at \['tower/item_embed', "
        r"'user_embed'\]\)"):
      pe_flax.FlaxTrainer(TwoTower(embed_fn(self.ctx, "xla")), misnamed,
                          mse, sgd).split(self.params)

    # An Embed the collection does not hold.
    only_user = pe.EmbeddingCollection(
        [pe.TableSpec("user_embed", USERS + 1, WIDTH, optimizer=self.opt)],
        [pe.FeatureSpec("user", "user_embed")], self.mesh, "x")
    trainer = pe_flax.FlaxTrainer(TwoTower(embed_fn(self.ctx, "xla")),
                                  only_user, mse, sgd, pipelined=False)
    with self.assertRaisesRegex(
        pe.InputError, r"FlaxTrainer: the Embed at 'tower/item_embed' is not "
        r"a table of the collection \(tables \['user_embed'\]\)"):
      jax.jit(trainer.step)(trainer.init(self.params), batch)

    # An Embed called with other ids than its feature's: the item table's
    # feature is "pairs" [8, 8], the model calls it with batch["item"].
    pairs = pe.EmbeddingCollection(
        [pe.TableSpec("user_embed", USERS + 1, WIDTH, optimizer=self.opt),
         pe.TableSpec("tower/item_embed", ITEMS + 1, WIDTH,
                      optimizer=self.opt)],
        [pe.FeatureSpec("user", "user_embed"),
         pe.FeatureSpec("pairs", "tower/item_embed")], self.mesh, "x")
    trainer = pe_flax.FlaxTrainer(TwoTower(embed_fn(self.ctx, "xla")), pairs,
                                  mse, sgd, pipelined=False)
    bad = dict(batch, pairs=jnp.zeros((BATCH // 8, 8), jnp.int32))
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.flax.Embed 'tower/item_embed' was called "
        r"with ids of shape \(64,\), but FlaxTrainer looked up embeddings of "
        r"shape \(8, 8, 16\) for it; call the Embed with its feature's ids"):
      jax.jit(trainer.step)(trainer.init(self.params), bad)

    # A table called twice, or never; attend, which needs the whole table.
    ctx = self.ctx
    flat_coll = pe.EmbeddingCollection(
        [pe.TableSpec("user_embed", USERS + 1, WIDTH, optimizer=self.opt),
         pe.TableSpec("item_embed", ITEMS + 1, WIDTH, optimizer=self.opt)],
        [pe.FeatureSpec("user", "user_embed"),
         pe.FeatureSpec("item", "item_embed")], self.mesh, "x")
    params = {"user_embed": self.params["user_embed"],
              "item_embed": self.params["tower"]["item_embed"]}

    class Twice(nn.Module):
      @nn.compact
      def __call__(self, batch):
        embed = pe_flax.Embed(USERS + 1, WIDTH, ctx, name="user_embed")
        item = pe_flax.Embed(ITEMS + 1, WIDTH, ctx, name="item_embed")
        del item  # defined, never called
        return jnp.sum(embed(batch["user"]) * embed(batch["user"]), axis=-1)

    trainer = pe_flax.FlaxTrainer(Twice(), flat_coll, mse, sgd,
                                  pipelined=False)
    with self.assertRaisesRegex(
        pe.InputError, r"each sparse-trained layer must be called exactly "
        r"once per forward pass; call counts \{'user_embed': 2, "
        r"'item_embed': 0\}"):
      jax.jit(trainer.step)(trainer.init(params), batch)

    class Tied(nn.Module):
      @nn.compact
      def __call__(self, batch):
        user = pe_flax.Embed(USERS + 1, WIDTH, ctx, name="user_embed")
        item = pe_flax.Embed(ITEMS + 1, WIDTH, ctx, name="item_embed")
        return item.attend(user(batch["user"]))[:, 0]

    trainer = pe_flax.FlaxTrainer(Tied(), flat_coll, mse, sgd,
                                  pipelined=False)
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.flax.Embed 'item_embed' attend needs the "
        r"whole table, which FlaxTrainer keeps out of the model"):
      jax.jit(trainer.step)(trainer.init(params), batch)

    # A table read by two features needs the EmbeddingCollection module.
    shared = pe.EmbeddingCollection(
        [pe.TableSpec("user_embed", USERS + 1, WIDTH, optimizer=self.opt),
         pe.TableSpec("tower/item_embed", ITEMS + 1, WIDTH,
                      optimizer=self.opt)],
        [pe.FeatureSpec("user", "user_embed"),
         pe.FeatureSpec("user2", "user_embed"),
         pe.FeatureSpec("item", "tower/item_embed")], self.mesh, "x")
    with self.assertRaisesRegex(
        pe.InputError, r"table 'user_embed' is an Embed layer read by "
        r"features \['user', 'user2'\]"):
      pe_flax.FlaxTrainer(TwoTower(embed_fn(self.ctx, "xla")), shared, mse,
                          sgd).split(self.params)

  def test_readme_example(self):
    from examples import flax_example  # pylint: disable=g-import-not-at-top
    loss, params = flax_example.main(steps=30)
    # Labels have variance ~0.28; it learns them to well under a fifth.
    self.assertLess(loss, 0.05)
    # One stack holds both tables (users rows [0, 1000), items after them).
    self.assertEqual(params["embed"]["stack0"].shape, (1500, 64))
    self.assertEqual(params["Dense_1"]["kernel"].shape, (3 * 64, 32))


# --- the EmbeddingCollection module ------------------------------------------

SEQ = 3  # history length


def three_table_collection(mesh, backend, opt=None, dtype=jnp.float32):
  """3 tables (users + items stack, genre alone), 4 features: "item" and
  the [B, SEQ] "history" share the items table."""
  opt = opt or pe.RowwiseAdagrad(0.2, half_life_steps=10.0)
  return pe.EmbeddingCollection(
      [pe.TableSpec("users", 23, 16, optimizer=opt, dtype=dtype),
       pe.TableSpec("items", 29, 16, optimizer=opt, dtype=dtype),
       pe.TableSpec("genre", 7, 8, optimizer=opt, dtype=dtype)],
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


class Head(nn.Module):
  """The dense part: features -> a score."""

  @nn.compact
  def __call__(self, emb):
    x = jnp.concatenate([emb["user"], emb["item"],
                         jnp.mean(emb["history"], axis=1), emb["genre"]],
                        axis=-1)
    return nn.Dense(1, name="out")(nn.relu(nn.Dense(8, name="hidden")(x)))[
        :, 0]


class CollectionModel(nn.Module):
  collection: pe.EmbeddingCollection

  @nn.compact
  def __call__(self, batch):
    emb = pe_flax.EmbeddingCollection(self.collection, name="embed")(batch)
    return Head(name="head")(emb)


def gather_reference(coll, tables, batch):
  """numpy `table[ids]` per feature (ids wrapped once: all in range)."""
  out = {}
  for name, spec in coll.features.items():
    table = np.asarray(tables[spec.table])
    ids = np.asarray(batch[name])
    out[name] = table[np.where(ids < 0, ids + table.shape[0], ids)]
  return out


class EmbeddingCollectionModuleTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh({"x": 8})
    cls.batches = [collection_batch(cls.mesh, 16, seed) for seed in range(6)]

  def _init(self, coll, model=None):
    model = model or CollectionModel(coll)
    variables = jax.jit(model.init)(jax.random.key(0), self.batches[0][1])
    return model, variables["params"]

  def _logical(self, coll, stacks):
    return coll.table_arrays(coll.state_from_stacks(stacks))

  def test_init_gives_column_sharded_stacks(self):
    coll = three_table_collection(self.mesh, "xla")
    model, params = self._init(coll)
    self.assertEqual(set(params), {"embed", "head"})
    self.assertEqual(set(params["embed"]), {"stack0", "stack1"})
    self.assertEqual(
        nn.get_partition_spec(params["embed"]),
        {"stack0": jax.sharding.PartitionSpec(None, "x"),
         "stack1": jax.sharding.PartitionSpec(None, "x")})
    for stack in coll.plan.stacks:
      table = params["embed"][stack.name]
      self.assertIsInstance(table, nn.Partitioned)
      self.assertEqual(table.value.shape, (stack.total_rows, stack.emb_width))
      self.assertEqual(table.value.dtype, stack.dtype)
      assert_table_sharded(self, self.mesh, table.value)
    self.assertEqual(coll.plan.stacks[0].tables, ("users", "items"))
    # Each table from its own initializer (nn.Embed's: std 1/sqrt(width)).
    tables = self._logical(coll, nn.unbox(params["embed"]))
    for name, spec in coll.tables.items():
      self.assertEqual(tables[name].shape, (spec.vocab_rows, spec.emb_width))
      std = float(np.std(tables[name]))
      self.assertAlmostEqual(std, spec.emb_width**-0.5,
                             delta=0.3 * spec.emb_width**-0.5, msg=name)
    # Another key, other tables; the same key, the same ones.
    again = jax.jit(model.init)(jax.random.key(0), self.batches[1][1])
    other = jax.jit(model.init)(jax.random.key(1), self.batches[0][1])
    for name in ("stack0", "stack1"):
      test_util.assert_bits_equal(self, again["params"]["embed"][name].value,
                                  test_util.as_numpy(
                                      params["embed"][name].value))
      self.assertFalse(np.array_equal(other["params"]["embed"][name].value,
                                      params["embed"][name].value))

  def test_lookup_equals_table_rows(self):
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        coll = three_table_collection(self.mesh, backend)
        module = pe_flax.EmbeddingCollection(coll)
        host, batch = self.batches[0]
        params = jax.jit(module.init)(jax.random.key(0), batch)
        out = jax.jit(module.apply)(params, batch)
        tables = self._logical(coll, nn.unbox(params["params"]))
        expected = gather_reference(coll, tables, host)
        self.assertEqual(set(out), set(coll.features))
        self.assertEqual(out["history"].shape, (16, SEQ, 16))
        self.assertEqual(out["genre"].shape, (16, 8))
        for name in coll.features:
          test_util.assert_bits_equal(self, out[name], expected[name], name)
        # = the collection's own lookup, also on another batch size.
        small_host, small = collection_batch(self.mesh, 8, 7)
        out = jax.jit(module.apply)(params, small)
        state = coll.state_from_stacks(nn.unbox(params["params"]))
        direct = jax.jit(coll.lookup)(state, small)
        expected = gather_reference(coll, tables, small_host)
        for name in coll.features:
          test_util.assert_bits_equal(self, out[name], expected[name], name)
          test_util.assert_bits_equal(self, out[name],
                                      test_util.as_numpy(direct[name]), name)

  def test_jax_grad_and_optax(self):
    coll = three_table_collection(self.mesh, "xla")
    model, params = self._init(coll)
    host, batch = self.batches[0]
    tables = self._logical(coll, nn.unbox(params["embed"]))

    def loss(p, batch):
      return jnp.mean((model.apply({"params": p}, batch) - batch["label"])**2)

    # The reference: the same head on plain jnp gathers of the logical
    # tables, differentiated w.r.t. the tables.
    def ref_loss(tables, head, batch):
      emb = {}
      for name, spec in coll.features.items():
        ids = batch[name]
        rows = coll.tables[spec.table].vocab_rows
        emb[name] = tables[spec.table][jnp.where(ids < 0, ids + rows, ids)]
      pred = Head().apply({"params": head}, emb)
      return jnp.mean((pred - batch["label"])**2)

    host_head = jax.device_get(nn.unbox(params["head"]))
    ref_tables_grad, ref_head_grad = jax.grad(ref_loss, argnums=(0, 1))(
        jax.device_get(tables), host_head, host)
    grad = jax.jit(jax.grad(loss))(params, batch)
    for stack in coll.plan.stacks:
      assert_table_sharded(self, self.mesh, grad["embed"][stack.name].value)
    grad_tables = self._logical(coll, nn.unbox(grad["embed"]))
    for name in coll.tables:
      self.assertTrue(np.any(np.asarray(ref_tables_grad[name]) != 0), name)
      grads_close(self, grad_tables[name], ref_tables_grad[name])
    grads_close(self, grad["head"]["out"]["kernel"],
                ref_head_grad["out"]["kernel"])
    trained = train_with_optax(self, functools.partial(loss, batch=batch),
                               params)
    for stack in coll.plan.stacks:
      assert_table_sharded(self, self.mesh,
                           trained["embed"][stack.name].value)

  # The dense cotangent of `coll.lookup` gives nothing to padding rows (nor
  # to rows clamped from out-of-range ids), as the sparse update.
  def test_jax_grad_skips_padding_id(self):
    opt = pe.RowwiseAdagrad(0.1)
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("items", 29, 16, optimizer=opt, padding_id=0)],
        [pe.FeatureSpec("item", "items"), pe.FeatureSpec("history", "items")],
        self.mesh, "x", backend="xla")
    module = pe_flax.EmbeddingCollection(coll)
    host, batch = self.batches[0]  # item ids 0 twice
    params = nn.unbox(jax.jit(module.init)(jax.random.key(0), batch))
    weights = np.random.default_rng(0).standard_normal(16).astype(
        np.float32)

    def loss(params):
      emb = module.apply(params, batch)
      return jnp.sum(weights @ (emb["item"] + emb["history"].sum(1)))

    table = np.asarray(params["params"]["stack0"])

    def ref_loss(table, padding_trains=False):
      emb = {}
      for k in ("item", "history"):
        index = jnp.where(host[k] < 0, host[k] + 29, host[k])
        rows = table[index]
        # The padding row gets no gradient, whatever id reaches it (0, and
        # -29 that wraps onto row 0).
        pad = (index == 0)[..., None]
        emb[k] = (rows if padding_trains else
                  jnp.where(pad, jax.lax.stop_gradient(rows), rows))
      return jnp.sum(weights @ (emb["item"] + emb["history"].sum(1)))

    expected = np.array(jax.jit(jax.grad(ref_loss))(table))
    with_padding = np.array(jax.jit(jax.grad(
        functools.partial(ref_loss, padding_trains=True)))(table))
    self.assertTrue(np.any(expected[0] != with_padding[0]))
    grads_close(self, jax.jit(jax.grad(loss))(params)["params"]["stack0"],
                expected)

  @parameterized.parameters((False, jnp.float32), (True, jnp.bfloat16))
  def test_flax_trainer_equals_pe_trainer(self, pipelined, dtype):
    batches = [b for _, b in self.batches]
    dense_opt = optax.adam(1e-2)
    # Plumbing only: the kernels behind it are the same either way, and the
    # TwoTower test runs FlaxTrainer on every backend. The first one only.
    for backend in test_util.backends()[:1]:
      with self.subTest(backend=backend):
        coll = three_table_collection(self.mesh, backend, dtype=dtype)
        model, params = self._init(coll)
        params = nn.unbox(params)
        trainer = pe_flax.FlaxTrainer(model, coll, mse, dense_opt,
                                      pipelined=pipelined)
        state, losses = run_trainer(trainer, params, batches)

        def loss_fn(dense, emb, batch):
          return mse(Head().apply({"params": dense["head"]}, emb), batch)

        ref = pe.Trainer(coll, loss_fn, dense_opt, pipelined=pipelined)
        ref_state = ref.init(
            coll.state_from_stacks(jax.tree.map(jnp.copy, params["embed"])),
            {"head": jax.tree.map(jnp.copy, params["head"])},
            batches[0] if pipelined else None)
        step = jax.jit(ref.step, donate_argnums=0)
        ref_losses = []
        for t, batch in enumerate(batches):
          args = ((batch, batches[min(t + 1, len(batches) - 1)])
                  if pipelined else (batch,))
          ref_state, metrics = step(ref_state, *args)
          ref_losses.append(float(metrics.loss))
        ref_state, _ = jax.jit(ref.flush)(ref_state)
        np.testing.assert_array_equal(losses, ref_losses)
        for a, b in zip(jax.tree.leaves(state.embedding),
                        jax.tree.leaves(ref_state.embedding)):
          test_util.assert_bits_equal(self, a, test_util.as_numpy(b))
        for a, b in zip(jax.tree.leaves(state.dense_params),
                        jax.tree.leaves(ref_state.dense_params)):
          test_util.assert_bits_equal(self, a, test_util.as_numpy(b))
        # params(): the module's stacks back in place; apply agrees.
        out = trainer.params(state)
        self.assertEqual(jax.tree.structure(out), jax.tree.structure(params))
        # The tables as the module holds them: bf16 stays bf16 (a state
        # may hold it as uint16 bits).
        self.assertEqual(jax.tree.map(lambda x: x.dtype, out),
                         jax.tree.map(lambda x: x.dtype, params))
        test_util.assert_bits_equal(
            self, jax.jit(model.apply)({"params": out}, batches[1]),
            test_util.as_numpy(jax.jit(trainer.apply)(state, batches[1])))

  def test_pooled_feature_under_flax_trainer(self):
    # A pooled feature (ids [B, L] in a pe.Bag) gives one row per example.
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("items", 29, 16, optimizer=pe.RowwiseAdagrad(0.2))],
        [pe.FeatureSpec("item", "items"),
         pe.FeatureSpec("bag", "items", combiner="mean")],
        self.mesh, "x", backend="xla")

    class Model(nn.Module):
      @nn.compact
      def __call__(self, batch):
        emb = pe_flax.EmbeddingCollection(coll, name="embed")(batch)
        x = jnp.concatenate([emb["item"], emb["bag"]], axis=-1)
        return nn.Dense(1, name="out")(x)[:, 0]

    rng = np.random.default_rng(3)
    sharding = coll.token_sharding()
    batches = [{"item": jax.device_put(rng.integers(0, 29, 16).astype(
                    np.int32), sharding),
                "bag": pe.Bag(jax.device_put(rng.integers(0, 29, (16, 3))
                                             .astype(np.int32), sharding),
                              lengths=jax.device_put(rng.integers(
                                  0, 4, 16).astype(np.int32), sharding)),
                "label": jax.device_put(rng.standard_normal(16).astype(
                    np.float32), sharding)} for _ in range(4)]
    model = Model()
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0),
                                          batches[0])["params"])
    trainer = pe_flax.FlaxTrainer(model, coll, mse, optax.sgd(0.1))
    state, losses = run_trainer(trainer, params, batches)

    def loss_fn(dense, emb, batch):
      x = jnp.concatenate([emb["item"], emb["bag"]], axis=-1)
      return mse(x @ dense["kernel"] + dense["bias"][0], batch)

    ref = pe.Trainer(coll, lambda d, e, b: loss_fn(d, e, b), optax.sgd(0.1))
    dense = {"kernel": params["out"]["kernel"][:, 0],
             "bias": params["out"]["bias"]}
    ref_state = ref.init(coll.state_from_stacks(
        jax.tree.map(jnp.copy, params["embed"])), dense, batches[0])
    ref_losses = []
    for t, batch in enumerate(batches):
      ref_state, metrics = jax.jit(ref.step)(
          ref_state, batch, batches[min(t + 1, len(batches) - 1)])
      ref_losses.append(float(metrics.loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    self.assertEqual(jax.jit(trainer.apply)(state, batches[0]).shape, (16,))

  def test_init_from_a_split_state(self):
    # A trainer that never saw params (e.g. restoring a checkpoint) finds
    # the module from the model itself.
    coll = three_table_collection(self.mesh, "xla")
    model, params = self._init(coll)
    params = nn.unbox(params)
    batch = self.batches[0][1]
    trainer = pe_flax.FlaxTrainer(model, coll, mse, optax.sgd(0.1),
                                  pipelined=False)
    state = trainer.init_from(coll.state_from_stacks(params["embed"]),
                              {"head": params["head"]})
    state, metrics = jax.jit(trainer.step)(state, batch)
    self.assertTrue(np.isfinite(float(metrics.loss)))
    self.assertEqual(set(trainer.params(state)), {"embed", "head"})

  def test_module_errors(self):
    coll = three_table_collection(self.mesh, "xla")
    with self.assertRaisesRegex(
        pe.InputError, r"pallas_emb.flax.EmbeddingCollection collection is a "
        r"CollectionPlan; expected a pallas_emb.EmbeddingCollection"):
      pe_flax.EmbeddingCollection(coll.plan).init(
          jax.random.key(0), self.batches[0][1])

    class Reshaped(nn.Module):
      @nn.compact
      def __call__(self, batch):
        batch = dict(batch, history=batch["history"][:, :2])
        return Head()(pe_flax.EmbeddingCollection(coll, name="embed")(batch))

    model = Reshaped()
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0),
                                          self.batches[0][1])["params"])
    trainer = pe_flax.FlaxTrainer(model, coll, mse, optax.sgd(0.1),
                                  pipelined=False)
    with self.assertRaisesRegex(
        pe.InputError, r"EmbeddingCollection 'embed' was called with "
        r"batch\['history'\] of shape \(16, 2\), but FlaxTrainer looked up "
        r"embeddings of shape \(16, 3, 16\)"):
      jax.jit(trainer.step)(trainer.init(params), self.batches[0][1])


# --- one import path per class ------------------------------------------------


class ShadowingTest(absltest.TestCase):

  def test_does_not_shadow_flax(self):
    import flax  # pylint: disable=g-import-not-at-top
    self.assertIs(pe_flax.nn, flax.linen)
    self.assertNotIn("pallas_emb", flax.__file__)
    self.assertEqual(pe_flax.Embed.__module__, "pallas_emb.flax")
    self.assertEqual(pe_flax.EmbeddingCollection.__module__,
                     "pallas_emb.flax")
    self.assertEqual(pe_flax.FlaxTrainer.__module__, "pallas_emb.flax")
    with self.assertRaises(ModuleNotFoundError):
      importlib.import_module("pallas_emb.layers")

  def test_package_dir_on_sys_path_is_a_clear_error(self):
    package_dir = os.path.dirname(pe.__file__)
    result = subprocess.run(
        [sys.executable, "-c", "import flax"], capture_output=True,
        text=True, check=False, env=dict(os.environ, PYTHONPATH=package_dir))
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("was imported as the top-level module `flax`",
                  result.stderr)



class WideIdsTest(absltest.TestCase):
  """uint32 ids past int32 are never wrapped onto another row."""

  def test_uint32_ids(self):
    ctx = make_ctx("8ranks", (8,))
    values = np.array([2**32 - 2, 2**31 + 5, 2**31, 2**31 - 1, 5, 0, 63, 1],
                      np.uint32)
    layer = pe_flax.Embed(VOCAB, ctx.emb_width, ctx, backend="xla")
    variables = layer.init(jax.random.key(0), np.zeros(8, np.int32))
    table = np.asarray(variables["params"]["embedding"].value)
    ids = jax.device_put(jnp.asarray(values), pe.token_sharding(ctx))
    # Traced: past int32 is past the table, clamped onto the last row; a
    # cast would wrap 2**32 - 2 onto row VOCAB - 2.
    out = jax.jit(layer.apply)(variables, ids)
    rows = np.minimum(values.astype(np.int64), VOCAB - 1)
    test_util.assert_bits_equal(self, out, table[rows])
    # Concrete: checked before tracing.
    with self.assertRaisesRegex(pe.InputError, "^pallas_emb flax.Embed ids "
                                r"holds ids in \[0, 4294967294\], outside "
                                "int32"):
      layer.apply(variables, ids)

  def test_numpy_int64_ids(self):
    ctx = make_ctx("8ranks", (8,))
    ids = np.array([2**32 + 3, 0, 1, 2, 3, 4, 5, 6], np.int64)
    layer = pe_flax.Embed(VOCAB, ctx.emb_width, ctx, backend="xla")
    variables = layer.init(jax.random.key(0), np.zeros(8, np.int32))
    # jnp.asarray(ids) would be [3, 0, ...] (x64 off): a real row.
    with self.assertRaisesRegex(pe.InputError, re.escape(
        "ids holds ids in [0, 4294967299], outside int32")):
      layer.apply(variables, ids)
    ids[0] = 7  # in range: the same rows as int32 ids
    test_util.assert_bits_equal(self, layer.apply(variables, ids),
                                layer.apply(variables, ids.astype(np.int32)))


if __name__ == "__main__":
  absltest.main()
