"""Hostile input, the replica axis, and randomized configs vs the model."""

import functools

import test_util

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import numpy_model
import optim_test
import pallas_emb as pe

VOCAB = 31


class HostileInputTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.ctx = pe.make_context(test_util.mesh({"x": 4}), "x",
                               tokens_per_batch=16, emb_width=8,
                               num_unique=17)
    self.table = jax.device_put(jnp.zeros((VOCAB, 8)),
                                pe.table_sharding(self.ctx))
    self.opt = pe.RowwiseAdagrad(0.1)
    self.state = self.opt.init(self.ctx, self.table)
    self.ids = jax.device_put(jnp.arange(16, dtype=jnp.int32),
                              pe.token_sharding(self.ctx))
    self.dd = pe.dedup(self.ctx, self.ids)

  def test_grads_wrong_shape(self):
    with self.assertRaisesRegex(ValueError, r"emb_grads has shape \(16, 4\); "
                                r"expected \(16, 8\)"):
      pe.apply_gradients(self.ctx, self.opt, self.table, self.state,
                         jnp.zeros((16, 4)), self.dd)

  def test_grads_wrong_dtype(self):
    with self.assertRaisesRegex(ValueError, "emb_grads has dtype float16"):
      pe.apply_gradients(self.ctx, self.opt, self.table, self.state,
                         jnp.zeros((16, 8), jnp.float16), self.dd)

  def test_state_of_another_table(self):
    other = self.opt.init(self.ctx, jnp.zeros((VOCAB + 1, 8)))
    with self.assertRaisesRegex(ValueError, r"row_state has shape \(32,\); "
                                r"expected \(31,\)"):
      pe.apply_gradients(self.ctx, self.opt, self.table, other,
                         jnp.zeros((16, 8)), self.dd)

  def test_lazy_state_for_eager_optimizer(self):
    lazy = pe.RowwiseAdagrad(0.1, weight_decay=0.1, lazy=True)
    with self.assertRaisesRegex(ValueError, "lazy=True optimizer"):
      pe.apply_gradients(self.ctx, self.opt, self.table,
                         lazy.init(self.ctx, self.table),
                         jnp.zeros((16, 8)), self.dd)

  def test_table_wrong_width(self):
    with self.assertRaisesRegex(ValueError, r"table has shape \(31, 6\)"):
      pe.lookup(self.ctx, jnp.zeros((VOCAB, 6)), self.ids)

  def test_ids_wrong_shape(self):
    with self.assertRaisesRegex(ValueError, "expected tokens_per_batch=16"):
      pe.lookup(self.ctx, self.table, jnp.zeros((4, 3), jnp.int32))

  def test_out_of_range_checking_mode(self):
    ids = jnp.array([0, 5, -1, -VOCAB, VOCAB, -VOCAB - 1, 2**31 - 1, 3] * 2,
                    jnp.int32)
    count = jax.jit(pe.count_out_of_range, static_argnums=1)(ids, VOCAB)
    self.assertEqual(int(count), 6)
    with self.assertRaisesRegex(ValueError, "batch has 6 token ids outside "
                                r"\[-31, 31\)"):
      pe.raise_if_out_of_range(count, VOCAB)
    pe.raise_if_out_of_range(pe.count_out_of_range(ids % VOCAB, VOCAB), VOCAB)
    # Defined behaviour without checking: wrap once, then clamp.
    out = pe.lookup(self.ctx, self.table, jax.device_put(
        ids, pe.token_sharding(self.ctx)))
    self.assertEqual(out.shape, (16, 8))


def _train(ctx, opt, table, batches, backend="xla"):
  table = jax.device_put(table, pe.table_sharding(ctx))
  state = opt.init(ctx, table)
  for ids, grads in batches:
    ids = jax.device_put(ids, pe.token_sharding(ctx))
    grads = jax.device_put(grads, pe.token_sharding(ctx))
    table, state, stats = optim_test.train_step(ctx, opt, backend, table,
                                                state, ids, grads,
                                                jnp.asarray(True))
    assert int(stats.valid) == 1
  return test_util.as_numpy(table), test_util.as_numpy(state.row_state)


class ReplicaAxisTest(absltest.TestCase):

  def test_replicated_layout_trains_like_flat(self):
    rng = np.random.default_rng(0)
    tokens, width = 32, 8
    table = rng.standard_normal((VOCAB, width)).astype(np.float32)
    batches = [(optim_test.batch(rng, tokens, VOCAB),
                rng.standard_normal((tokens, width)).astype(np.float32))
               for _ in range(3)]
    opt = pe.RowwiseAdagrad(0.1, weight_decay=0.01)
    flat = pe.make_context(test_util.mesh({"x": 8}), "x",
                           tokens_per_batch=tokens, emb_width=width,
                           num_unique=tokens + 1)
    replicated = pe.make_context(
        test_util.mesh({"replica": 2, "x": 4}), "x", data_axis="x",
        replica_axis="replica", tokens_per_batch=tokens, emb_width=width,
        num_unique=tokens + 1)
    self.assertEqual(replicated.tokens_per_rank, 4)
    backends = test_util.backends()
    for backend in backends:
      with self.subTest(backend=backend):
        flat_table, flat_state = _train(flat, opt, table, batches, backend)
        rep_table, rep_state = _train(replicated, opt, table, batches,
                                      backend)
        # Same math; only the f32 summation order of the gradient differs
        # (the replica psum adds two partial sums): f32 rtol 1e-6.
        np.testing.assert_allclose(rep_table, flat_table, rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(rep_state, flat_state, rtol=1e-6,
                                   atol=1e-9)

  def test_without_replica_axis_rule3_stays(self):
    with self.assertRaisesRegex(ValueError, "exactly one token shard"):
      pe.make_context(test_util.mesh({"replica": 2, "x": 4}), "x",
                      data_axis=("replica", "x"), tokens_per_batch=32,
                      emb_width=8, num_unique=33)

  def test_lookup_on_replicated_layout(self):
    ctx = pe.make_context(test_util.mesh({"replica": 2, "x": 4}), "x",
                          replica_axis="replica", tokens_per_batch=16,
                          emb_width=8, num_unique=17)
    table = np.random.default_rng(1).standard_normal((VOCAB, 8)).astype(
        np.float32)
    ids = np.arange(-8, 8, dtype=np.int32) * 3
    out = pe.lookup(ctx, jax.device_put(table, pe.table_sharding(ctx)),
                    jax.device_put(ids, pe.token_sharding(ctx)))
    rows = np.clip(np.where(ids < 0, ids + VOCAB, ids), 0, VOCAB - 1)
    np.testing.assert_array_equal(np.asarray(out), table[rows])


class RandomizedTest(parameterized.TestCase):
  """Many random layouts and hyper-parameters against the numpy model."""

  def test_random_configs(self):
    for seed in range(12):
      rng = np.random.default_rng(1000 + seed)
      ranks = int(rng.choice([1, 2, 4, 8]))
      shard_width = int(rng.integers(1, 6))
      tokens = ranks * int(rng.integers(1, 6)) * 2
      dtype = [np.float32, test_util.BF16][int(rng.integers(2))]
      lazy = bool(rng.integers(2))
      kw = dict(learning_rate=float(rng.uniform(0.01, 0.5)),
                half_life_steps=float(rng.uniform(1, 5)),
                weight_decay=float(rng.choice([0.0, 0.05])), lazy=lazy)
      vocab = int(rng.integers(8, 40))
      num_unique = int(min(tokens, vocab + 6)) + 1
      backend = test_util.backends()[seed % len(test_util.backends())]
      config = dict(seed=1000 + seed, ranks=ranks, shard_width=shard_width,
                    tokens=tokens, dtype=np.dtype(dtype).name, vocab=vocab,
                    backend=backend, **kw)
      logging.info("random config %s", config)
      with self.subTest(**config):
        ctx = pe.make_context(test_util.mesh({"x": ranks}), "x",
                              tokens_per_batch=tokens,
                              emb_width=ranks * shard_width,
                              num_unique=num_unique)
        table = rng.standard_normal((vocab, ctx.emb_width)).astype(dtype)
        batches = [(optim_test.batch(rng, tokens, vocab),
                    rng.standard_normal((tokens, ctx.emb_width)).astype(dtype))
                   for _ in range(2)]
        model = numpy_model.Adagrad(table, **optim_test._model_kw(kw))
        for ids, g in batches:
          model.step(ids, g, num_unique)
        out, state, _ = optim_test.run(ctx, pe.RowwiseAdagrad(**kw), backend,
                                       table, batches)
        try:
          optim_test.assert_close_to_model(self, out, state, model)
        except AssertionError as e:
          raise AssertionError(f"random config {config} failed: {e}") from e


if __name__ == "__main__":
  absltest.main()
