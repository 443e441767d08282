"""FlaxTrainer: a Flax model's Embed tables on the sparse step, dense on optax.

The reference trains the same model with `nn.Embed` and plain `jax.grad`
(dense table gradients), applying DESIGN §4's row-wise Adagrad in jnp to the
dense table gradient.
"""

import os
import sys

import test_util

from absl.testing import absltest
from absl.testing import parameterized
from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import data
from pallas_emb import flax as pe_flax
from pallas_emb.layers.training import FlaxTrainer

BATCH = 64
WIDTH = 16
STEPS = 50
USERS, ITEMS = 40, 30


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


def make_batches(ctx, steps=STEPS + 1):
  ds = data.synthetic(BATCH * steps, USERS, ITEMS, rank=2, noise_std=0.05,
                      zipf_exponent=0.5, seed=1)
  host = list(data.batches(ds, BATCH, seed=0, epochs=1))
  return host, [jax.device_put(b, pe.token_sharding(ctx)) for b in host]


def embed_fn(ctx, backend):
  return lambda n, f, name: pe_flax.Embed(n, f, ctx, name=name,
                                          backend=backend)


def dense_rowwise_adagrad(opt, width, table, row_state, grad, ids):
  """DESIGN §4.5, eager mode, on a dense [vocab, width] gradient (f32)."""
  hp = opt.hparams(width)
  present = jnp.zeros(table.shape[0], bool).at[ids].set(True).at[0].set(False)
  row_sq = jnp.sum(grad * grad, axis=1)
  accum = jnp.where(present, row_state * hp.decay_factor +
                    row_sq * hp.inv_width, row_state)
  wd = jnp.where(row_sq > 0, hp.weight_decay_factor, 1.0)
  lr_scale = -opt.learning_rate / (jnp.sqrt(accum) + hp.eps)
  new = table * wd[:, None] + lr_scale[:, None] * grad
  return jnp.where(present[:, None], new, table), accum


def dense_reference(params, batches, opt, dense_opt, late):
  """nn.Embed + jax.grad; tables: dense_rowwise_adagrad (late: a step late)."""
  model = TwoTower(lambda n, f, name: nn.Embed(n, f, name=name))
  keys = {"user_embed": "user", "tower/item_embed": "item"}
  flat = traverse_util.flatten_dict(params, sep="/")
  tables = {k: flat.pop(k + "/embedding") for k in keys}
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
    out = {k: dense_rowwise_adagrad(opt, WIDTH, tables[k], rows[k], g_tab[k],
                                    batch[f]) for k, f in keys.items()}
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


def train_flax(ctx, params, batches, opt, dense_opt, pipelined, backend):
  model = TwoTower(embed_fn(ctx, backend))
  trainer = FlaxTrainer(
      model, {"user_embed": pe.TableSpec(ctx, opt, "user"),
              "tower/item_embed": pe.TableSpec(ctx, opt, "item")},
      mse, dense_opt, pipelined=pipelined, backend=backend)
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
  return trainer, state, losses


class FlaxTrainerTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.mesh = test_util.mesh({"x": 8})
    cls.ctx = pe.make_context(cls.mesh, "x", tokens_per_batch=BATCH,
                              emb_width=WIDTH, num_unique=BATCH + 1)
    cls.host_batches, cls.batches = make_batches(cls.ctx)
    model = TwoTower(embed_fn(cls.ctx, "xla"))
    cls.params = nn.unbox(model.init(jax.random.key(0),
                                     cls.batches[0])["params"])
    cls.opt = pe.RowwiseAdagrad(0.3, half_life_steps=20.0,
                                weight_decay=1e-3)
    cls.dense_opt = optax.adam(1e-2)

  def _host_params(self):
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), self.params)

  def _compare(self, trainer, state, losses, reference):
    ref_tables, ref_rows, ref_dense, ref_losses = reference
    # f32 everywhere; only the order of the gradient sums differs (the
    # observed gap is ~1e-6, far inside bf16's 8e-3).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    for key in ("user_embed", "tower/item_embed"):
      np.testing.assert_allclose(np.asarray(state.tables[key].table),
                                 np.asarray(ref_tables[key]),
                                 rtol=1e-4, atol=1e-5, err_msg=key)
      np.testing.assert_allclose(
          np.asarray(state.tables[key].opt_state.row_state),
          np.asarray(ref_rows[key]), rtol=1e-4, atol=1e-8, err_msg=key)
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
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        trainer, state, losses = train_flax(
            self.ctx, self.params, self.batches, self.opt, self.dense_opt,
            pipelined, backend)
        self._compare(trainer, state, losses, reference)
        # It learns: the last steps' loss is well below the first's.
        self.assertLess(np.mean(losses[-5:]), 0.5 * np.mean(losses[:5]))

  def test_bf16_tables_learn(self):
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(jnp.bfloat16)
        if path[-1].key == "embedding" else x, self.params)
    _, state, losses = train_flax(self.ctx, params, self.batches, self.opt,
                                  self.dense_opt, True, "xla")
    self.assertEqual(state.tables["user_embed"].table.dtype, jnp.bfloat16)
    self.assertLess(np.mean(losses[-5:]), 0.5 * np.mean(losses[:5]))

  def test_contract_errors(self):
    model = TwoTower(embed_fn(self.ctx, "xla"))
    spec = pe.TableSpec(self.ctx, self.opt, "user")
    batch = self.batches[0]

    only_user = FlaxTrainer(model, {"user_embed": spec}, mse, optax.sgd(0.1),
                            pipelined=False)
    state = only_user.init(self.params)
    with self.assertRaisesRegex(KeyError, r"Embed at 'tower/item_embed'.*not"
                                r" in tables \['user_embed'\]"):
      jax.jit(only_user.step)(state, batch)

    with self.assertRaisesRegex(KeyError, r"params have no 'user/embedding'"
                                r".*'tower/item_embed', 'user_embed'"):
      FlaxTrainer(model, {"user": spec}, mse, optax.sgd(0.1)).split(
          self.params)

    swapped = FlaxTrainer(
        model, {"user_embed": spec,
                "tower/item_embed": pe.TableSpec(self.ctx, self.opt,
                                                 "pairs")},
        mse, optax.sgd(0.1), pipelined=False)
    state = swapped.init(self.params)
    bad = dict(batch, pairs=jnp.zeros((BATCH // 8, 8), jnp.int32))
    with self.assertRaisesRegex(
        ValueError, r"Embed 'tower/item_embed' was called with ids of shape "
        r"\(64,\).*batch\['pairs'\] of shape \(8, 8\)"):
      jax.jit(swapped.step)(state, bad)

    with self.assertRaisesRegex(TypeError, "expected pallas_emb.TableSpec"):
      FlaxTrainer(model, {"user_embed": (self.ctx, self.opt, "user")}, mse,
                  optax.sgd(0.1))

  def test_unused_table(self):
    class OnlyUser(nn.Module):
      @nn.compact
      def __call__(self, batch):
        pe_flax.Embed(ITEMS + 1, WIDTH, self.ctx_, name="item_embed")
        u = pe_flax.Embed(USERS + 1, WIDTH, self.ctx_, name="user_embed")(
            batch["user"])
        return jnp.sum(u, axis=-1)
      ctx_: pe.EmbeddingContext = None

    model = OnlyUser(ctx_=self.ctx)
    params = {"user_embed": self.params["user_embed"],
              "item_embed": self.params["tower"]["item_embed"]}
    trainer = FlaxTrainer(
        model, {"user_embed": pe.TableSpec(self.ctx, self.opt, "user"),
                "item_embed": pe.TableSpec(self.ctx, self.opt, "item")},
        mse, optax.sgd(0.1), pipelined=False)
    with self.assertRaisesRegex(ValueError, r"tables \['item_embed'\] were "
                                "never called"):
      jax.jit(trainer.step)(trainer.init(params), self.batches[0])

  def test_readme_example(self):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "examples"))
    import flax_example  # pylint: disable=import-outside-toplevel
    loss, params = flax_example.main(steps=30)
    self.assertLess(loss, 0.05)
    self.assertEqual(params["embed"]["embedding"].shape, (1000, 64))


if __name__ == "__main__":
  absltest.main()
