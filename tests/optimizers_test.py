"""The sparse optimizer family against numpy models and optax.

Each optimizer trains through `pe.apply_gradients` (dedup, routing,
segment sum, the fused update) on 1-8 ranks, f32 and bf16 tables, on every
test backend, and is compared with its numpy model in tests/numpy_model.py,
written from the published update rule (sources there). `Sgd` and `Adagrad`
are also compared bit for bit with dense `optax.sgd` / `optax.adagrad`. The
collection and the pipelined `Trainer` train one table per optimizer, and
its checkpoint restores on another rank count.
"""

import functools
import re
import tempfile

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import numpy_model
import optim_test
import pallas_emb as pe
from pallas_emb import checkpoint as ckpt

VOCAB = optim_test.VOCAB
BF16 = test_util.BF16
F32 = np.float32

# name -> (optimizer, numpy model factory, element-wise / row-wise fields).
OPTIMIZERS = {
    "sgd": (pe.Sgd(0.1), lambda t: numpy_model.Sgd(t, lr=0.1)),
    "adagrad": (pe.Adagrad(0.2, eps=1e-6, initial_accumulator_value=0.05),
                lambda t: numpy_model.ElementAdagrad(t, 0.2, 1e-6, 0.05)),
    "adam": (pe.Adam(0.05, b1=0.8, b2=0.95, eps=1e-6),
             lambda t: numpy_model.LazyAdam(t, 0.05, 0.8, 0.95, 1e-6)),
    "partial_rowwise_adam": (
        pe.PartialRowwiseAdam(0.05, b1=0.8, b2=0.95, eps=1e-6),
        lambda t: numpy_model.PartialRowwiseAdam(t, 0.05, 0.8, 0.95, 1e-6)),
    "ftrl": (pe.Ftrl(0.3, l1=0.02, l2=0.1, initial_accumulator_value=0.2),
             lambda t: numpy_model.Ftrl(t, 0.3, 0.02, 0.1, -0.5, 0.2)),
    # lr_power other than -1/2 takes the general power (not a sqrt).
    "ftrl_pow": (pe.Ftrl(0.3, l1=0.0, l2=0.05, lr_power=-0.7),
                 lambda t: numpy_model.Ftrl(t, 0.3, 0.0, 0.05, -0.7, 0.1)),
}
STATE_FIELDS = {
    "sgd": (), "adagrad": ("accumulator",), "adam": ("m", "v"),
    "partial_rowwise_adam": ("m", "v"), "ftrl": ("accumulator", "linear"),
    "ftrl_pow": ("accumulator", "linear"),
}
# (ranks, dtype): 1-8 ranks, each dtype on two of them.
LAYOUTS = ((1, F32), (2, BF16), (4, BF16), (8, F32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(3, 4))
def train_step(ctx, opt, backend, table, state, ids, grads, pending):
  result = pe.dedup(ctx, ids, vocab_rows=table.shape[0])
  return pe.apply_gradients(ctx, opt, table, state, grads, result,
                            pending=pending, backend=backend)


def run_steps(ctx, opt, backend, table, batches, pending):
  """Host copies of (table, state, stats) after every step."""
  table = jax.device_put(table, pe.table_sharding(ctx))
  state = opt.init(ctx, table)
  snapshots = []
  for (ids, grads), p in zip(batches, pending):
    table, state, stats = train_step(
        ctx, opt, backend, table, state,
        jax.device_put(ids, pe.token_sharding(ctx)),
        jax.device_put(grads, pe.token_sharding(ctx)), jnp.asarray(p))
    snapshots.append(jax.device_get((table, state, stats)))
  return snapshots


def assert_tree_bits_equal(test, a, b, msg=""):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  test.assertEqual(len(leaves_a), len(leaves_b), msg)
  for x, y in zip(leaves_a, leaves_b):
    test_util.assert_bits_equal(test, x, np.asarray(y), msg)


def model_state(model, field):
  return getattr(model, field)


class ModelTest(parameterized.TestCase):
  """3 applied steps, one NaN-gradient step and one pending=False step."""

  @parameterized.product(name=list(OPTIMIZERS), layout=LAYOUTS)
  def test_matches_model(self, name, layout):
    ranks, dtype = layout
    opt, make_model = OPTIMIZERS[name]
    tokens, shard_width = 16, 3 if ranks in (1, 4) else 2
    ctx = pe.make_context(test_util.mesh({"x": ranks}), "x",
                          tokens_per_batch=tokens,
                          emb_width=ranks * shard_width,
                          num_unique=tokens + 1)
    rng = np.random.default_rng(ranks)
    table = rng.standard_normal((VOCAB, ctx.emb_width)).astype(dtype)
    batches = [(optim_test.batch(rng, tokens),
                rng.standard_normal((tokens, ctx.emb_width)).astype(dtype))
               for _ in range(5)]
    ids, grads = batches[1]
    grads[np.flatnonzero((ids > 0) & (ids < VOCAB))[0], 0] = np.nan
    pending = [True, True, False, True, True]
    # Rows no batch trains: never in a batch, or only as padding id 0 (a
    # superset of the trained rows: the NaN batch counts too).
    trained = {int(i) % VOCAB for (ids, _), p in zip(batches, pending)
               for i in ids if p and i != 0 and -VOCAB <= i < VOCAB}
    untouched = sorted(set(range(VOCAB)) - trained)
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend):
        model = make_model(table)
        norms = [model.step(i, g, ctx.num_unique, pending=p)[0]
                 for (i, g), p in zip(batches, pending)]
        snaps = run_steps(ctx, opt, backend, table, batches, pending)
        out, state, _ = snaps[-1]
        stats = [s for _, _, s in snaps]
        self.assertEqual([int(s.valid) for s in stats], [1, 0, 0, 1, 1])
        self.assertFalse(np.isfinite(stats[1].norm))
        np.testing.assert_allclose([s.norm for s in stats], norms,
                                   rtol=2e-6)
        # A skipped update changes nothing, not even the step counter.
        for skipped in (1, 2):
          assert_tree_bits_equal(self, snaps[skipped][:2], snaps[0][:2],
                                 f"step {skipped} was not a no-op")
        self.assertEqual(int(state.step), 3)
        self.assertEqual(model.step_count, 3)
        self._assert_close(out, state, model, name, dtype)
        self._assert_untouched(out, state, table, untouched, name)

  def _assert_close(self, out, state, model, name, dtype):
    got = np.asarray(out).astype(F32)
    want = model.table.astype(F32)
    # f32 gradient sums in another order (and numpy's pow / exp against
    # XLA's): f32 to rtol 2e-6; a bf16 table to one bf16 rounding.
    if dtype == F32:
      np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    else:
      np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
    for field in STATE_FIELDS[name]:
      np.testing.assert_allclose(np.asarray(getattr(state, field)),
                                 model_state(model, field), rtol=2e-6,
                                 atol=1e-7, err_msg=field)

  def _assert_untouched(self, out, state, table, untouched, name):
    test_util.assert_bits_equal(self, np.asarray(out)[untouched],
                                table[untouched], "untouched rows moved")
    opt = OPTIMIZERS[name][0]
    for slot in opt.slots():
      got = np.asarray(getattr(state, slot.name))[untouched]
      np.testing.assert_array_equal(got, np.full_like(got, slot.init),
                                    err_msg=slot.name)


def unique_batches(rng, ranks, tokens, width, steps):
  """Ids distinct within a batch (none is padding id 0), f32 gradients.

  Distinct ids make every row's summed gradient a single token's gradient
  (0 + g, exact), so the sparse path's f32 segment sums cannot differ from
  the dense gradient by summation order; bits can then be compared.
  """
  del ranks
  out = []
  for _ in range(steps):
    ids = rng.choice(np.arange(1, VOCAB), tokens, replace=False)
    out.append((ids.astype(np.int32),
                rng.standard_normal((tokens, width)).astype(F32)))
  return out


class OptaxTest(parameterized.TestCase):
  """Sgd / Adagrad == optax on the dense gradient, bit for bit (f32)."""

  @parameterized.product(
      case=(("sgd", pe.Sgd(0.1), optax.sgd(0.1)),
            ("adagrad", pe.Adagrad(0.3), optax.adagrad(0.3)),
            ("adagrad_eps", pe.Adagrad(0.1, eps=1e-3,
                                       initial_accumulator_value=0.0),
             optax.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-3))),
      ranks=(1, 4))
  def test_equals_optax(self, case, ranks):
    name, opt, tx = case
    tokens, width = 8, 2 * ranks
    ctx = pe.make_context(test_util.mesh({"x": ranks}), "x",
                          tokens_per_batch=tokens, emb_width=width,
                          num_unique=tokens + 1)
    rng = np.random.default_rng(7)
    table = rng.standard_normal((VOCAB, width)).astype(F32)
    batches = unique_batches(rng, ranks, tokens, width, 3)
    # optax run op by op (not jitted): no product is fused into an FMA.
    dense, dense_state = jnp.asarray(table), tx.init(jnp.asarray(table))
    for ids, grads in batches:
      dense_grad = jnp.zeros_like(dense).at[ids].set(grads)
      updates, dense_state = tx.update(dense_grad, dense_state, dense)
      dense = optax.apply_updates(dense, updates)
    touched = sorted({int(i) for ids, _ in batches for i in ids})
    untouched = sorted(set(range(VOCAB)) - set(touched))
    for backend in test_util.backends_for(self):
      with self.subTest(backend=backend, optimizer=name):
        out, state, _ = run_steps(ctx, opt, backend, table, batches,
                                  [True] * 3)[-1]
        test_util.assert_bits_equal(self, np.asarray(out)[touched],
                                    np.asarray(dense)[touched])
        test_util.assert_bits_equal(self, np.asarray(out)[untouched],
                                    table[untouched])
        if name.startswith("adagrad"):
          sum_sq = dense_state[0].sum_of_squares
          test_util.assert_bits_equal(self, state.accumulator,
                                      np.asarray(sum_sq))


class TrainerTest(parameterized.TestCase):
  """Each optimizer trains one table of a collection in the pipelined Trainer."""

  @parameterized.product(backend=test_util.backends())
  def test_every_optimizer_trains_in_the_pipelined_trainer(self, backend):
    ranks, width, tokens, steps = 4, 8, 32, 8
    mesh = test_util.mesh({"x": ranks})
    names = [n for n in OPTIMIZERS if n != "ftrl_pow"] + ["rowwise_adagrad"]
    opts = {n: OPTIMIZERS[n][0] for n in names[:-1]}
    opts["rowwise_adagrad"] = pe.RowwiseAdagrad(0.1)
    tables = [pe.TableSpec(n, 23, width, optimizer=opts[n],
                           dtype=jnp.bfloat16 if i % 2 else jnp.float32)
              for i, n in enumerate(names)]
    features = [pe.FeatureSpec(f"f_{n}", n) for n in names]
    coll = pe.EmbeddingCollection(tables, features, mesh, "x",
                                  backend=backend)
    self.assertLen(coll.plan.stacks, len(names))
    rng = np.random.default_rng(3)
    target = rng.standard_normal(16).astype(F32)

    def make_batch():
      # Ids 1..15 of 23 rows: rows 16..22 are never looked up. The target
      # depends on the ids, so the tables can learn it.
      ids = {f"f_{n}": rng.integers(1, 16, tokens).astype(np.int32)
             for n in names}
      y = sum(target[i] for i in ids.values()) / len(names)
      return jax.device_put({**ids, "y": y}, coll.token_sharding())

    batches = [make_batch() for _ in range(steps)]

    def loss_fn(params, embeddings, batch):
      x = sum(e.astype(jnp.float32) for e in embeddings.values())
      pred = (x @ params["w"])[:, 0]
      return jnp.mean((pred - batch["y"]) ** 2), ()

    trainer = pe.Trainer(coll, loss_fn, optax.sgd(0.05), pipelined=True)
    start = test_util.random_state(coll, 0)
    before = {k: np.asarray(v) for k, v in
              coll.table_arrays(start).items()}
    state = trainer.init(start, {"w": jnp.full((width, 1), 0.1, jnp.float32)},
                         batches[0])
    step = jax.jit(trainer.step, donate_argnums=0)
    losses = []
    for i, batch in enumerate(batches):
      state, metrics = step(state, batch, batches[min(i + 1, steps - 1)])
      losses.append(float(metrics.loss))
      valid = [int(s.valid) for s in metrics.updates.values()]
      self.assertEqual(valid, [0 if i == 0 else 1] * len(names))
    state, _ = jax.jit(trainer.flush, donate_argnums=0)(state)
    self.assertLess(np.mean(losses[-3:]), 0.8 * np.mean(losses[:3]), losses)
    after = coll.table_arrays(state.embedding)
    for name, opt_state in coll.optimizer_arrays(state.embedding).items():
      # The first (pending=False) update did not count; flush applied one.
      self.assertEqual(int(opt_state.step), steps, name)
      moved = np.asarray(after[name])
      self.assertFalse(np.array_equal(moved[1:16], before[name][1:16]),
                       name)
      test_util.assert_bits_equal(self, moved[16:], before[name][16:],
                                  f"{name}: rows never looked up moved")
      for leaf in jax.tree.leaves(opt_state):
        self.assertTrue(np.isfinite(np.asarray(leaf)).all(), name)
    # Per-table state round-trips through logical tables (checkpoints).
    again = coll.state_from_arrays(coll.table_arrays(state.embedding),
                                   coll.optimizer_arrays(state.embedding))
    assert_tree_bits_equal(self, again, jax.device_get(state.embedding))
    for stack in coll.plan.stacks:
      opt_state = again.stacks[stack.name].opt_state
      for slot in stack.optimizer.slots():
        array = getattr(opt_state, slot.name)
        want = (coll.table_sharding() if slot.kind == "element"
                else NamedSharding(mesh, P()))
        self.assertTrue(array.sharding.is_equivalent_to(want, array.ndim),
                        f"{stack.name} {slot.name}: {array.sharding}")
    if backend == test_util.backends()[0]:
      self._check_checkpoint_on_fewer_ranks(coll, state.embedding)

  def _check_checkpoint_on_fewer_ranks(self, coll, state):
    """Saved on 4 ranks, restored bit for bit on 2 (element-wise state is
    column-sharded, so its shards change)."""
    fewer = pe.EmbeddingCollection(
        list(coll.tables.values()), list(coll.features.values()),
        test_util.mesh({"x": 2}), "x")
    with tempfile.TemporaryDirectory() as tmp:
      ckpt.save_collection(tmp, coll, state, step=1)
      restored, _ = ckpt.restore_collection(tmp, fewer)
    assert_tree_bits_equal(self, fewer.optimizer_arrays(restored),
                           jax.device_get(coll.optimizer_arrays(state)))
    assert_tree_bits_equal(self, fewer.table_arrays(restored),
                           jax.device_get(coll.table_arrays(state)))


class HyperParameterTest(parameterized.TestCase):

  @parameterized.parameters(
      (pe.Sgd, dict(learning_rate=float("inf")), "Sgd learning_rate=inf"),
      (pe.Adagrad, dict(learning_rate=0.1, eps=-1.0), "eps=-1.0 must be"),
      (pe.Adagrad, dict(learning_rate=0.1, initial_accumulator_value=-0.1),
       "initial_accumulator_value=-0.1"),
      (pe.Adam, dict(learning_rate=0.1, b1=1.0), r"b1=1.0 must be finite "
       r"and >= 0 and < 1"),
      (pe.Adam, dict(learning_rate=0.1, b2=-0.1), "b2=-0.1"),
      (pe.Adam, dict(learning_rate=0.1, eps=0.0), "eps=0.0 must be finite "
       "and > 0"),
      (pe.PartialRowwiseAdam, dict(learning_rate=0.1, b2=float("nan")),
       "PartialRowwiseAdam b2=nan"),
      (pe.Ftrl, dict(learning_rate=0.0), "learning_rate=0.0 must be a "
       "finite number > 0"),
      (pe.Ftrl, dict(learning_rate=0.1, l1=-1.0), "l1=-1.0"),
      (pe.Ftrl, dict(learning_rate=0.1, l2=float("inf")), "l2=inf"),
      (pe.Ftrl, dict(learning_rate=0.1, lr_power=0.5), "lr_power=0.5 must "
       "be finite and <= 0"),
      (pe.Ftrl, dict(learning_rate=0.1, initial_accumulator_value=0.0),
       "would divide 0 by 0"),
  )
  def test_bad(self, cls, kw, message):
    with self.assertRaisesRegex(pe.HyperParameterError, message):
      cls(**kw)

  def test_schedules_and_hashing(self):
    schedule = optax.linear_schedule(0.1, 0.0, 10)
    for cls in (pe.Sgd, pe.Adagrad, pe.Adam, pe.PartialRowwiseAdam,
                pe.Ftrl):
      opt = cls(schedule)
      self.assertAlmostEqual(float(opt.learning_rate_at(jnp.int32(5))), 0.05)
      self.assertEqual(hash(opt), hash(cls(schedule)))
      self.assertEqual(opt, cls(schedule))
    self.assertNotEqual(pe.Adam(0.1), pe.PartialRowwiseAdam(0.1))

  def test_state_checks(self):
    ctx = pe.make_context(test_util.mesh({"x": 2}), "x", tokens_per_batch=4,
                          emb_width=4, num_unique=5)
    table = jax.device_put(jnp.zeros((VOCAB, 4)), pe.table_sharding(ctx))
    ids = jax.device_put(jnp.arange(4, dtype=jnp.int32),
                         pe.token_sharding(ctx))
    dd = pe.dedup(ctx, ids, vocab_rows=VOCAB)
    grads = jnp.zeros((4, 4))
    adam = pe.Adam(0.1)
    with self.assertRaisesRegex(pe.InputError, "expected the AdamState"):
      pe.apply_gradients(ctx, adam, table, pe.Sgd(0.1).init(ctx, table),
                         grads, dd)
    other = adam.init(ctx, jnp.zeros((VOCAB + 1, 4)))
    with self.assertRaisesRegex(pe.InputError, r"opt_state.m has shape "
                                r"\(30, 4\); expected \(29, 4\)"):
      pe.apply_gradients(ctx, adam, table, other, grads, dd)
    with self.assertRaisesRegex(pe.InputError, "needs emb_width="):
      adam.init_state(VOCAB, pe.replicated_sharding(ctx),
                      pe.table_sharding(ctx))



class LearningRateRuleTest(parameterized.TestCase):
  """One rule for every optimizer's float learning rate: finite and > 0 as
  the float32 the update computes in."""

  @parameterized.product(
      cls=(pe.Sgd, pe.Adagrad, pe.Adam, pe.PartialRowwiseAdam, pe.Ftrl,
           pe.RowwiseAdagrad),
      lr=(-0.1, 0.0, 1e-50, 1e39, float("nan"), float("-inf")))
  def test_bad_learning_rate(self, cls, lr):
    with self.assertRaisesRegex(pe.HyperParameterError, "^" + re.escape(
        f"pallas_emb {cls.__name__} learning_rate={lr!r} must be a finite "
        "number > 0 (in float32) or a schedule")):
      cls(lr)

  @parameterized.parameters(
      # 1 - 1e-9 is < 1, but 1.0 in float32: 1 - b1**t would be 0.
      (pe.Adam, dict(b1=1 - 1e-9), "b1=0.999999999 must be finite and >= 0 "
       "and < 1 in float32"),
      (pe.PartialRowwiseAdam, dict(b2=1 - 1e-9), "b2=0.999999999"),
      # 0 in float32: an element whose moments are 0 would divide 0 by 0.
      (pe.Adam, dict(eps=1e-50), "eps=1e-50 must be finite and > 0 in "
       "float32"),
      (pe.RowwiseAdagrad, dict(eps=1e-50), "eps=1e-50 must be finite and > "
       "0"),
      (pe.Adagrad, dict(eps=1e39), "eps=1e+39 must be finite"),
      (pe.Ftrl, dict(initial_accumulator_value=1e-50), "would divide 0 by 0"),
      (pe.Ftrl, dict(l2=1e39), "l2=1e+39 must be finite"),
  )
  def test_bad_in_float32(self, cls, kw, message):
    with self.assertRaisesRegex(pe.HyperParameterError, re.escape(message)):
      cls(0.1, **kw)

  @parameterized.parameters("False", 0, None)
  def test_lazy_must_be_a_bool(self, lazy):
    with self.assertRaisesRegex(pe.HyperParameterError, re.escape(
        f"pallas_emb RowwiseAdagrad lazy={lazy!r} must be True or False.")):
      pe.RowwiseAdagrad(0.1, half_life_steps=2.0, lazy=lazy)


# Every optimizer with a schedule that returns `bad` from step 1 on.
def _scheduled(bad):
  schedule = lambda step: jnp.where(step >= 1, jnp.float32(bad), 0.1)
  return {
      "sgd": pe.Sgd(schedule),
      "adagrad": pe.Adagrad(schedule),
      "adam": pe.Adam(schedule),
      "partial_rowwise_adam": pe.PartialRowwiseAdam(schedule),
      "ftrl": pe.Ftrl(schedule, l1=0.01, l2=0.1),
      "rowwise_adagrad": pe.RowwiseAdagrad(schedule),
      "rowwise_adagrad_lazy": pe.RowwiseAdagrad(schedule, half_life_steps=2.0,
                                                lazy=True),
  }


class ScalarGuardTest(parameterized.TestCase):
  """A step whose per-step scalars are not valid (a schedule's NaN or inf,
  Ftrl's learning rate 0) is skipped like a non-finite gradient norm:
  nothing changes, not even the step counter."""

  CASES = [(name, bad) for bad in (float("nan"), float("inf"))
           for name in _scheduled(0.0)] + [("ftrl", 0.0)]

  def _two_steps(self, name, bad, backend=None):
    ctx = pe.make_context(test_util.mesh({"x": 2}), "x", tokens_per_batch=4,
                          emb_width=4, num_unique=5)
    opt = _scheduled(bad)[name]
    table = jax.device_put(
        jnp.asarray(np.random.default_rng(0).normal(size=(VOCAB, 4)), F32),
        pe.table_sharding(ctx))
    ids = jax.device_put(jnp.array([1, 2, 2, 5], jnp.int32),
                         pe.token_sharding(ctx))
    dd = pe.dedup(ctx, ids, vocab_rows=VOCAB)
    grads = jnp.asarray(np.random.default_rng(1).normal(size=(4, 4)), F32)
    state0 = opt.init(ctx, table)
    # Step 0: a finite learning rate trains the rows.
    table1, state1, stats1 = pe.apply_gradients(ctx, opt, table, state0,
                                                grads, dd, backend=backend)
    # Step 1: the schedule's bad value.
    table2, state2, stats2 = pe.apply_gradients(ctx, opt, table1, state1,
                                                grads, dd, backend=backend)
    return (table, state0, stats1), (table1, state1), (table2, state2,
                                                      stats2)

  @parameterized.parameters(*CASES)
  def test_nothing_changes(self, name, bad):
    self._check_nothing_changes(name, bad)

  @parameterized.product(
      case=(("adam", float("nan")), ("rowwise_adagrad_lazy", float("inf")),
            ("ftrl", 0.0)),
      backend=test_util.backends())
  def test_every_backend(self, case, backend):
    self._check_nothing_changes(*case, backend=backend)

  def _check_nothing_changes(self, name, bad, backend=None):
    (table, _, stats1), (table1, state1), (table2, state2, _) = (
        self._two_steps(name, bad, backend))
    self.assertEqual(int(stats1.valid), 1)
    self.assertEqual(int(state1.step), 1)
    self.assertFalse(np.array_equal(np.asarray(table1), np.asarray(table)))
    self.assertEqual(int(state2.step), 1)
    assert_tree_bits_equal(self, jax.device_get(table2),
                           jax.device_get(table1))
    assert_tree_bits_equal(self, jax.device_get(state2),
                           jax.device_get(state1))

  @parameterized.parameters(*CASES)
  def test_stats_report_the_skip(self, name, bad):
    *_, (_, _, stats2) = self._two_steps(name, bad)
    self.assertEqual(int(stats2.valid), 0)

  def test_scalars_are_valid(self):
    opt = _scheduled(float("nan"))["adam"]
    self.assertTrue(bool(opt.scalars_are_valid(jnp.int32(0))))
    self.assertFalse(bool(opt.scalars_are_valid(jnp.int32(1))))
    ftrl = _scheduled(0.0)["ftrl"]
    self.assertFalse(bool(ftrl.scalars_are_valid(jnp.int32(1))))
    self.assertTrue(bool(_scheduled(0.0)["sgd"].scalars_are_valid(
        jnp.int32(1))))  # lr 0 is a valid (if idle) step for SGD


if __name__ == "__main__":
  absltest.main()
