"""EmbeddingCollection against a numpy model of a whole collection.

The model knows nothing of stacks, offsets or ranks: every feature looks its
ids up in its own logical table (wrap once, clamp), and an update step is,
per table, row-wise Adagrad on the summed gradients of all the
features that read the table (numpy_model.Adagrad on their concatenated ids
and gradients).
"""

import contextlib
import functools
import re

import test_util

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import numpy_model
import pallas_emb as pe
from pallas_emb import validation
from pallas_emb.dedup import MAP_SENTINEL

OPT_KWS = [
    dict(learning_rate=0.1),
    dict(learning_rate=0.05, half_life_steps=2.0,
         initial_accumulator_value=0.1),
    dict(learning_rate=0.2, half_life_steps=1.5, weight_decay=0.1, lazy=True,
         eps=1e-3),
]


def model_lookup(table, ids):
  rows = np.where(ids < 0, ids + table.shape[0], ids)
  return table[np.clip(rows, 0, table.shape[0] - 1)]


def edge_ids(rng, shape, vocab):
  """Zipf-ish ids with 0, -1, -vocab, past the end and int32 extremes."""
  ids = (np.minimum(rng.zipf(1.3, int(np.prod(shape))), vocab + 3) - 1)
  ids = ids * rng.choice([-1, 1], ids.size)
  edges = [0, -1, vocab - 1, vocab, -vocab, -vocab - 1, 2**31 - 1, -2**31]
  k = min(len(edges), ids.size // 3)
  ids[rng.choice(ids.size, k, replace=False)] = edges[:k]
  return ids.reshape(shape).astype(np.int32)


def random_collection(seed, backend, dedup="sort"):
  """1-5 tables (widths 8-128 over 1-8 ranks, f32/bf16, shared optimizers so
  that some tables stack), 1-3 features per table, sequence shapes."""
  rng = np.random.default_rng(seed)
  ranks = int(rng.choice([1, 2, 4, 8]))
  mesh = test_util.mesh({"x": ranks})
  opts = [pe.RowwiseAdagrad(**kw) for kw in OPT_KWS]
  widths = [w for w in (8, 16, 32, 64, 128) if w % ranks == 0]
  tables, features = [], []
  for t in range(int(rng.integers(1, 6))):
    opt_i = int(rng.integers(len(opts)))
    table = pe.TableSpec(
        f"t{t}", int(rng.integers(5, 60)),
        int(rng.choice(widths[:2])) if rng.random() < 0.7
        else int(rng.choice(widths)),
        optimizer=opts[opt_i],
        dtype=[jnp.float32, jnp.bfloat16][int(rng.integers(2))],
        padding_id=[None, 0, 3][int(rng.integers(3))])
    tables.append((table, opt_i))
    for f in range(int(rng.integers(1, 4))):
      features.append(pe.FeatureSpec(f"t{t}_f{f}", f"t{t}"))
  batch_size = ranks * int(rng.integers(1, 4))
  shapes = {f.name: (batch_size,) if rng.random() < 0.5
            else (batch_size, int(rng.integers(1, 4))) for f in features}
  coll = pe.EmbeddingCollection([t for t, _ in tables], features, mesh, "x",
                                backend=backend, dedup=dedup)
  config = dict(seed=seed, ranks=ranks, backend=backend, dedup=dedup,
                tables=[(t.name, t.vocab_rows, t.emb_width, t.dtype.name,
                         OPT_KWS[i], t.padding_id) for t, i in tables],
                shapes=shapes, plan=str(coll.plan))
  return coll, {t.name: i for t, i in tables}, shapes, rng, config


class CollectionModel:
  """Per logical table numpy Adagrad, fed by every feature of the table."""

  def __init__(self, coll, arrays, opt_index):
    self.coll = coll
    self.models = {
        name: numpy_model.Adagrad(
            np.asarray(arrays[name]),
            **_model_kw(OPT_KWS[opt_index[name]]))
        for name in arrays}

  def step(self, batch, grads):
    for name, model in self.models.items():
      feats = [f.name for f in self.coll.features.values() if f.table == name]
      ids = np.concatenate([batch[f].reshape(-1) for f in feats])
      g = np.concatenate([np.asarray(grads[f], np.float32).reshape(
          -1, model.table.shape[1]) for f in feats])
      model.step(ids, g, ids.size + 1,
                 padding_id=self.coll.tables[name].padding_id)


def _model_kw(kw):
  names = dict(learning_rate="lr", eps="eps", initial_accumulator_value=
               "init_acc", half_life_steps="half_life",
               weight_decay="weight_decay", lazy="lazy")
  return {names[k]: v for k, v in kw.items()}


def assert_tables_close(test, got, model, msg):
  got = test_util.as_numpy(got).astype(np.float32)
  want = model.table.astype(np.float32)
  if model.dtype == np.float32:
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6, err_msg=msg)
  else:  # f32 sums in another order: at most one bf16 rounding apart
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6, err_msg=msg)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _train_step(coll, state, batch, grads):
  return coll.apply_gradients(state, batch, grads)


class CollectionModelTest(parameterized.TestCase):

  @parameterized.parameters(*range(15))
  def test_random_collections(self, i):
    """Lookups and three update steps of a random collection vs the model.

    One test per collection, so that pytest-xdist spreads them. Cases 12-14
    dedup through slot maps (xla backend), and train bit for bit as the
    same collection with the sort; cases 13-14 (both collections) update
    their unique buffers in chunks of 3 slots.
    """
    backends = test_util.backends()
    slot_map = i >= 12
    coll, opt_index, shapes, rng, config = random_collection(
        100 + i, "xla" if slot_map else backends[i % len(backends)],
        "slot_map" if slot_map else "sort")
    logging.info("random collection %s", config)
    try:
      with (test_util.update_in_chunks(3) if i >= 13
            else contextlib.nullcontext()):
        self._check(coll, opt_index, shapes, rng, slot_map)
    except AssertionError as e:
      raise AssertionError(f"random collection {config} failed: {e}") from e

  def _check(self, coll, opt_index, shapes, rng, against_sort=False):
    state = test_util.random_state(coll, 0)
    if against_sort:
      sort = pe.EmbeddingCollection(
          coll.tables.values(), coll.features.values(), coll.mesh, "x",
          backend=coll.backend)
      sort_state = test_util.random_state(sort, 0)
    arrays = {k: test_util.as_numpy(v)
              for k, v in coll.table_arrays(state).items()}
    model = CollectionModel(coll, arrays, opt_index)
    lookup = jax.jit(coll.lookup)
    for _ in range(3):
      batch = {f.name: edge_ids(rng, shapes[f.name],
                                coll.tables[f.table].vocab_rows)
               for f in coll.features.values()}
      emb = lookup(state, batch)
      # Bit-exact against the current tables (which follow the model only to
      # f32 summation order once they have been updated).
      current = {k: test_util.as_numpy(v)
                 for k, v in coll.table_arrays(state).items()}
      want = {f.name: model_lookup(current[f.table], batch[f.name])
              for f in coll.features.values()}
      for name, got in emb.items():
        test_util.assert_bits_equal(self, got, want[name], name)
        self.assertTrue(got.sharding.is_equivalent_to(coll.token_sharding(),
                                                      got.ndim))
      grads = {name: rng.standard_normal(e.shape).astype(e.dtype)
               for name, e in emb.items()}
      model.step(batch, grads)
      state, stats = _train_step(coll, state, batch, grads)
      for stack_stats in stats.values():
        self.assertEqual(int(stack_stats.valid), 1)
        self.assertEqual(int(stack_stats.num_overflow), 0)
      if against_sort:
        sort_state, _ = _train_step(sort, sort_state, batch, grads)
        for got, want in ((coll.table_arrays(state),
                           sort.table_arrays(sort_state)),
                          (coll.optimizer_arrays(state),
                           sort.optimizer_arrays(sort_state))):
          jax.tree.map(lambda a, b: test_util.assert_bits_equal(
              self, a, test_util.as_numpy(b)), got, want)
        for s in coll.plan.stacks:  # every map is back at the sentinel
          np.testing.assert_array_equal(state.stacks[s.name].slot_map,
                                        MAP_SENTINEL)
    for name, table in coll.table_arrays(state).items():
      assert_tables_close(self, table, model.models[name], name)
    for name, opt_state in coll.optimizer_arrays(state).items():
      np.testing.assert_allclose(
          test_util.as_numpy(opt_state.row_state),
          model.models[name].row_state, rtol=2e-6, atol=1e-12,
          err_msg=name)


class StackingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = test_util.mesh({"x": 4})
    opt = pe.RowwiseAdagrad(0.1)
    self.tables = [
        pe.TableSpec("items", 50, 16, optimizer=opt),
        pe.TableSpec("users", 30, 16, optimizer=opt),
        pe.TableSpec("genre", 7, 8, optimizer=opt),
        pe.TableSpec("city", 9, 16, optimizer=pe.RowwiseAdagrad(0.2)),
    ]
    self.features = [
        pe.FeatureSpec("item", "items"), pe.FeatureSpec("history", "items"),
        pe.FeatureSpec("user", "users"), pe.FeatureSpec("genre", "genre"),
        pe.FeatureSpec("city", "city")]

  def test_plan(self):
    coll = pe.EmbeddingCollection(self.tables, self.features, self.mesh, "x")
    stacks = coll.plan.stacks
    self.assertEqual([s.tables for s in stacks],
                     [("items", "users"), ("genre",), ("city",)])
    self.assertEqual(stacks[0].row_offsets, (0, 50))
    self.assertEqual(stacks[0].features, ("item", "history", "user"))
    self.assertEqual(
        str(coll.plan).splitlines()[:3],
        ["stack0: [80, 16] float32, RowwiseAdagrad, features ['item', "
         "'history', 'user']",
         "  items: rows [0, 50)", "  users: rows [50, 80)"])

  def test_ids_stay_in_their_table(self):
    # -1 is the last row of `items`, never a row of `users`; past-the-end
    # ids clamp to their own table's last row.
    coll = pe.EmbeddingCollection(self.tables, self.features, self.mesh, "x")
    state = test_util.random_state(coll, 1)
    arrays = coll.table_arrays(state)
    batch = {"item": np.array([-1, 50, 49, -50], np.int32),
             "history": np.array([[0, 1]] * 4, np.int32),
             "user": np.array([-1, 30, 10**6, -(2**31)], np.int32),
             "genre": np.zeros(4, np.int32), "city": np.zeros(4, np.int32)}
    emb = coll.lookup(state, batch)
    for name, table in (("item", "items"), ("user", "users")):
      test_util.assert_bits_equal(
          self, emb[name], model_lookup(test_util.as_numpy(arrays[table]),
                                        batch[name]))

  def test_state_round_trips_through_logical_tables(self):
    coll = pe.EmbeddingCollection(self.tables, self.features, self.mesh, "x")
    state = coll.init(jax.random.key(2))
    again = coll.state_from_arrays(coll.table_arrays(state),
                                   coll.optimizer_arrays(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
      test_util.assert_bits_equal(self, a, test_util.as_numpy(b))
    for name, array in coll.table_arrays(state).items():
      self.assertEqual(array.shape, (coll.tables[name].vocab_rows,
                                     coll.tables[name].emb_width))
      self.assertTrue(array.sharding.is_equivalent_to(coll.table_sharding(),
                                                      2))

  def test_init_does_not_depend_on_stacking(self):
    a = pe.EmbeddingCollection(self.tables, self.features, self.mesh, "x")
    alone = [pe.TableSpec("users", 30, 16,
                          optimizer=pe.RowwiseAdagrad(0.3))]
    b = pe.EmbeddingCollection(alone, [pe.FeatureSpec("user", "users")],
                               self.mesh, "x")
    test_util.assert_bits_equal(
        self, a.table_arrays(a.init(jax.random.key(3)))["users"],
        test_util.as_numpy(b.table_arrays(b.init(jax.random.key(3)))["users"]))

  def test_max_unique_overflow(self):
    tables = [pe.TableSpec("t", 100, 8, optimizer=pe.RowwiseAdagrad(0.1),
                           max_unique=3)]
    coll = pe.EmbeddingCollection(tables, [pe.FeatureSpec("f", "t")],
                                  self.mesh, "x")
    state = test_util.random_state(coll, 0)
    batch = {"f": np.arange(1, 9, dtype=np.int32)}
    grads = {"f": np.ones((8, 8), np.float32)}
    _, stats = coll.apply_gradients(state, batch, grads)
    self.assertEqual(int(stats["stack0"].num_overflow), 5)
    with self.assertRaisesRegex(pe.UniqueOverflowError,
                                r"stack0: tables \['t'\] had 5 more "
                                "distinct ids"):
      coll.raise_if_overflow(stats)
    _, stats = coll.apply_gradients(state, {"f": np.ones(8, np.int32)}, grads)
    coll.raise_if_overflow(stats)

  def test_overflow_names_every_stack(self):
    """Two stacks over their caps in one step (a column table's max_unique,
    a row table's max_ids_per_partition): both are named."""
    tables = [pe.TableSpec("a", 100, 8, optimizer=pe.Sgd(0.1), max_unique=2),
              pe.TableSpec("b", 100, 4, optimizer=pe.Sgd(0.1)),
              pe.TableSpec("c", 100, 8, optimizer=pe.Sgd(0.1),
                           placement="row", max_ids_per_partition=1)]
    coll = pe.EmbeddingCollection(
        tables, [pe.FeatureSpec(t.name, t.name) for t in tables], self.mesh,
        "x", backend="xla")
    batch = {name: np.arange(1, 9, dtype=np.int32) for name in "ab"}
    batch["c"] = np.int32([1, 5, 2, 6, 3, 7, 4, 8])  # a rank's 2 ids: 1 owner
    grads = {name: np.ones((8, t.emb_width), np.float32)
             for name, t in zip("abc", tables)}
    _, stats = coll.apply_gradients(test_util.random_state(coll, 0), batch,
                                    grads)
    self.assertEqual([int(s.num_overflow) for s in stats.values()],
                     [6, 0, 4])
    with self.assertRaisesRegex(
        pe.UniqueOverflowError,
        r"pallas_emb stack0: tables \['a'\] had 6 more distinct ids .* "
        r"max_unique .*\. stack2: tables \['c'\] had 4 more distinct ids "
        r".*max_ids_per_partition"):
      coll.raise_if_overflow(stats)

  def test_non_finite_gradient_skips_the_stack(self):
    coll = pe.EmbeddingCollection(self.tables, self.features, self.mesh, "x")
    state = test_util.random_state(coll, 4)
    before = jax.tree.map(test_util.as_numpy, state)
    batch = {"item": np.arange(4, dtype=np.int32),
             "history": np.ones((4, 3), np.int32),
             "user": np.arange(4, dtype=np.int32),
             "genre": np.arange(4, dtype=np.int32),
             "city": np.arange(4, dtype=np.int32)}
    grads = {k: np.ones(np.shape(v) + (coll.tables[
        coll.features[k].table].emb_width,), np.float32)
             for k, v in batch.items()}
    grads["user"][2, 3] = np.nan
    state, stats = coll.apply_gradients(state, batch, grads)
    self.assertEqual([int(s.valid) for s in stats.values()], [0, 1, 1])
    test_util.assert_bits_equal(self, state.stacks["stack0"].table,
                                before.stacks["stack0"].table)
    state, stats = coll.apply_gradients(state, batch, grads, pending=False)
    self.assertEqual([int(s.valid) for s in stats.values()], [0, 0, 0])


def model_distinct_rows(coll, batch, weights=None):
  """Per table: distinct rows its features' ids train (numpy model)."""
  weights = weights or {}
  rows = {name: [] for name in coll.tables}
  for f in coll.features.values():
    table = coll.tables[f.table]
    r, keep, _ = numpy_model.resolve(np.asarray(batch[f.name]).reshape(-1),
                                     table.vocab_rows, table.padding_id)
    if f.name in weights:
      keep &= np.asarray(weights[f.name]).reshape(-1) != 0
    rows[f.table].append(r[keep])
  return {name: int(np.unique(np.concatenate(r)).size)
          for name, r in rows.items()}


class FitMaxUniqueTest(absltest.TestCase):
  """Unique buffers sized from a sample of the stream."""

  def setUp(self):
    super().setUp()
    self.mesh = test_util.mesh({"r": 2, "x": 4})
    self.tables = [
        pe.TableSpec("a", 1000, 16, optimizer=pe.RowwiseAdagrad(0.1),
                     padding_id=0),
        pe.TableSpec("b", 50, 16, optimizer=pe.RowwiseAdagrad(0.1))]
    self.features = [pe.FeatureSpec("s", "a"),
                     pe.FeatureSpec("p", "a", combiner="mean"),
                     pe.FeatureSpec("q", "b", combiner="sum")]
    self.coll = pe.EmbeddingCollection(
        self.tables, self.features, self.mesh, "x", replica_axis="r",
        backend="xla")
    self.rng = np.random.default_rng(7)

  def batch(self, high=40):
    lengths = self.rng.integers(0, 5, 16).astype(np.int32)
    return {"s": edge_ids(self.rng, (16, 3), 1000) % high,
            "p": self.rng.integers(0, high, (16, 5)).astype(np.int32),
            "q": pe.Bag(self.rng.integers(0, 50, (16, 4)).astype(np.int32),
                        lengths=lengths)}

  def model_counts(self, batch):
    """`model_distinct_rows` of `self.batch()`: "q" is a Bag with lengths."""
    bag = batch["q"]
    mask = np.arange(bag.ids.shape[1]) < bag.lengths[:, None]
    return model_distinct_rows(self.coll, dict(batch, q=bag.ids),
                               {"q": mask})

  def test_distinct_rows_counts_what_trains(self):
    for seed in range(3):
      coll, _, shapes, rng, config = random_collection(200 + seed, "xla")
      batch = {f.name: edge_ids(rng, shapes[f.name],
                                coll.tables[f.table].vocab_rows)
               for f in coll.features.values()}
      self.assertEqual(coll.distinct_rows(batch),
                       model_distinct_rows(coll, batch), config)
    batch = self.batch()
    self.assertEqual(self.coll.distinct_rows(batch), self.model_counts(batch))

  def test_fit_collection_trains_bit_identically(self):
    batches = [self.batch() for _ in range(4)]
    fit = self.coll.fit_max_unique(batches[:2], headroom=1.5)
    most = [max(self.model_counts(b)[name] for b in batches[:2])
            for name in ("a", "b")]
    self.assertEqual(
        [fit.tables[n].max_unique for n in ("a", "b")],
        [8 * int(np.ceil(1.5 * m / 8)) for m in most])
    shapes = lambda c: [k.ctx.num_unique for k in c.layouts(batches[0])]
    self.assertLess(shapes(fit)[0], shapes(self.coll)[0])

    def train(coll, state):
      step = jax.jit(lambda st, b: coll.apply_gradients(
          st, *_grads_of_sin(coll, st, b)))
      for b in batches:
        state, stats = step(state, b)
        coll.raise_if_overflow(stats)
      return state

    want = train(self.coll, test_util.random_state(self.coll, 0))
    got = train(fit, test_util.random_state(self.coll, 0))  # same plan, state
    for name in want.stacks:
      test_util.assert_bits_equal(self, got.stacks[name].table,
                                  test_util.as_numpy(want.stacks[name].table))
      test_util.assert_bits_equal(
          self, got.stacks[name].opt_state.row_state,
          test_util.as_numpy(want.stacks[name].opt_state.row_state))

  def test_a_batch_over_the_fit_says_so(self):
    fit = self.coll.fit_max_unique([self.batch(high=5)], headroom=1.0)
    state = test_util.random_state(fit, 0)
    big = self.batch(high=1000)
    _, stats = fit.apply_gradients(state, *_grads_of_sin(fit, state, big))
    with self.assertRaisesRegex(pe.UniqueOverflowError,
                                "more distinct ids in one batch"):
      fit.raise_if_overflow(stats)

  def test_bad_arguments(self):
    for kwargs, message in (
        (dict(batches=[], headroom=1.25), "got no batches"),
        (dict(batches=[self.batch()], headroom=0.5),
         r"headroom=0.5; expected a finite number >= 1"),
        (dict(batches=[self.batch()], headroom=True),
         r"headroom=True; expected a finite number >= 1")):
      with self.assertRaisesRegex(pe.InputError, message):
        self.coll.fit_max_unique(**kwargs)


class UnitWeightsTest(absltest.TestCase):
  """Bags whose training entries all weigh 1 skip the weight product."""

  def test_implicit_weights_train_like_the_same_explicit_weights(self):
    mesh = test_util.mesh({"x": 4})
    tables = [pe.TableSpec("t", 40, 16, optimizer=pe.RowwiseAdagrad(0.2),
                           padding_id=0)]
    features = [pe.FeatureSpec("s", "t", combiner="sum"),
                pe.FeatureSpec("m", "t", combiner="mean"),
                pe.FeatureSpec("one", "t", combiner="sqrtn")]
    rng = np.random.default_rng(3)
    ids = {"s": rng.integers(-40, 45, (8, 3)).astype(np.int32),
           "m": rng.integers(0, 40, (8, 2)).astype(np.int32),
           "one": rng.integers(0, 40, (8, 1)).astype(np.int32)}
    lengths = {k: rng.integers(0, v.shape[1] + 1, 8).astype(np.int32)
               for k, v in ids.items()}
    masks = {k: (np.arange(v.shape[1]) < lengths[k][:, None]).astype(
        np.float32) for k, v in ids.items()}
    implicit = {k: pe.Bag(v, lengths=lengths[k]) for k, v in ids.items()}
    explicit = {k: pe.Bag(v, weights=masks[k]) for k, v in ids.items()}
    for backend in test_util.backends():
      with self.subTest(backend=backend):
        coll = pe.EmbeddingCollection(tables, features, mesh, "x",
                                      backend=backend)
        states = []
        for batch in (implicit, explicit):
          state = test_util.random_state(coll, 0)
          for _ in range(2):
            routing, grads = _grads_of_sin(coll, state, batch)
            state, _ = coll.apply_gradients(state, routing, grads)
          layouts = coll.layouts(routing)
          states.append((state, routing.implicit_weights,
                         [f.name for f in layouts[0].pooled
                          if f.unit_weights]))
        self.assertEqual(states[0][1], ("s", "m", "one"))
        # A mean of more than one id weighs 1 / count: not a unit bag.
        self.assertEqual(states[0][2], ["s", "one"])
        self.assertEqual(states[1][1:], ((), []))
        test_util.assert_bits_equal(
            self, states[0][0].stacks["stack0"].table,
            test_util.as_numpy(states[1][0].stacks["stack0"].table))


def _grads_of_sin(coll, state, batch):
  """`(routing, gradients)` of `sum(sin(embeddings))` for one batch."""
  emb, routing = coll.lookup_and_route(state, batch)
  return routing, jax.grad(
      lambda e: sum(jnp.sum(jnp.sin(v)) for v in e.values()))(emb)


class EagerCallTest(absltest.TestCase):
  """Calls outside jit run compiled, and compile once per batch layout."""

  def test_eager_calls_reuse_their_compiled_shard_map(self):
    from pallas_emb import exchange  # pylint: disable=g-import-not-at-top
    opt = pe.RowwiseAdagrad(0.1)
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("a", 100, 16, optimizer=opt),
         pe.TableSpec("b", 50, 8, optimizer=opt)],
        [pe.FeatureSpec("f", "a"), pe.FeatureSpec("g", "b", combiner="sum")],
        test_util.mesh({"x": 8}), "x")
    state = test_util.random_state(coll, 0)
    batch = {"f": np.arange(8, dtype=np.int32),
             "g": np.ones((8, 3), np.int32)}
    grads = {"f": np.ones((8, 16), np.float32),
             "g": np.ones((8, 8), np.float32)}

    def step(state):
      emb = coll.lookup(state, batch)
      state, _ = coll.apply_gradients(state, batch, grads)
      return state, emb

    cache = exchange._jitted_shard  # pylint: disable=protected-access
    state, first = step(state)
    before = cache.cache_info()
    state, second = step(state)
    after = cache.cache_info()
    self.assertEqual(after.misses, before.misses)
    # All three shard_maps (the lookup, the batch's routing, the update)
    # came from the cache.
    self.assertEqual(after.hits - before.hits, 3)
    # The second lookup reads the updated table.
    self.assertFalse(np.array_equal(first["f"], second["f"]))


class LookupAndRouteTest(absltest.TestCase):

  def test_routing_does_not_depend_on_the_served_values(self):
    """The routing is tied to the gathered rows (so XLA orders the lookup
    before the in-place update); non-finite rows must not change it. (On
    XLA:CPU, jax 0.10, a NaN converts to int 0 anyway; other platforms and
    versions need not, and a tie that is not `* 0` fails here.)"""
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("t", 64, 8, optimizer=pe.RowwiseAdagrad(0.1))],
        [pe.FeatureSpec("f", "t"), pe.FeatureSpec("b", "t", combiner="sum")],
        test_util.mesh({"x": 2}), "x")
    ids = np.array([5, 7, 5, 9], np.int32)
    batch = {"f": ids, "b": np.array([[5, 1], [2, 3], [4, 4], [6, 0]],
                                     np.int32)}
    want = coll.route(batch)
    for bad in (np.nan, np.inf, -np.inf):
      table = np.zeros((64, 8), np.float32)
      table[ids[0]] = bad
      state = coll.state_from_arrays({"t": table})
      _, got = jax.jit(coll.lookup_and_route)(state, batch)
      for name in want.stacks:
        for field in ("unique_tokens", "segments"):
          np.testing.assert_array_equal(
              getattr(got.stacks[name], field),
              getattr(want.stacks[name], field), err_msg=f"{bad} {field}")


class KernelConfigTest(absltest.TestCase):
  """A `pe.KernelConfig` given to the collection reaches every kernel."""

  def test_configs_reach_the_kernels(self):
    from pallas_emb.kernels.triton import gather, pool, segment_sum, sparse_update  # pylint: disable=g-import-not-at-top
    from pallas_emb.testing import ptx  # pylint: disable=g-import-not-at-top
    config = pe.KernelConfig(
        gather=gather.GatherConfig(num_warps=8),
        pool=pool.PoolConfig(num_warps=2),
        segment_sum=segment_sum.SegmentSumConfig(num_warps=8),
        update=sparse_update.SparseUpdateConfig(num_warps=2))
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("t", 100, 16, optimizer=pe.RowwiseAdagrad(0.1))],
        [pe.FeatureSpec("f", "t"), pe.FeatureSpec("b", "t", combiner="sum")],
        test_util.mesh({"x": 1}), "x", backend="triton",
        kernel_config=config)
    state = jax.eval_shape(coll.init, jax.random.key(0))
    batch = {"f": jax.ShapeDtypeStruct((64,), jnp.int32),
             "b": jax.ShapeDtypeStruct((64, 3), jnp.int32)}
    grads = {"f": jax.ShapeDtypeStruct((64, 16), jnp.float32),
             "b": jax.ShapeDtypeStruct((64, 16), jnp.float32)}
    warps = {k.name: k.num_warps for k in ptx.capture(
        lambda s, b, g: coll.apply_gradients(s, b, g)[0], state, batch,
        grads) + ptx.capture(coll.lookup, state, batch)}
    self.assertEqual(warps, {"pallas_emb_gather": 8, "pallas_emb_pool": 2,
                             "pallas_emb_segment_sum": 8,
                             "pallas_emb_segment_sum_pieces": warps[
                                 "pallas_emb_segment_sum_pieces"],
                             "pallas_emb_adagrad": 2})
    # The single-table layer takes the same config.
    ctx = pe.make_context(coll.mesh, "x", tokens_per_batch=64, emb_width=16,
                          num_unique=65)
    table = jax.ShapeDtypeStruct((100, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((64,), jnp.int32)
    opt = pe.RowwiseAdagrad(0.1)

    def single(t, s, i, g):
      emb = pe.lookup(ctx, t, i, backend="triton", kernel_config=config)
      return emb, pe.apply_gradients(
          ctx, opt, t, s, g, pe.dedup(ctx, i, vocab_rows=100),
          backend="triton", kernel_config=config)[0]

    warps = {k.name: k.num_warps for k in ptx.capture(
        single, table, jax.eval_shape(lambda t: opt.init(ctx, t), table), ids,
        grads["f"])}
    self.assertEqual((warps["pallas_emb_gather"], warps["pallas_emb_adagrad"],
                      warps["pallas_emb_segment_sum"]), (8, 2, 8))
    with self.assertRaisesRegex(pe.InputError, "expected a "
                                "pallas_emb.KernelConfig"):
      pe.EmbeddingCollection(list(coll.tables.values()),
                             list(coll.features.values()), coll.mesh, "x",
                             kernel_config={"gather": None})


class ValidationTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = test_util.mesh({"x": 4})
    self.opt = pe.RowwiseAdagrad(0.1)

  def _coll(self, tables=None, features=None, **kw):
    tables = tables or [pe.TableSpec("t", 10, 8, optimizer=self.opt)]
    features = features or [pe.FeatureSpec("f", "t")]
    return pe.EmbeddingCollection(tables, features, kw.pop("mesh", self.mesh),
                                  kw.pop("table_axis", "x"), **kw)

  def test_layout_rules(self):
    m = test_util.mesh({"replica": 2, "x": 4})
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        f"pallas_emb axis 'y' is not a mesh axis of {m}")):
      self._coll(mesh=m, table_axis="y")
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        "pallas_emb requires token shards to vary across the communicator: "
        "table_axis ['x'] missing from data_axis ('replica',)")):
      self._coll(mesh=m, data_axis="replica")
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        "pallas_emb requires exactly one token shard per communicator rank: "
        "data_axis ('replica', 'x') shards tokens over 2 positions outside "
        "table_axis ('x',)")):
      self._coll(mesh=m, data_axis=("replica", "x"))
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        "pallas_emb emb_width=6 does not shard evenly over the 4-rank "
        "communicator (table 'u')")):
      self._coll(tables=[pe.TableSpec("t", 10, 8, optimizer=self.opt),
                         pe.TableSpec("u", 10, 6, optimizer=self.opt)],
                 features=[pe.FeatureSpec("f", "t"),
                           pe.FeatureSpec("g", "u")])

  def test_rule4_names_the_feature(self):
    coll = self._coll()
    state = test_util.random_state(coll, 0)
    with self.assertRaisesRegex(pe.ShardingError, "^" + re.escape(
        "pallas_emb tokens_per_batch=6 does not shard evenly over the 4-rank "
        "communicator (batch['f'] has shape (6, 2))")):
      coll.lookup(state, {"f": np.zeros((6, 2), np.int32)})

  @parameterized.parameters(
      (lambda o: pe.TableSpec("", 10, 8, optimizer=o), "name='' must be"),
      (lambda o: pe.TableSpec("t", 0, 8, optimizer=o),
       "TableSpec 't' vocab_rows=0 must be a positive integer"),
      (lambda o: pe.TableSpec("t", 10, 8, optimizer=o, dtype=jnp.int32),
       "dtype=int32; expected one of"),
      (lambda o: pe.TableSpec("t", 10, 8, optimizer="adam"),
       "optimizer='adam' is not a sparse optimizer"),
      (lambda o: pe.TableSpec("t", 10, 8, optimizer=o, max_unique=0),
       "max_unique=0 must be a positive integer"),
      (lambda o: pe.TableSpec("t", 10, 8, optimizer=o, padding_id=1.5),
       "padding_id=1.5 must be an int id or None"),
      (lambda o: pe.TableSpec("t", 10, 8, optimizer=o, padding_id=10),
       r"TableSpec 't' padding_id=10 is not a row of its 10-row table; "
       r"expected an id in \[-10, 10\)"),
      (lambda o: pe.TableSpec("t", 10, 8, optimizer=o, padding_id=-11),
       r"padding_id=-11 is not a row"),
      (lambda o: pe.FeatureSpec("f", "t", weighted=True),
       "weighted=True needs a combiner"),
  )
  def test_spec_errors(self, make, message):
    with self.assertRaisesRegex(pe.InputError, message):
      make(self.opt)

  def test_collection_errors(self):
    t = pe.TableSpec("t", 10, 8, optimizer=self.opt)
    with self.assertRaisesRegex(pe.InputError, "names \\['t'\\] more than "
                                "once"):
      self._coll(tables=[t, t])
    with self.assertRaisesRegex(pe.InputError, "FeatureSpec 'f' reads table "
                                "'nope'"):
      self._coll(features=[pe.FeatureSpec("f", "nope")])
    with self.assertRaisesRegex(pe.InputError, "tables \\['u'\\] are read by "
                                "no feature"):
      self._coll(tables=[t, pe.TableSpec("u", 10, 8, optimizer=self.opt)])
    with self.assertRaisesRegex(pe.InputError, "expected pallas_emb.TableSpec"):
      self._coll(tables=[("t", 10, 8)])

  def test_dedup_errors(self):
    with self.assertRaisesRegex(pe.InputError, "dedup='hash' is not one of "
                                "\\('sort', 'slot_map'\\)"):
      self._coll(dedup="hash")
    with self.assertRaisesRegex(pe.InputError, "dedup='slot_map' runs on the "
                                "xla backend only, not backend='interpret'; "
                                "pass backend='xla' or dedup='sort'"):
      self._coll(dedup="slot_map", backend="interpret")
    # The default: the faster dedup measured for the platform and backend.
    self.assertEqual(self._coll().dedup, "slot_map")  # CPU, xla
    self.assertEqual(self._coll(backend="interpret").dedup, "sort")
    self.assertEqual(validation.default_dedup("tpu", "xla"), "sort")
    with self.assertRaisesRegex(pe.InputError, "plan dedup='x'"):
      pe.plan([pe.TableSpec("t", 10, 8, optimizer=self.opt)],
              [pe.FeatureSpec("f", "t")], self.mesh, table_axis="x",
              batch_size=8, device_memory=2**30, dedup="x")
    # A state of the sort twin has no map: its route makes a fresh one.
    maps = self._coll(dedup="slot_map", backend="xla")
    sort = self._coll(dedup="sort")
    batch, grads = {"f": np.arange(8, dtype=np.int32)}, {
        "f": np.ones((8, 8), np.float32)}
    state, _ = maps.apply_gradients(test_util.random_state(sort, 0), batch,
                                    grads)
    self.assertEqual(state.stacks["stack0"].slot_map.shape, (10,))
    with self.assertRaisesRegex(pe.InputError, "state stack0 slot_map is "
                                "int32\\[10\\]; the plan says None \\(this "
                                "collection dedups it by a sort\\)"):
      sort.lookup(state, batch)

  def test_call_errors(self):
    coll = self._coll()
    state = test_util.random_state(coll, 0)
    with self.assertRaisesRegex(pe.InputError, r"batch has no ids for "
                                r"features \['f'\]; it has keys \['g'\]"):
      coll.lookup(state, {"g": np.zeros(4, np.int32)})
    with self.assertRaisesRegex(pe.InputError, "batch\\['f'\\] has dtype "
                                "float32; expected integer ids"):
      coll.lookup(state, {"f": np.zeros(4, np.float32)})
    with self.assertRaisesRegex(pe.InputError, re.escape(
        "emb_grads['f'] has shape (4, 4); expected (4, 8)")):
      coll.apply_gradients(state, {"f": np.zeros(4, np.int32)},
                           {"f": np.zeros((4, 4), np.float32)})
    with self.assertRaisesRegex(pe.InputError, "state is a dict"):
      coll.lookup({"stack0": None}, {"f": np.zeros(4, np.int32)})

  def test_unplaced_inputs_are_placed_on_explicit_meshes(self):
    mesh = test_util.mesh({"x": 4}, explicit=True)
    coll = self._coll(mesh=mesh)
    state = test_util.random_state(coll, 0)
    batch, grads = {"f": [1, 2, 3, 4]}, {"f": np.ones((4, 8), np.float32)}
    new, stats = coll.apply_gradients(state, batch, grads)
    self.assertEqual(int(stats["stack0"].valid), 1)
    # Abstract (unplaced) state under jit: placed, not a shard_map error.
    abstract = jax.eval_shape(coll.init, jax.random.key(0))
    jax.jit(coll.apply_gradients).lower(abstract, batch, grads)
    wrong = jax.device_put(state.stacks["stack0"].table,
                           jax.sharding.NamedSharding(mesh, P(None, None)))
    bad = pe.CollectionState(
        {"stack0": state.stacks["stack0"]._replace(table=wrong)})
    with self.assertRaisesRegex(pe.ShardingError, re.escape(
        "expected P(None, 'x')")):
      coll.apply_gradients(bad, batch, grads)
    with self.assertRaisesRegex(pe.ShardingError, re.escape(
        "expected P(None, 'x')")):
      coll.lookup(bad, batch)



class AcceleratorBackendOnCpuTest(parameterized.TestCase):
  """`backend="triton"` / `"mosaic_tpu"` on a CPU mesh: accepted (a step
  lowers for the accelerator from the CPU), but the first eager lookup or
  update is the library's InputError naming the backend, the platform and
  the interpreters, not Pallas' own."""

  @parameterized.parameters(("triton", "GPU", "cuda"),
                            ("mosaic_tpu", "TPU", "tpu"))
  def test_eager_calls_say_which_interpreter(self, backend, target,
                                             platform):
    mesh = test_util.mesh({"x": 2})
    opt = pe.Sgd(0.1)
    coll = pe.EmbeddingCollection([pe.TableSpec("t", 16, 8, optimizer=opt)],
                                  [pe.FeatureSpec("f", "t")], mesh, "x",
                                  backend=backend)
    state = test_util.random_state(coll, 0)
    batch = {"f": np.int32([1, 2, 3, 4])}
    grads = {"f": np.ones((4, 8), np.float32)}
    message = (rf"backend='{backend}' compiles its kernels for {target}s, "
               r"but the arrays are on platform 'cpu'.*'interpret' runs the "
               r"Triton kernels, 'mosaic_tpu_interpret' the Mosaic ones")
    ctx = pe.make_context(mesh, "x", tokens_per_batch=4, emb_width=8,
                          num_unique=5)
    # The single-table API takes the logical table (the collection's state
    # holds a Mosaic table in its stored layout).
    table = coll.table_arrays(state)["t"]
    for call in (lambda: coll.lookup(state, batch),
                 lambda: coll.lookup_and_route(state, batch),
                 lambda: coll.apply_gradients(state, batch, grads),
                 lambda: coll.lookup(coll.quantize(state, "int8"), batch),
                 lambda: pe.lookup(ctx, table, batch["f"], backend=backend),
                 lambda: pe.lookup_and_dedup(ctx, table, batch["f"],
                                             backend=backend),
                 lambda: pe.apply_gradients(
                     ctx, opt, table, opt.init(ctx, table), grads["f"],
                     pe.dedup(ctx, batch["f"], vocab_rows=16),
                     backend=backend)):
      with self.assertRaisesRegex(pe.InputError, message):
        call()
    # Traced, nothing runs on the CPU: the step lowers for the accelerator
    # (the update: a Mosaic lookup reads rows with XLA's gather).
    lowered = jax.jit(coll.apply_gradients).trace(state, batch, grads).lower(
        lowering_platforms=(platform,))
    self.assertIn("tpu_custom_call" if platform == "tpu" else
                  "__gpu$xla.gpu.triton", lowered.as_text())


if __name__ == "__main__":
  absltest.main()
