"""The pipelined step against a synchronous loop that applies late."""

import functools

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import pipeline

VOCAB = 41
TOKENS = 32


def make_setup(lazy, dtype, ranks=8):
  mesh = test_util.mesh({"x": ranks})
  ctx = pe.make_context(mesh, "x", tokens_per_batch=TOKENS,
                        emb_width=2 * ranks, num_unique=TOKENS + 1)
  opt = (pe.RowwiseAdagrad(0.1, half_life_steps=2.0, weight_decay=0.01,
                           lazy=True) if lazy else
         pe.RowwiseAdagrad(0.1, half_life_steps=4.0))
  rng = np.random.default_rng(0)
  table = jax.device_put(
      rng.standard_normal((VOCAB, ctx.emb_width)).astype(dtype),
      pe.table_sharding(ctx))
  params = {"w": jnp.asarray(rng.standard_normal((ctx.emb_width, 1)),
                             jnp.float32) * 0.3,
            "b": jnp.zeros((1,), jnp.float32)}
  batches = []
  for _ in range(6):
    ids = (np.minimum(rng.zipf(1.4, TOKENS), VOCAB) - 1).astype(np.int32)
    batches.append({
        "ids": jax.device_put(ids, pe.token_sharding(ctx)),
        "y": jax.device_put(rng.standard_normal(TOKENS).astype(np.float32),
                            pe.token_sharding(ctx))})
  return ctx, opt, table, params, batches


def loss_fn(params, embeddings, batch):
  x = embeddings["t"].astype(jnp.float32)
  pred = (x @ params["w"] + params["b"])[:, 0]
  loss = jnp.mean((pred - batch["y"]) ** 2)
  return loss, {"pred_mean": jnp.mean(pred)}


def late_loop(ctx, opt, table, params, batches, backend, dense_opt):
  """Synchronous reference: look up, then apply the previous step's grads."""
  state = opt.init(ctx, table)
  dense_state = dense_opt.init(params)
  staged = None
  losses = []

  @jax.jit
  def step(table, state, params, dense_state, staged, batch):
    emb = pe.lookup(ctx, table, batch["ids"], backend=backend)
    (loss, _), (g_params, g_emb) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, {"t": emb}, batch)
    updates, dense_state = dense_opt.update(g_params, dense_state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    if staged is not None:
      grads, dd = staged
      table, state, _ = pe.apply_gradients(ctx, opt, table, state, grads, dd,
                                           backend=backend)
    dd = pe.dedup(ctx, batch["ids"], vocab_rows=VOCAB)
    return table, state, params, dense_state, (g_emb["t"], dd), loss

  for batch in batches:
    table, state, params, dense_state, staged, loss = step(
        table, state, params, dense_state, staged, batch)
    losses.append(loss)
  return table, state, params, losses


class PipelineTest(parameterized.TestCase):

  @parameterized.product(lazy=[False, True],
                         dtype=[np.float32, test_util.BF16])
  def test_equals_late_synchronous_loop(self, lazy, dtype):
    ctx, opt, table, params, batches = make_setup(lazy, dtype)
    dense_opt = optax.adam(1e-2)
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        trainer = pipeline.Trainer(
            {"t": pipeline.TableSpec(ctx, opt, "ids")}, loss_fn, dense_opt,
            pipelined=True, backend=backend)
        # Copies: the step donates the state, the reference needs the inputs.
        state = trainer.init({"t": jnp.copy(table)},
                             jax.tree.map(jnp.copy, params), batches[0])
        step = jax.jit(trainer.step, donate_argnums=0)
        losses, valid = [], []
        for t, batch in enumerate(batches):
          nxt = batches[min(t + 1, len(batches) - 1)]
          state, metrics = step(state, batch, nxt)
          losses.append(metrics.loss)
          valid.append(int(metrics.updates["t"].valid))
        self.assertEqual(valid, [0, 1, 1, 1, 1, 1])  # first update: no-op
        ref_table, ref_state, ref_params, ref_losses = late_loop(
            ctx, opt, table, params, batches, backend, dense_opt)
        test_util.assert_bits_equal(
            self, state.tables["t"].table, test_util.as_numpy(ref_table))
        test_util.assert_bits_equal(
            self, state.tables["t"].opt_state.row_state,
            test_util.as_numpy(ref_state.row_state))
        np.testing.assert_array_equal(np.asarray(losses),
                                      np.asarray(ref_losses))
        for a, b in zip(jax.tree.leaves(state.dense_params),
                        jax.tree.leaves(ref_params)):
          test_util.assert_bits_equal(self, a, test_util.as_numpy(b))

  def test_first_update_is_a_no_op(self):
    ctx, opt, table, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer({"t": pipeline.TableSpec(ctx, opt, "ids")},
                               loss_fn, optax.sgd(0.1))
    before = test_util.as_numpy(table)
    state = trainer.init({"t": table}, params, batches[0])
    state, metrics = jax.jit(trainer.step)(state, batches[0], batches[1])
    self.assertEqual(int(metrics.updates["t"].valid), 0)
    self.assertEqual(int(metrics.updates["t"].pending), 0)
    test_util.assert_bits_equal(self, state.tables["t"].table, before)
    self.assertEqual(int(state.tables["t"].opt_state.step), 0)

  def test_flush_applies_last_update(self):
    ctx, opt, table, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer({"t": pipeline.TableSpec(ctx, opt, "ids")},
                               loss_fn, optax.sgd(0.1))
    state = trainer.init({"t": table}, params, batches[0])
    state, _ = trainer.step(state, batches[0], batches[1])
    state, stats = trainer.flush(state)
    self.assertEqual(int(stats["t"].valid), 1)
    self.assertEqual(int(state.tables["t"].opt_state.step), 1)
    _, stats = trainer.flush(state)  # nothing left staged
    self.assertEqual(int(stats["t"].valid), 0)

  def test_synchronous_mode_learns(self):
    ctx, opt, table, params, batches = make_setup(False, np.float32)
    trainer = pipeline.Trainer({"t": pipeline.TableSpec(ctx, opt, "ids")},
                               loss_fn, optax.sgd(0.05), pipelined=False)
    state = trainer.init({"t": table}, params)
    step = jax.jit(trainer.step, donate_argnums=0)
    first = None
    for _ in range(20):
      state, metrics = step(state, batches[0])
      first = first if first is not None else float(metrics.loss)
      self.assertEqual(int(metrics.updates["t"].valid), 1)
    self.assertLess(float(metrics.loss), 0.5 * first)

  def test_misuse(self):
    ctx, opt, table, params, batches = make_setup(False, np.float32)
    spec = {"t": pipeline.TableSpec(ctx, opt, "ids")}
    piped = pipeline.Trainer(spec, loss_fn, optax.sgd(0.1))
    sync = pipeline.Trainer(spec, loss_fn, optax.sgd(0.1), pipelined=False)
    with self.assertRaisesRegex(ValueError, "needs first_batch"):
      piped.init({"t": table}, params)
    sync_state = sync.init({"t": table}, params)
    with self.assertRaisesRegex(ValueError, "nothing prefetched or staged"):
      jax.jit(piped.step)(sync_state, batches[0], batches[1])
    piped_state = piped.init({"t": table}, params, batches[0])
    with self.assertRaisesRegex(ValueError, "needs next_batch"):
      jax.jit(piped.step)(piped_state, batches[0])
    with self.assertRaisesRegex(ValueError, "staged update would be dropped"):
      jax.jit(sync.step)(piped_state, batches[0])
    with self.assertRaisesRegex(ValueError, r"expected exactly the tables"):
      piped.init({"u": table}, params, batches[0])


if __name__ == "__main__":
  absltest.main()
