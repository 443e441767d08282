"""Hostile inputs to a collection: each gives the right answer or one clear
pe.Error, never a silently wrong result (caps per table, another
collection's state or routing, weights the collection would not read, empty
batches, bag lengths outside the bags, overflow under the Trainer)."""

import test_util

from absl.testing import absltest
import jax
import numpy as np

import pallas_emb as pe

WIDTH = 8


def two_tables(mesh, users_cap=None, order=("users", "items")):
  opt = pe.Sgd(1.0)
  specs = {"users": pe.TableSpec("users", 64, WIDTH, optimizer=opt,
                                 max_unique=users_cap),
           "items": pe.TableSpec("items", 64, WIDTH, optimizer=opt)}
  return pe.EmbeddingCollection(
      [specs[n] for n in order],
      [pe.FeatureSpec("user", "users"), pe.FeatureSpec("item", "items")],
      mesh, "x", backend="xla")


def moved_rows(before, after):
  return set(np.flatnonzero(np.any(np.asarray(before) != np.asarray(after),
                                   axis=1)).tolist())


class CollectionInputsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = test_util.mesh({"x": 8})

  def test_a_cap_costs_only_its_own_table(self):
    # users capped at 4 in a stack shared with an uncapped items table:
    # 16 distinct users and 16 distinct items.
    coll = two_tables(self.mesh, users_cap=4)
    self.assertLen(coll.plan.stacks, 1)
    state = test_util.random_state(coll, 0)
    before = coll.table_arrays(state)
    batch = {"user": np.arange(1, 17, dtype=np.int32),
             "item": np.arange(20, 36, dtype=np.int32)}
    grads = {k: np.ones((16, WIDTH), np.float32) for k in batch}
    new, stats = coll.apply_gradients(state, batch, grads)
    after = coll.table_arrays(new)
    # Every item row trains; the users table keeps 4 of its 16 rows.
    self.assertEqual(moved_rows(before["items"], after["items"]),
                     set(range(20, 36)))
    self.assertLen(moved_rows(before["users"], after["users"]), 4)
    self.assertEqual(int(stats["stack0"].num_overflow), 12)
    with self.assertRaisesRegex(pe.UniqueOverflowError,
                                r"tables \['users'\] had 12 more"):
      coll.raise_if_overflow(stats)

  def test_the_trainer_raises_on_overflow_by_default(self):
    coll = two_tables(self.mesh, users_cap=4)
    batch = {"user": np.arange(1, 17, dtype=np.int32),
             "item": np.arange(20, 36, dtype=np.int32)}
    test_util.assert_trainer_checks_overflow(
        self, coll, batch, "had 12 more distinct ids", 12)

  def test_another_collections_state_is_refused(self):
    # The same tables in another order: same shapes, other rows.
    coll = two_tables(self.mesh)
    other = two_tables(self.mesh, order=("items", "users"))
    state = test_util.random_state(other, 0)
    batch = {"user": np.arange(8, dtype=np.int32),
             "item": np.arange(8, dtype=np.int32)}
    with self.assertRaisesRegex(pe.InputError,
                                "state was made by another collection"):
      coll.lookup(state, batch)

  def test_another_collections_routing_is_refused(self):
    opt = pe.Sgd(1.0)
    make = lambda users: pe.EmbeddingCollection(
        [pe.TableSpec("users", users, WIDTH, optimizer=opt),
         pe.TableSpec("items", 64, WIDTH, optimizer=opt)],
        [pe.FeatureSpec("user", "users"), pe.FeatureSpec("item", "items")],
        self.mesh, "x", backend="xla")
    coll, other = make(64), make(72)
    batch = {"user": np.arange(8, dtype=np.int32),
             "item": np.arange(8, dtype=np.int32)}
    routing = other.route(batch)
    state = test_util.random_state(coll, 0)
    grads = {k: np.ones((8, WIDTH), np.float32) for k in batch}
    with self.assertRaisesRegex(pe.InputError,
                                "routing was made by another collection"):
      coll.apply_gradients(state, routing, grads)

  def pooled(self, weighted=False):
    return pe.EmbeddingCollection(
        [pe.TableSpec("t", 32, WIDTH, optimizer=pe.Sgd(1.0))],
        [pe.FeatureSpec("bag", "t", combiner="sum", weighted=weighted),
         pe.FeatureSpec("seq", "t")], self.mesh, "x", backend="xla")

  def test_bag_weights_key_is_read_not_ignored(self):
    # A pad_ragged mask under "<name>_weights" of an unweighted feature.
    coll = self.pooled()
    state = test_util.random_state(coll, 0)
    ids, mask = pe.pad_ragged([[3, 4]] * 4 + [[5]] * 4, max_len=3)
    seq = np.arange(8, dtype=np.int32)
    with_key = coll.lookup(state, {"bag": ids, "bag_weights": mask,
                                   "seq": seq})
    as_bag = coll.lookup(state, {"bag": pe.Bag(ids, weights=mask),
                                 "seq": seq})
    table = np.asarray(coll.table_arrays(state)["t"])
    want = np.stack([table[3] + table[4]] * 4 + [table[5]] * 4)
    np.testing.assert_allclose(np.asarray(with_key["bag"]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(with_key["bag"]),
                                  np.asarray(as_bag["bag"]))

  def test_unread_and_ambiguous_weights_are_errors(self):
    coll = self.pooled()
    state = test_util.random_state(coll, 0)
    ids = np.ones((8, 3), np.int32)
    seq = np.arange(8, dtype=np.int32)
    with self.assertRaisesRegex(pe.InputError, "'seq' is a sequence feature, "
                                "which reads no weights"):
      coll.lookup(state, {"bag": ids, "seq": seq,
                          "seq_weights": np.ones(8, np.float32)})
    with self.assertRaisesRegex(pe.InputError, "give the bag's weights one "
                                "way"):
      coll.lookup(state, {"bag": pe.Bag(ids, lengths=np.ones(8, np.int32)),
                          "bag_weights": np.ones((8, 3), np.float32),
                          "seq": seq})
    with self.assertRaisesRegex(pe.InputError, "both weights and lengths"):
      coll.lookup(state, {"bag": pe.Bag(ids, np.ones((8, 3), np.float32),
                                        np.ones(8, np.int32)), "seq": seq})

  def test_lengths_outside_the_bags_are_errors(self):
    coll = self.pooled()
    state = test_util.random_state(coll, 0)
    ids = np.ones((8, 3), np.int32)
    seq = np.arange(8, dtype=np.int32)
    for bad in (4, -1):
      lengths = np.full(8, 2, np.int32)
      lengths[5] = bad
      with self.assertRaisesRegex(
          pe.InputError, f"hold {bad} at example 5; expected 0 <= length "
          "<= 3"):
        coll.lookup(state, {"bag": pe.Bag(ids, lengths=lengths), "seq": seq})

  def test_an_empty_batch_is_an_error(self):
    coll = self.pooled()
    state = test_util.random_state(coll, 0)
    with self.assertRaisesRegex(pe.InputError, r"has shape \(0, 3\): no "
                                "examples"):
      coll.lookup(state, {"bag": np.ones((0, 3), np.int32),
                          "seq": np.ones((0,), np.int32)})


if __name__ == "__main__":
  absltest.main()
