"""Pooled (multi-hot) features through a stack, against a numpy model (§11).

The model pools in float64 with TF's `embedding_lookup_sparse` semantics
(`sum`: sum w e; `mean`: sum w e / sum w; `sqrtn`: sum w e / sqrt(sum w^2);
padding ids and zero weights drop out; an empty bag is zeros), and trains
each table with numpy_model.Adagrad on the per-entry gradients
`w' * g_example` (w' = the entry's combiner weight) of every feature that
reads it.
"""

import contextlib
import re
from unittest import mock

import test_util

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import collection_test
import numpy_model
import pallas_emb as pe
from pallas_emb import inputs as inputs_lib
from pallas_emb import per_rank as per_rank_lib
from pallas_emb import kernels
from pallas_emb import stack as stack_lib
from pallas_emb import stack_grads as stack_grads_lib
from pallas_emb.testing import hlo

OPT_KW = dict(learning_rate=0.1, half_life_steps=3.0, weight_decay=0.05,
              lazy=True)


def combiner_weights(combiner, ids, weights, padding_id, vocab_rows,
                     dtype=np.float64):
  """w' per entry of `[B, L]` bags (0 for padding, `numpy_model.resolve`),
  computed in `dtype`."""
  w = np.asarray(weights, dtype).copy()
  w[numpy_model.resolve(ids, vocab_rows, padding_id)[2]] = 0.0
  if combiner == "sum":
    return w
  total = (w.sum(axis=1, keepdims=True) if combiner == "mean" else
           np.sqrt((w * w).sum(axis=1, keepdims=True)))
  return np.divide(w, total, out=np.zeros_like(w), where=total != 0)


def model_pool(table, ids, w):
  """sum_j w'_j table[clamp(wrap(ids_j))] in float64, `[B, D]`."""
  rows = collection_test.model_lookup(np.asarray(table, np.float64), ids)
  return np.einsum("bl,bld->bd", w, rows)


def assert_pooled_close(test, got, exact, scale, dtype, msg):
  """|got - exact| within f32 accumulation (+ one rounding for bf16)."""
  got = test_util.as_numpy(got).astype(np.float64)
  ulp = 2.0**-8 if np.dtype(dtype) != np.float32 else 0.0
  bound = ulp * np.abs(exact) + 16 * 2.0**-24 * scale + 1e-30
  bad = np.abs(got - exact) > bound
  test.assertFalse(bad.any(), f"{msg}: {np.argwhere(bad)[:5]} got "
                   f"{got[bad][:5]} want {exact[bad][:5]}")


def random_bags(rng, examples, max_len, vocab):
  """Bags with empty ones, repeats, wrapped and out-of-range ids."""
  lengths = rng.integers(0, max_len + 1, examples)
  ids = rng.integers(-vocab, vocab + 2, (examples, max_len)).astype(np.int32)
  ids[:, 1] = ids[:, 0]  # repeated id inside a bag
  ids[rng.random((examples, max_len)) < 0.1] = 0
  return ids, lengths


def make_collection(ranks, dtype, backend, seed):
  rng = np.random.default_rng(seed)
  opt = pe.RowwiseAdagrad(**OPT_KW)
  mesh = test_util.mesh({"x": ranks})
  width = 8 * ranks if ranks < 8 else 16
  tables = [pe.TableSpec("items", int(rng.integers(20, 40)), width,
                         optimizer=opt, dtype=dtype, padding_id=0),
            pe.TableSpec("tags", int(rng.integers(5, 15)), width,
                         optimizer=opt, dtype=dtype)]
  features = [
      pe.FeatureSpec("item", "items"),                       # sequence
      pe.FeatureSpec("history", "items", combiner="mean"),   # lengths
      pe.FeatureSpec("clicks", "items", combiner="sqrtn", weighted=True),
      pe.FeatureSpec("tags", "tags", combiner="sum"),        # weights mask
  ]
  return pe.EmbeddingCollection(tables, features, mesh, "x",
                                backend=backend), rng


def random_batch(coll, rng, examples):
  items = coll.tables["items"].vocab_rows
  tags = coll.tables["tags"].vocab_rows
  hist, hist_len = random_bags(rng, examples, 4, items)
  clicks, _ = random_bags(rng, examples, 3, items)
  click_w = rng.uniform(0.0, 2.0, clicks.shape).astype(np.float32)
  click_w[rng.random(clicks.shape) < 0.2] = 0.0  # zero weight = padding
  tag_rows = [list(rng.integers(-tags, tags, rng.integers(0, 5)))
              for _ in range(examples)]
  tag_ids, tag_mask = pe.pad_ragged(tag_rows, max_len=4)
  batch = {"item": rng.integers(-items, items, examples).astype(np.int32),
           "history": pe.Bag(hist, lengths=hist_len),
           "clicks": clicks, "clicks_weights": click_w,
           "tags": pe.Bag(tag_ids, tag_mask)}
  # What the model pools with: input weights per entry.
  inputs = {"history": (hist, (np.arange(4) < hist_len[:, None]) * 1.0),
            "clicks": (clicks, click_w), "tags": (tag_ids, tag_mask)}
  return batch, inputs


class PooledModel:
  """The numpy model: per-table Adagrad fed by every feature's entries."""

  def __init__(self, coll, arrays):
    self.coll = coll
    self.models = {n: numpy_model.Adagrad(np.asarray(a), **_model_kw())
                   for n, a in arrays.items()}

  def weights(self, name, inputs, dtype=np.float64):
    spec = self.coll.features[name]
    ids, w = inputs[name]
    table = self.coll.tables[spec.table]
    return combiner_weights(spec.combiner, ids, w, table.padding_id,
                            table.vocab_rows, dtype)

  def step(self, batch, inputs, grads):
    for table, model in self.models.items():
      vocab = self.coll.tables[table].vocab_rows
      all_ids, all_grads = [], []
      for name, spec in self.coll.features.items():
        if spec.table != table:
          continue
        g = np.asarray(grads[name], np.float64)
        if spec.combiner is None:
          all_ids.append(np.asarray(batch[name]).reshape(-1))
          all_grads.append(g.reshape(-1, g.shape[-1]))
          continue
        ids, _ = inputs[name]
        # The entry gradient w' * g, rounded in f32 as the pooled features'
        # backward computes it (the sums over entries are the model's).
        w = self.weights(name, inputs, np.float32)
        g = np.asarray(grads[name], np.float32)
        # Zero-weight entries take no slot: give them an id outside the
        # table after one wrap (the model skips those).
        all_ids.append(np.where(w != 0, ids, -3 * vocab).reshape(-1))
        all_grads.append((w[:, :, None] * g[:, None, :]).reshape(
            -1, g.shape[-1]))
      model.step(np.concatenate(all_ids), np.concatenate(all_grads),
                 sum(a.size for a in all_ids) + 1,
                 padding_id=self.coll.tables[table].padding_id)


def _model_kw():
  return collection_test._model_kw(OPT_KW)


class PooledModelTest(parameterized.TestCase):

  @parameterized.product(ranks=[1, 2, 8],
                         dtype=[jnp.float32, jnp.bfloat16])
  def test_lookup_and_three_updates(self, ranks, dtype):
    for backend in test_util.backends_for(self):
      seed = ranks * 10 + (dtype == jnp.bfloat16)
      with self.subTest(backend=backend, seed=seed):
        coll, rng = make_collection(ranks, dtype, backend, seed)
        logging.info("pooled collection seed %d:\n%s", seed, coll.plan)
        # On 1 and 4 ranks the xla backend updates in chunks of 3 slots.
        with (test_util.update_in_chunks(3) if ranks in (1, 4)
              else contextlib.nullcontext()):
          self._check(coll, rng, dtype, examples=2 * ranks)

  def _check(self, coll, rng, dtype, examples):
    state = test_util.random_state(coll, 0)
    model = PooledModel(coll, {k: test_util.as_numpy(v) for k, v in
                               coll.table_arrays(state).items()})
    lookup = jax.jit(coll.lookup)
    step = jax.jit(coll.apply_gradients, donate_argnums=0)
    for _ in range(3):
      batch, inputs = random_batch(coll, rng, examples)
      emb = lookup(state, batch)
      tables = {k: test_util.as_numpy(v).astype(np.float64)
                for k, v in coll.table_arrays(state).items()}
      for name, spec in coll.features.items():
        table = tables[spec.table]
        if spec.combiner is None:
          test_util.assert_bits_equal(
              self, emb[name], collection_test.model_lookup(
                  test_util.as_numpy(coll.table_arrays(state)[spec.table]),
                  batch[name]), name)
          continue
        self.assertEqual(emb[name].shape, (examples, table.shape[1]))
        w = model.weights(name, inputs)
        exact = model_pool(table, inputs[name][0], w)
        scale = model_pool(np.abs(table), inputs[name][0], np.abs(w))
        assert_pooled_close(self, emb[name], exact, scale, dtype, name)
        # An empty bag (or all padding) pools to zeros.
        empty = (w == 0).all(axis=1)
        self.assertTrue((test_util.as_numpy(emb[name])[empty] == 0).all())
      grads = {n: rng.standard_normal(e.shape).astype(e.dtype)
               for n, e in emb.items()}
      model.step(batch, inputs, grads)
      state, stats = step(state, batch, grads)
      self.assertEqual([int(s.valid) for s in stats.values()], [1])
    for name, table in coll.table_arrays(state).items():
      collection_test.assert_tables_close(self, table, model.models[name],
                                          name)


class GradSumsByPositionTest(absltest.TestCase):
  """The xla backend's per-position segment sums == the per-entry ones."""

  def test_equals_the_segment_sum_of_per_entry_gradients(self):
    mesh = test_util.mesh({"r": 2, "x": 4})
    opt = pe.RowwiseAdagrad(**OPT_KW)
    tables = [pe.TableSpec("items", 30, 16, optimizer=opt, padding_id=0,
                           max_unique=9),   # overflows: dropped the same
              pe.TableSpec("tags", 12, 16, optimizer=opt)]
    features = [
        pe.FeatureSpec("item", "items"),
        pe.FeatureSpec("history", "items", combiner="mean"),
        pe.FeatureSpec("clicks", "items", combiner="sqrtn", weighted=True),
        pe.FeatureSpec("tags", "tags", combiner="sum"),
        pe.FeatureSpec("one", "items", combiner="mean"),
        pe.FeatureSpec("bagged", "tags", combiner="sum")]
    coll = pe.EmbeddingCollection(tables, features, mesh, "x",
                                  replica_axis="r", backend="xla")
    rng = np.random.default_rng(11)
    batch, _ = random_batch(coll, rng, 8)
    batch["one"] = rng.integers(-30, 32, (8, 1)).astype(np.int32)
    ids, lengths = random_bags(rng, 8, 3, 12)
    batch["bagged"] = pe.Bag(ids, lengths=lengths)
    batch["clicks_weights"][0, :] = [-1.0, 0.5, 2.0]
    inputs = inputs_lib.read_batch(coll, batch)
    ids, weights = inputs.ids, inputs.weights
    calls = coll.layouts(batch)
    self.assertEqual([f.name for f in calls[0].pooled if f.unit_weights],
                     ["one", "bagged"])
    order = (tuple(coll.features),
             tuple(n for n, f in coll.features.items() if f.combiner))
    # Every feature here gives one row per example ("item" is [B]).
    grads = {n: rng.standard_normal((8, 16)).astype(np.float32)
             for n in coll.features}

    def per_rank(all_ids, all_weights, all_grads):
      (call, stack_ids, stack_weights), = per_rank_lib.per_stack(
          order, calls, all_ids, all_weights)
      by_name = dict(zip(order[0], all_grads))
      stack_grads = [by_name[f.name] for f in call.features]
      keys_all, weights_all = stack_lib.gather_entries(call, stack_ids,
                                                      stack_weights)
      routing = stack_lib.route(call, keys_all, weights_all)
      weights_all = routing.weights.reshape(call.ctx.group_size, -1)
      got = stack_grads_lib.grad_sums_by_position(call, stack_grads, weights_all,
                                           routing.segments,
                                           call.ctx.num_unique, jnp.float32)
      want = kernels.segment_sum_rows(
          stack_grads_lib.routed_entry_grads(call, stack_grads, weights_all),
          routing.segments, call.ctx.num_unique, round_dtype=jnp.float32,
          backend="xla")
      return tuple(x[None] for x in got + want) + (
          routing.num_overflow[None],)

    spec = coll.token_sharding().spec
    out = jax.jit(jax.shard_map(
        per_rank, mesh=mesh,
        in_specs=(tuple(spec for _ in order[0]),
                  tuple(spec for _ in order[1]),
                  tuple(spec for _ in order[0])),
        out_specs=jax.sharding.PartitionSpec(("r", "x"))))(
            tuple(ids[n] for n in order[0]),
            tuple(weights[n] for n in order[1]),
            tuple(grads[n] for n in order[0]))
    got_sums, got_sq, want_sums, want_sq, overflow = map(np.asarray, out)
    self.assertGreater(int(overflow[0]), 0)
    self.assertGreater(np.abs(want_sums).sum(), 0)
    np.testing.assert_allclose(got_sums, want_sums, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_sq, want_sq, rtol=1e-5, atol=1e-6)


class UpdateSizesTest(parameterized.TestCase):
  """The xla backend's update runs at the smallest `slot_tiers` size that
  holds the batch's rows: the tables, states and stats of whole-buffer
  updates, bit for bit, on 1 and 2 ranks (a replica axis too), with few
  rows (the smallest size), all rows distinct (the buffer) and between,
  sequence and pooled features of two tables in one stack."""

  def test_slot_tiers(self):
    self.assertEqual(stack_lib.slot_tiers(16384), (16384, 8192, 4096))
    self.assertEqual(stack_lib.slot_tiers(327680),
                     (327680, 163840, 81920, 40960, 20480))
    self.assertEqual(stack_lib.slot_tiers(8190), (8190,))
    self.assertEqual(stack_lib.slot_tiers(8191), (8191, 4096))
    self.assertEqual(stack_lib.slot_tiers(8192), (8192, 4096))
    self.assertEqual(stack_lib.slot_tiers(9999), (9999, 5000))

  @parameterized.product(mesh_shape=[{"x": 1}, {"r": 2, "x": 2}],
                         distinct=["one", "few", "all"])
  def test_equals_the_whole_buffer(self, mesh_shape, distinct):
    mesh = test_util.mesh(mesh_shape)
    opt = pe.RowwiseAdagrad(**OPT_KW)
    tables = [pe.TableSpec("a", 200, 8, optimizer=opt),
              pe.TableSpec("b", 150, 8, optimizer=opt)]
    features = [pe.FeatureSpec("seq", "a"),
                pe.FeatureSpec("bag", "b", combiner="mean")]
    replicas = "r" if "r" in mesh_shape else None
    coll = pe.EmbeddingCollection(tables, features, mesh, "x",
                                  replica_axis=replicas, backend="xla")
    rng = np.random.default_rng(len(distinct))
    seq, bag = np.arange(32), np.arange(40)
    if distinct == "one":
      seq, bag = seq * 0 + 7, bag * 0 + 3
    elif distinct == "few":
      seq, bag = seq % 9, bag % 5 + 100
    batch = {"seq": rng.permutation(seq).reshape(8, 4).astype(np.int32),
             "bag": rng.permutation(bag).reshape(8, 5).astype(np.int32)}
    grads = {"seq": rng.standard_normal((8, 4, 8)).astype(np.float32),
             "bag": rng.standard_normal((8, 8)).astype(np.float32)}
    (layout,) = coll.layouts(batch)
    tiers = (72, 36, 18, 9)
    self.assertEqual(layout.ctx.num_unique, tiers[0])

    def train(min_tier_slots):
      with mock.patch.object(stack_lib, "MIN_TIER_SLOTS", min_tier_slots):
        self.assertEqual(stack_lib.slot_tiers(72),
                         tiers if min_tier_slots == 9 else (72,))
        jax.clear_caches()
        state = test_util.random_state(coll, 0)
        routing = coll.route(batch)
        state, stats = jax.jit(coll.apply_gradients)(state, routing, grads)
        jax.clear_caches()
        return coll.table_arrays(state), state, stats

    got, want = train(9), train(10**6)
    for name in got[0]:
      test_util.assert_bits_equal(self, got[0][name],
                                  test_util.as_numpy(want[0][name]), name)
    for g, w in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
      test_util.assert_bits_equal(self, g, test_util.as_numpy(w))


class PooledDenseTest(absltest.TestCase):
  """Plain jax.grad through a pooled lookup == a jnp model's gradient."""

  def test_dense_gradient(self):
    coll, rng = make_collection(4, jnp.float32, "xla", 7)
    state = test_util.random_state(coll, 1)
    batch, inputs = random_batch(coll, rng, 8)
    cts = {n: rng.standard_normal(e.shape).astype(np.float32)
           for n, e in coll.lookup(state, batch).items()}

    def loss(tables):
      st = pe.CollectionState({k: s._replace(table=tables[k])
                               for k, s in state.stacks.items()})
      emb = coll.lookup(st, batch)
      return sum(jnp.vdot(emb[n], cts[n]) for n in emb)

    grads = jax.grad(loss)({k: s.table for k, s in state.stacks.items()})
    model = PooledModel(coll, {})
    rows = coll.tables["items"].vocab_rows
    want = np.zeros((rows, coll.tables["items"].emb_width))
    for name in ("item", "history", "clicks"):
      spec = coll.features[name]
      if spec.combiner is None:
        ids, w, g = batch[name][:, None], np.ones((8, 1)), cts[name]
      else:
        ids, w, g = inputs[name][0], model.weights(name, inputs), cts[name]
      wrapped = np.where(ids < 0, ids + rows, ids)
      trains = (wrapped >= 0) & (wrapped < rows) & (ids != 0) & (w != 0)
      for b, j in zip(*np.nonzero(trains)):
        want[wrapped[b, j]] += w[b, j] * g[b]
    got = test_util.as_numpy(coll.table_arrays(pe.CollectionState({
        k: s._replace(table=grads[k]) for k, s in state.stacks.items()
    }))["items"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class PooledExchangeTest(absltest.TestCase):

  def test_all_to_all_carries_one_row_per_example(self):
    mesh = test_util.mesh({"x": 8})
    opt = pe.RowwiseAdagrad(0.1)
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("t", 1000, 32, optimizer=opt)],
        [pe.FeatureSpec("bag", "t", combiner="sum")], mesh, "x")
    batch = {"bag": np.ones((64, 20), np.int32)}  # B=64: 8 per rank, L=20
    state = test_util.random_state(coll, 0)
    text = jax.jit(coll.lookup_and_route).lower(state, batch).as_text()
    shapes = re.findall(r"stablehlo.all_to_all.*?: \(tensor<([0-9x]+)xf32>",
                        text.replace("\n", " "))
    # [W * B_rank, S] = [8 * 8, 4], not [8 * 8 * 20, 4].
    self.assertEqual(shapes, ["64x4"])
    compiled = hlo.collective_bytes(
        jax.jit(coll.lookup_and_route).lower(state, batch).compile()
        .as_text(), 8)
    self.assertEqual(compiled["all-to-all"]["operand_bytes"], 64 * 4 * 4)


class InputTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.coll, _ = make_collection(2, jnp.float32, "xla", 0)
    self.state = test_util.random_state(self.coll, 0)
    rng = np.random.default_rng(0)
    self.batch, _ = random_batch(self.coll, rng, 4)

  def test_errors(self):
    bad = dict(self.batch, history=np.zeros((4,), np.int32))
    with self.assertRaisesRegex(pe.InputError, re.escape(
        "batch['history'] has shape (4,); pooled feature 'history' (mean) "
        "takes bags [batch, max_len]")):
      self.coll.lookup(self.state, bad)
    bad = {k: v for k, v in self.batch.items() if k != "clicks_weights"}
    with self.assertRaisesRegex(pe.InputError, "feature 'clicks' is weighted "
                                "but the batch has no 'clicks_weights'"):
      self.coll.lookup(self.state, bad)
    bad = dict(self.batch, clicks_weights=np.ones((4, 2), np.float32))
    with self.assertRaisesRegex(pe.InputError, re.escape(
        "weights of feature 'clicks' are float32[4, 2]; expected float "
        "weights of the ids' shape [4, 3]")):
      self.coll.lookup(self.state, bad)
    bad = dict(self.batch, item=pe.Bag(np.zeros((4, 1), np.int32)))
    with self.assertRaisesRegex(pe.InputError, "is a sequence feature"):
      self.coll.lookup(self.state, bad)
    with self.assertRaisesRegex(pe.InputError, "combiner='max'"):
      pe.FeatureSpec("f", "t", combiner="max")


class PadRaggedTest(absltest.TestCase):

  def test_lists_and_values_with_lengths(self):
    ids, w = pe.pad_ragged([[3, 4, 5], [6], []])
    np.testing.assert_array_equal(ids, [[3, 4, 5], [6, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(w, [[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    self.assertEqual((ids.dtype, w.dtype), (np.int32, np.float32))
    ids2, w2 = pe.pad_ragged((np.array([3, 4, 5, 6]), np.array([3, 1, 0])))
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(w2, w)
    ids, w = pe.pad_ragged([[1, 2]], max_len=4, weights=[[0.5, 2.0]],
                           pad_id=-1)
    np.testing.assert_array_equal(ids, [[1, 2, -1, -1]])
    np.testing.assert_array_equal(w, [[0.5, 2.0, 0, 0]])

  def test_errors_name_the_row(self):
    with self.assertRaisesRegex(pe.InputError, "row 1 has 3 ids, more than "
                                "max_len=2"):
      pe.pad_ragged([[1], [1, 2, 3]], max_len=2)
    with self.assertRaisesRegex(pe.InputError, "got 3 values but row_lengths "
                                "sum to 4"):
      pe.pad_ragged((np.arange(3), np.array([2, 2])))
    with self.assertRaisesRegex(pe.InputError, "row 0 has 2 ids but 1 "
                                "weights"):
      pe.pad_ragged([[1, 2]], weights=[[1.0]])


if __name__ == "__main__":
  absltest.main()
