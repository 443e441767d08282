"""apply_gradients (and RowwiseAdagrad) against the numpy model."""

import functools

import test_util

import chex
from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import numpy_model
import pallas_emb as pe

VOCAB = 29


def layout(ranks):
  mesh = test_util.mesh({"x": ranks})
  return mesh


def make(ranks, shard_width, tokens, num_unique=None, dtype=np.float32,
         seed=0, opt_kw=None):
  ctx = pe.make_context(layout(ranks), "x", tokens_per_batch=tokens,
                        emb_width=ranks * shard_width,
                        num_unique=num_unique or tokens + 1)
  rng = np.random.default_rng(seed)
  table = rng.standard_normal((VOCAB, ctx.emb_width)).astype(dtype)
  opt = pe.RowwiseAdagrad(**(opt_kw or dict(learning_rate=0.1)))
  return ctx, table, opt, rng


def batch(rng, tokens, vocab=VOCAB, zipf=True):
  """Ids with repeats (hot ids), padding 0, negatives and out-of-range ids."""
  if zipf:
    ids = np.minimum(rng.zipf(1.3, tokens), vocab + 3) - 1
  else:
    ids = rng.integers(0, vocab, tokens)
  ids = ids.astype(np.int32)
  ids[rng.integers(0, tokens, 3)] = [0, -2, vocab + 4]
  return ids


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(ctx, opt, backend, table, state, ids, grads, pending):
  result = pe.dedup(ctx, ids, vocab_rows=table.shape[0])
  return pe.apply_gradients(ctx, opt, table, state, grads, result,
                            pending=pending, backend=backend)


def run(ctx, opt, backend, table, batches, pending=None):
  table = jax.device_put(table, pe.table_sharding(ctx))
  state = opt.init(ctx, table)
  stats = []
  for i, (ids, grads) in enumerate(batches):
    p = True if pending is None else pending[i]
    table, state, s = train_step(
        ctx, opt, backend, table, state,
        jax.device_put(ids, pe.token_sharding(ctx)),
        jax.device_put(grads, pe.token_sharding(ctx)), jnp.asarray(p))
    stats.append(jax.device_get(s))
  return table, state, stats


def assert_close_to_model(test, table, state, model):
  """f32 sums in another order: f32 to rtol 2e-6, bf16 to one rounding."""
  got = test_util.as_numpy(table).astype(np.float32)
  want = model.table.astype(np.float32)
  if model.dtype == np.float32:
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
  else:
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(test_util.as_numpy(state.row_state),
                             model.row_state, rtol=2e-6, atol=1e-12)
  if model.last_step is not None:
    np.testing.assert_array_equal(test_util.as_numpy(state.last_step),
                                  model.last_step)
  test.assertEqual(int(state.step), model.step_count)


OPTS = {
    "plain": dict(learning_rate=0.1),
    "half_life": dict(learning_rate=0.05, half_life_steps=2.0,
                      initial_accumulator_value=0.1),
    "weight_decay": dict(learning_rate=0.1, weight_decay=0.05),
    "lazy_half_life": dict(learning_rate=0.1, half_life_steps=3.0, lazy=True),
    "lazy_both": dict(learning_rate=0.2, half_life_steps=1.5,
                      weight_decay=0.1, lazy=True, eps=1e-3),
}


class ApplyGradientsTest(parameterized.TestCase):

  @parameterized.parameters(*test_util.all_pairs(
      ranks=[1, 2, 4, 8], opt=list(OPTS), dtype=[np.float32, test_util.BF16]))
  def test_matches_model(self, ranks, opt, dtype):
    shard_width = 3 if ranks in (1, 4) else 2
    tokens = 32
    ctx, table, optimizer, rng = make(ranks, shard_width, tokens, dtype=dtype,
                                      seed=ranks, opt_kw=OPTS[opt])
    batches = [(batch(rng, tokens),
                rng.standard_normal((tokens, ctx.emb_width)).astype(dtype))
               for _ in range(3)]
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        model = numpy_model.Adagrad(table, **_model_kw(OPTS[opt]))
        norms = [model.step(ids, g, ctx.num_unique)[0] for ids, g in batches]
        out, state, stats = run(ctx, optimizer, backend, table, batches)
        assert_close_to_model(self, out, state, model)
        np.testing.assert_allclose([s.norm for s in stats], norms, rtol=2e-6)
        self.assertEqual([int(s.valid) for s in stats], [1, 1, 1])

  @parameterized.parameters(np.nan, np.inf, -np.inf)
  def test_non_finite_gradient_skips(self, bad):
    ctx, table, opt, rng = make(4, 2, 16, dtype=test_util.BF16,
                                opt_kw=OPTS["lazy_both"])
    good = (batch(rng, 16), rng.standard_normal((16, 8)).astype(
        test_util.BF16))
    ids = batch(rng, 16)
    grads = rng.standard_normal((16, 8)).astype(test_util.BF16)
    grads[np.flatnonzero(ids > 0)[0], 5] = bad
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        ref_table, ref_state, _ = run(ctx, opt, backend, table, [good])
        out, state, stats = run(ctx, opt, backend, table,
                                [good, (ids, grads)])
        self.assertEqual(int(stats[1].valid), 0)
        self.assertFalse(np.isfinite(stats[1].norm))
        test_util.assert_bits_equal(self, out, test_util.as_numpy(ref_table))
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
          test_util.assert_bits_equal(self, a, test_util.as_numpy(b))

  def test_pending_false_is_a_no_op(self):
    ctx, table, opt, rng = make(2, 3, 16, opt_kw=OPTS["lazy_half_life"])
    batches = [(batch(rng, 16), rng.standard_normal((16, 6)).astype(
        np.float32)) for _ in range(3)]
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        out, state, stats = run(ctx, opt, backend, table, batches,
                                pending=[True, False, True])
        model = numpy_model.Adagrad(table, **_model_kw(OPTS["lazy_half_life"]))
        for (ids, g), p in zip(batches, [True, False, True]):
          model.step(ids, g, ctx.num_unique, pending=p)
        assert_close_to_model(self, out, state, model)
        self.assertEqual([int(s.valid) for s in stats], [1, 0, 1])
        self.assertEqual([int(s.pending) for s in stats], [1, 0, 1])

  def test_padding_and_fill_untouched(self):
    ctx, table, opt, rng = make(4, 2, 16, num_unique=12,
                                opt_kw=OPTS["weight_decay"])
    ids = np.array([0, 0, 3, 3, 5, 0, 7, 7, 0, 3, 3, 5, 0, 2, 2, 0], np.int32)
    grads = rng.standard_normal((16, 8)).astype(np.float32)
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        out, state, _ = run(ctx, opt, backend, table, [(ids, grads)])
        out = test_util.as_numpy(out)
        untouched = [r for r in range(VOCAB) if r not in (2, 3, 5, 7)]
        # Row 0 (padding) keeps its bits: no gradient, no weight decay.
        np.testing.assert_array_equal(out[untouched], table[untouched])
        self.assertTrue((out[[2, 3, 5, 7]] != table[[2, 3, 5, 7]]).all())
        self.assertEqual(float(state.row_state[0]), 0.0)

  def test_bitwise_deterministic(self):
    ctx, table, opt, rng = make(8, 2, 64, dtype=test_util.BF16)
    batches = [(batch(rng, 64), rng.standard_normal((64, 16)).astype(
        test_util.BF16)) for _ in range(2)]
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        a, sa, _ = run(ctx, opt, backend, table, batches)
        b, sb, _ = run(ctx, opt, backend, table, batches)
        test_util.assert_bits_equal(self, a, test_util.as_numpy(b))
        test_util.assert_bits_equal(self, sa.row_state,
                                    test_util.as_numpy(sb.row_state))

  def test_sparse_equals_dense_training(self):
    """N sparse steps == jax.grad through lookup + jnp row-wise Adagrad."""
    ctx, table, opt, rng = make(4, 4, 32, dtype=test_util.BF16)
    target = rng.standard_normal((32, 16)).astype(np.float32)
    # In range only: lookup clamps an id past the end onto the last row, but
    # the sparse update skips it (lookup clamps it), so dense would differ.
    id_batches = [batch(rng, 32, zipf=False) % VOCAB for _ in range(5)]

    def loss(t, ids):
      emb = pe.lookup(ctx, t, ids).astype(jnp.float32)
      return jnp.sum((emb - target) ** 2)

    @jax.jit
    def dense_step(dense, acc, ids):
      # The full gradient, row-wise Adagrad on every row (padding row 0
      # masked out, as the sparse path gives it none).
      g = jax.grad(loss)(dense.astype(jnp.bfloat16), ids).astype(
          jnp.float32).at[0].set(0)
      acc = acc + jnp.mean(g * g, axis=1)
      return dense - 0.1 * g / (jnp.sqrt(acc) + 1e-10)[:, None], acc

    @functools.partial(jax.jit, static_argnums=0)
    def sparse_step(backend, sparse, state, ids):
      emb_grad = jax.grad(lambda e: jnp.sum(
          (e.astype(jnp.float32) - target) ** 2))(pe.lookup(ctx, sparse, ids))
      sparse, state, _ = pe.apply_gradients(
          ctx, opt, sparse, state, emb_grad,
          pe.dedup(ctx, ids, vocab_rows=VOCAB), backend=backend)
      return sparse, state

    for backend in test_util.backends():
      with self.subTest(backend=backend):
        sparse = jax.device_put(table, pe.table_sharding(ctx))
        state = opt.init(ctx, sparse)
        dense = jnp.asarray(table, jnp.float32)
        acc = jnp.zeros((VOCAB,), jnp.float32)
        for ids in id_batches:
          ids_dev = jax.device_put(ids, pe.token_sharding(ctx))
          sparse, state = sparse_step(backend, sparse, state, ids_dev)
          dense, acc = dense_step(dense, acc, ids_dev)
        np.testing.assert_allclose(
            test_util.as_numpy(sparse).astype(np.float32), np.asarray(dense),
            rtol=0.02, atol=0.02)

  def test_overflow_is_reported(self):
    ctx, table, opt, _ = make(2, 2, 16, num_unique=4)
    _, _, stats = run(ctx, opt, "xla", table,
                      [(np.arange(1, 17, dtype=np.int32),
                        np.ones((16, 4), np.float32))])
    self.assertEqual(int(stats[0].num_overflow), 12)

  def test_wrapped_id_and_last_row_are_one_row(self):
    # -1 and 15 on a 16-row table: one row, both gradients (accumulator 4.0,
    # not 1.0 as when they were two unique slots writing one row).
    ctx = pe.make_context(layout(2), "x", tokens_per_batch=4, emb_width=4,
                          num_unique=5)
    table = np.zeros((16, 4), np.float32)
    opt = pe.RowwiseAdagrad(0.1)
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        _, state, _ = run(ctx, opt, backend, table,
                          [(np.array([-1, 15, 3, 3], np.int32),
                            np.ones((4, 4), np.float32))])
        np.testing.assert_array_equal(
            test_util.as_numpy(state.row_state)[[3, 15]], [4.0, 4.0])

  def test_padding_id_none_trains_row_0(self):
    ctx = pe.make_context(layout(2), "x", tokens_per_batch=4, emb_width=4,
                          num_unique=5, padding_id=None)
    out, state, _ = run(ctx, pe.RowwiseAdagrad(0.1), "xla",
                        np.zeros((8, 4), np.float32),
                        [(np.array([0, 0, 1, 2], np.int32),
                          np.ones((4, 4), np.float32))])
    self.assertEqual(float(state.row_state[0]), 4.0)
    self.assertTrue((test_util.as_numpy(out)[0] != 0).all())


class UpdateVariantsTest(chex.TestCase):
  """apply_gradients eagerly and under jit: the same bits."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_model(self):
    ctx, table, opt, rng = make(4, 2, 16, opt_kw=OPTS["lazy_both"])
    ids, grads = batch(rng, 16), rng.standard_normal((16, 8)).astype(
        np.float32)
    model = numpy_model.Adagrad(table, **_model_kw(OPTS["lazy_both"]))
    model.step(ids, grads, ctx.num_unique)
    table_dev = jax.device_put(table, pe.table_sharding(ctx))
    step = self.variant(lambda t, s, i, g: pe.apply_gradients(
        ctx, opt, t, s, g, pe.dedup(ctx, i, vocab_rows=VOCAB)))
    out, state, stats = step(table_dev, opt.init(ctx, table_dev),
                             jax.device_put(ids, pe.token_sharding(ctx)),
                             jax.device_put(grads, pe.token_sharding(ctx)))
    assert_close_to_model(self, out, state, model)
    self.assertEqual(int(stats.valid), 1)


class StateAndGradientChecksTest(absltest.TestCase):

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
    self.dd = pe.dedup(self.ctx, self.ids, vocab_rows=VOCAB)

  def test_grads_wrong_shape(self):
    with self.assertRaisesRegex(pe.InputError, r"emb_grads has shape \(16, 4\); "
                                r"expected \(16, 8\)"):
      pe.apply_gradients(self.ctx, self.opt, self.table, self.state,
                         jnp.zeros((16, 4)), self.dd)

  def test_grads_wrong_dtype(self):
    with self.assertRaisesRegex(pe.InputError, "emb_grads has dtype float16"):
      pe.apply_gradients(self.ctx, self.opt, self.table, self.state,
                         jnp.zeros((16, 8), jnp.float16), self.dd)

  def test_state_of_another_table(self):
    other = self.opt.init(self.ctx, jnp.zeros((VOCAB + 1, 8)))
    with self.assertRaisesRegex(pe.InputError, r"row_state has shape \(30,\); "
                                r"expected \(29,\)"):
      pe.apply_gradients(self.ctx, self.opt, self.table, other,
                         jnp.zeros((16, 8)), self.dd)

  def test_lazy_state_for_eager_optimizer(self):
    lazy = pe.RowwiseAdagrad(0.1, weight_decay=0.1, lazy=True)
    with self.assertRaisesRegex(pe.InputError, "lazy=True optimizer"):
      pe.apply_gradients(self.ctx, self.opt, self.table,
                         lazy.init(self.ctx, self.table),
                         jnp.zeros((16, 8)), self.dd)

def _train(ctx, opt, table, batches, backend="xla"):
  table = jax.device_put(table, pe.table_sharding(ctx))
  state = opt.init(ctx, table)
  for ids, grads in batches:
    ids = jax.device_put(ids, pe.token_sharding(ctx))
    grads = jax.device_put(grads, pe.token_sharding(ctx))
    table, state, stats = train_step(ctx, opt, backend, table,
                                                state, ids, grads,
                                                jnp.asarray(True))
    assert int(stats.valid) == 1
  return test_util.as_numpy(table), test_util.as_numpy(state.row_state)


class ReplicaAxisTest(absltest.TestCase):

  def test_replicated_layout_trains_like_flat(self):
    rng = np.random.default_rng(0)
    tokens, width = 32, 8
    table = rng.standard_normal((VOCAB, width)).astype(np.float32)
    batches = [(batch(rng, tokens, VOCAB),
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
        batches = [(batch(rng, tokens, vocab),
                    rng.standard_normal((tokens, ctx.emb_width)).astype(dtype))
                   for _ in range(2)]
        model = numpy_model.Adagrad(table, **_model_kw(kw))
        for ids, g in batches:
          model.step(ids, g, num_unique)
        out, state, _ = run(ctx, pe.RowwiseAdagrad(**kw), backend,
                                       table, batches)
        try:
          assert_close_to_model(self, out, state, model)
        except AssertionError as e:
          raise AssertionError(f"random config {config} failed: {e}") from e


class HyperParameterTest(parameterized.TestCase):

  @parameterized.parameters(
      (dict(learning_rate=float("nan")), "learning_rate=nan"),
      (dict(learning_rate=0.1, eps=0.0), "eps=0.0 must be finite and > 0"),
      (dict(learning_rate=0.1, eps=float("inf")), "eps=inf"),
      (dict(learning_rate=0.1, half_life_steps=0), "half_life_steps=0"),
      (dict(learning_rate=0.1, weight_decay=-1.0), "weight_decay=-1.0"),
      (dict(learning_rate=0.1, weight_decay=1e4), "underflow"),
      (dict(learning_rate=0.1, initial_accumulator_value=-1.0),
       "initial_accumulator_value=-1.0"),
      (dict(learning_rate=0.1, lazy=True), "lazy=True needs half_life_steps"),
  )
  def test_bad(self, kw, message):
    with self.assertRaisesRegex(pe.HyperParameterError, message):
      pe.RowwiseAdagrad(**kw)

  def test_schedule(self):
    opt = pe.RowwiseAdagrad(learning_rate=lambda s: 0.1 / (1.0 + s))
    self.assertAlmostEqual(float(opt.learning_rate_at(jnp.int32(1))), 0.05)


def _model_kw(kw):
  names = dict(learning_rate="lr", eps="eps", initial_accumulator_value=
               "init_acc", half_life_steps="half_life",
               weight_decay="weight_decay", lazy="lazy")
  return {names[k]: v for k, v in kw.items()}


if __name__ == "__main__":
  absltest.main()
