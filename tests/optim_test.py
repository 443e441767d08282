"""dedup + apply_gradients against the numpy model of DESIGN §4-§5."""

import functools

import test_util

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

  @parameterized.product(ranks=[1, 2, 4, 8], opt=list(OPTS),
                         dtype=[np.float32, test_util.BF16])
  def test_matches_model(self, ranks, opt, dtype):
    shard_width = 3 if ranks in (1, 4) else 2
    tokens = 32
    ctx, table, optimizer, rng = make(ranks, shard_width, tokens, dtype=dtype,
                                      seed=ranks, opt_kw=OPTS[opt])
    batches = [(batch(rng, tokens),
                rng.standard_normal((tokens, ctx.emb_width)).astype(dtype))
               for _ in range(3)]
    for backend in test_util.backends():
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
    for backend in test_util.backends():
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
    # the sparse update skips it (DESIGN §3 vs §4.4), so dense would differ.
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

  def test_overflow_is_reported_and_raised(self):
    ctx, table, opt, rng = make(2, 2, 16, num_unique=4)
    ids = jax.device_put(np.arange(1, 17, dtype=np.int32),
                         pe.token_sharding(ctx))
    result = pe.dedup(ctx, ids)
    self.assertEqual(int(result.num_overflow), 12)
    with self.assertRaisesRegex(
        ValueError, "batch has 16 distinct ids but num_unique=4"):
      pe.raise_if_overflow(result.num_overflow, result.num_distinct, 4)
    _, _, stats = run(ctx, opt, "xla", table,
                      [(np.arange(1, 17, dtype=np.int32),
                        np.ones((16, 4), np.float32))])
    self.assertEqual(int(stats[0].num_overflow), 12)


class DedupTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 8)
  def test_matches_model(self, ranks):
    rng = np.random.default_rng(ranks)
    ctx = pe.make_context(layout(ranks), "x", tokens_per_batch=48,
                          emb_width=ranks, num_unique=20)
    ids = batch(rng, 48).reshape(24, 2)
    result = jax.jit(functools.partial(pe.dedup, ctx, vocab_rows=VOCAB))(
        jax.device_put(ids, pe.token_sharding(ctx)))
    uniq, segs, distinct = numpy_model.dedup(ids, 20, VOCAB)
    np.testing.assert_array_equal(result.unique_tokens, uniq)
    np.testing.assert_array_equal(result.segment_ids, segs)
    self.assertEqual(int(result.num_distinct), distinct)
    self.assertEqual(int(result.num_overflow), max(0, distinct - 20))
    self.assertEqual(result.segment_ids.shape, (24, 2))


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
    with self.assertRaisesRegex(ValueError, message):
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
