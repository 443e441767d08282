"""Host-tier tables against device tables and the numpy model.

A host-tier table (`TableSpec(storage="host")`) keeps its rows in host
memory and a cache of `cache_rows` of them on the devices. Wherever the
cache holds the rows of the batches in flight, training must equal the
same table held on the devices bit for bit: the tests below train both
side by side on ids with every edge case (negative, past the end, int32
extremes, padding, weight 0), with caches small enough that every step
evicts rows (and copies changed ones back to host memory), and compare
lookups, tables and optimizer state exactly; the device table itself is
checked against the numpy model in placements_test.py, and one case here
checks the host tier against the model directly. The cache directory
(`row_cache.py`) is tested on its own, in numpy.
"""

import gc
import os
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref
from unittest import mock

import test_util

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import placements_test
import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import host_batches
from pallas_emb import host_memory
from pallas_emb import host_tier
from pallas_emb import layout as layout_lib
from pallas_emb import orbax_io
from pallas_emb import row_cache
from pallas_emb import stack as stack_lib
from pallas_emb import write_back

B, SEQ, BAG = 4, 3, 4


def collections(placement="column", policy="lru", optimizer=None,
                dtype=jnp.float32, cache_rows=24, vocab=60, width=8,
                ranks=2, padding_id=0, backend="xla", host_dir=None):
  """`(host-tier collection, the same on the devices)`: one table read by
  a sequence feature, a mean-pooled one and a weighted sum-pooled one."""
  optimizer = optimizer or pe.RowwiseAdagrad(0.1)
  spec = dict(optimizer=optimizer, dtype=dtype, placement=placement,
              padding_id=padding_id)
  features = [pe.FeatureSpec("seq", "t"),
              pe.FeatureSpec("bag", "t", combiner="mean"),
              pe.FeatureSpec("wbag", "t", combiner="sum", weighted=True)]
  mesh = test_util.mesh({"x": ranks})
  host = pe.TableSpec("t", vocab, width, storage="host",
                      cache_rows=cache_rows, cache_policy=policy,
                      host_dir=host_dir, **spec)
  device = pe.TableSpec("t", vocab, width, **spec)
  return tuple(pe.EmbeddingCollection([t], features, mesh, "x",
                                      backend=backend) for t in (host, device))


def spread_ids(rng, shape, vocab):
  """Edge-case ids (`placements_test.edge_ids`: Zipf, negative, past the
  end, int32 extremes, the padding candidates), half of them replaced by
  ids spread over the whole table (and a little past it), so that
  consecutive batches read many other rows: the caches keep evicting."""
  ids = placements_test.edge_ids(rng, shape, vocab)
  spread = rng.integers(-vocab - 2, vocab + 2, shape).astype(np.int32)
  return np.where(rng.random(shape) < 0.5, spread, ids)


def batches(coll, n, seed=0):
  """`n` batches of ids (`spread_ids`), with the raw ids and weights the
  numpy model reads."""
  rng = np.random.default_rng(seed)
  vocab = coll.tables["t"].vocab_rows
  out = []
  for _ in range(n):
    ids = {name: spread_ids(rng, shape, vocab)
           for name, shape in (("seq", (B, SEQ)), ("bag", (B, BAG)),
                               ("wbag", (B, BAG)))}
    weights = rng.choice(np.float32([0, 0.5, 1, 2]), (B, BAG))
    batch = {"seq": ids["seq"], "bag": ids["bag"],
             "wbag": pe.Bag(ids["wbag"], weights=weights)}
    raw = {"seq": (ids["seq"], None), "bag": (ids["bag"], None),
           "wbag": (ids["wbag"], weights)}
    out.append((batch, raw))
  return out


def grads_for(embs, step):
  rng = np.random.default_rng(100 + step)
  return {k: jnp.asarray(rng.standard_normal(v.shape), v.dtype)
          for k, v in embs.items()}


def same_start(host, device, seed=0):
  """A device state of random tables and the host-tier state of the same
  tables and optimizer state."""
  state = test_util.random_state(device, seed)
  return host.state_from_arrays(device.table_arrays(state),
                                device.optimizer_arrays(state)), state


class RowCacheTest(absltest.TestCase):
  """The directory alone: policies, pinning, all-or-nothing admission."""

  def admit(self, cache, rows, pinned=(), counts=None, trains=True):
    rows = np.asarray(rows)
    counts = np.ones(rows.size, int) if counts is None else np.asarray(counts)
    return cache.admit(rows, counts, np.full(rows.size, trains),
                       np.asarray(pinned, np.int32))

  def test_lru_evicts_the_least_recently_used(self):
    cache = row_cache.RowCache(4, 100, "lru")
    self.admit(cache, [10, 11, 12, 13])
    self.admit(cache, [12, 10])  # 11 and 13 are now the oldest
    got = self.admit(cache, [20, 21])
    self.assertEqual(sorted(got.evict_rows), [11, 13])
    self.assertEqual(sorted(got.fetch_rows), [20, 21])
    self.assertTrue(all(got.dirty))  # trained since they came in
    np.testing.assert_array_equal(cache.slots_of(np.array([11, 13])), -1)
    self.assertEqual(set(cache.slot_row), {10, 12, 20, 21})

  def test_lfu_evicts_the_least_frequently_used_and_ages(self):
    cache = row_cache.RowCache(4, 100, "lfu")
    self.admit(cache, [10, 11, 12, 13], counts=[5, 1, 9, 2],
               trains=False)
    got = self.admit(cache, [20], counts=[1])
    self.assertEqual(list(got.evict_rows), [11])
    self.assertFalse(got.dirty[0])  # never trained: nothing to copy back
    # The pass halved the counts: 10: 2, 12: 4, 13: 1; 20 came in with 1.
    # A tie of counts (13, 20) goes to the least recently used, 13.
    got = self.admit(cache, [21])
    self.assertEqual(list(got.evict_rows), [13])

  def test_pinned_rows_stay_and_a_full_cache_changes_nothing(self):
    cache = row_cache.RowCache(4, 100, "lru")
    first = self.admit(cache, [1, 2])
    second = self.admit(cache, [3, 4], pinned=first.slots)
    # Rows 1 and 2 are the oldest, but pinned: a batch needing them out
    # does not fit, and the directory is left as it was.
    before = cache.row_slot.copy(), cache.slot_row.copy()
    with self.assertRaisesRegex(pe.InputError, r"needs 6 rows resident.*"
                                r"holds 4"):
      self.admit(cache, [5, 6],
                 pinned=np.concatenate([first.slots, second.slots]))
    np.testing.assert_array_equal(cache.row_slot, before[0])
    np.testing.assert_array_equal(cache.slot_row, before[1])
    self.assertEqual(cache.needed(np.array([5, 6]), first.slots), 4)
    got = self.admit(cache, [5, 6], pinned=first.slots)
    self.assertEqual(sorted(got.evict_rows), [3, 4])

  def test_lru_victims_are_the_oldest_stamps(self):
    """Against a scan of every slot: each group of LRU victims (read from
    the log, with its stale entries or compacted at every batch) holds no
    slot used after an evictable slot that stays, and is as large as the
    group rule says."""
    for log_slots in (row_cache.LOG_SLOTS, 1):
      with mock.patch.object(row_cache, "LOG_SLOTS", log_slots):
        self.check_lru_victims()

  def test_lru_compaction_spread_over_admissions_changes_no_victim(self):
    """A compaction pass filters the log a few entries an admission
    (evictions read it meanwhile): every admission moves the rows an
    uncompacted log moves, and the log stays bounded (uncompacted, it
    grows past ten times the slots)."""
    def run(log_slots, compact_batches):
      rng = np.random.default_rng(1)
      cache = row_cache.RowCache(64, 400, "lru")
      pinned, moved, longest = np.zeros(0, np.int32), [], 0
      with mock.patch.object(row_cache, "LOG_SLOTS", log_slots), \
          mock.patch.object(row_cache, "COMPACT_BATCHES", compact_batches):
        for i in range(300):
          # Hits alone (the log grows), then evictions every third batch.
          rows = np.unique(rng.zipf(1.2, 30) % (60 if i < 150 or i % 3
                                                else 400))
          got = self.admit(cache, rows, pinned)
          moved.append((got.slots, got.evict_slots, got.fetch_slots))
          longest = max(longest, cache._log_size)  # pylint: disable=protected-access
          pinned = got.slots
      return moved, longest, cache

    want, unbounded, _ = run(10**9, 1)
    got, longest, cache = run(1, 1)
    self.assertGreater(unbounded, 10 * 64)
    self.assertLessEqual(longest, 2 * 64 + 2 * 30)
    self.assertEqual(len(got), len(want))
    for a, b in zip(got, want):
      for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # Every cached slot's last use is in the log.
    logged = set()
    for clock, entry in (list(cache._ready) + list(cache._head)  # pylint: disable=protected-access
                         + list(cache._log)):  # pylint: disable=protected-access
      logged.update(entry[cache.stamp[entry] == clock].tolist())
    self.assertEqual(logged, set(np.flatnonzero(cache.slot_row >= 0)))

  def test_lru_reading_ahead_changes_no_victim(self):
    """Admissions that do not evict read the log's oldest entries ahead of
    the next eviction pass (`_read_ahead`): every admission moves the rows
    it moves without reading ahead, on batches that fill a cache with
    groups of 1/4 of it and then evict every few batches."""
    def run(batches_ahead):
      rng = np.random.default_rng(2)
      cache = row_cache.RowCache(64, 400, "lru")
      pinned, moved, read = np.zeros(0, np.int32), [], []
      # pylint: disable=protected-access
      read_ahead = cache._read_ahead

      def counted(budget):
        before = cache._ready_size
        read_ahead(budget)
        read.append(cache._ready_size - before)
      cache._read_ahead = counted
      with mock.patch.object(row_cache, "READ_AHEAD_BATCHES",
                             batches_ahead), \
          mock.patch.object(row_cache, "EVICT_FRACTION", 4):
        for _ in range(200):
          rows = np.unique(rng.zipf(1.2, 12) % 400)
          got = self.admit(cache, rows, pinned)
          moved.append((got.slots, got.evict_slots, got.fetch_slots))
          pinned = got.slots
      return moved, sum(read)

    want, none_ahead = run(0)
    got, ahead = run(row_cache.READ_AHEAD_BATCHES)
    self.assertEqual(none_ahead, 0)
    self.assertGreater(ahead, 50)  # entries read ahead
    self.assertGreater(sum(m[1].size > 0 for m in want), 10)  # passes
    for a, b in zip(got, want):
      for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)

  def check_lru_victims(self):
    rng = np.random.default_rng(0)
    cache = row_cache.RowCache(64, 400, "lru")
    pinned, groups = np.zeros(0, np.int32), 0
    for _ in range(60):
      rows = np.unique(rng.zipf(1.3, 30) % 400)
      stamp, slot_row = cache.stamp.copy(), cache.slot_row.copy()
      hits = cache.slots_of(rows)
      free = cache.num_slots - cache.cached
      got = self.admit(cache, rows, pinned)
      misses = int(np.count_nonzero(hits < 0))
      if misses > free:
        groups += 1
        stay = (slot_row >= 0)
        stay[got.evict_slots] = stay[pinned] = stay[hits[hits >= 0]] = False
        evictable = int(np.count_nonzero(stay)) + got.evict_slots.size
        self.assertEqual(got.evict_slots.size,
                         min(evictable, max(misses - free, 64 // 32)))
        if stay.any():
          self.assertLessEqual(stamp[got.evict_slots].max(),
                               stamp[stay].min())
      else:
        self.assertEqual(got.evict_slots.size, 0)
      pinned = got.slots
    self.assertGreater(groups, 10)

  def test_evicts_a_group_per_pass(self):
    cache = row_cache.RowCache(64, 1000, "lru")
    self.admit(cache, np.arange(64))
    got = self.admit(cache, [500])  # one miss evicts 64 // 32 rows
    self.assertEqual(sorted(got.evict_rows), [0, 1])
    self.assertEqual(cache.cached, 63)
    got = self.admit(cache, [501])  # a free slot: nothing evicted
    self.assertEqual(got.evict_rows.size, 0)


class HostKeysTest(absltest.TestCase):

  def test_host_keys_are_the_steps_keys(self):
    """The prefetch's numpy rule is `stack.entry_keys` (weights aside), on
    every edge case: negative ids, past the end, int32 extremes, padding."""
    rng = np.random.default_rng(0)
    for vocab, padding in ((7, 0), (60, 3), (1000, None)):
      ids = spread_ids(rng, (200,), vocab)
      feature = layout_lib.FeatureLayout("f", 0, vocab, padding, ids.shape,
                                         None, 200)
      np.testing.assert_array_equal(
          host_batches.host_keys(ids, vocab, padding),
          np.asarray(stack_lib.entry_keys(feature, jnp.asarray(ids), None)))


  def test_batch_rows_match_numpy_model(self):
    """Each host-tier stack's distinct rows, the ids reading each and
    whether one trains it, against np.unique over `host_keys`, up to the
    largest vocabulary int32 ids reach."""
    rng = np.random.default_rng(1)
    mesh = test_util.mesh({"x": 1})
    for vocab, padding in ((60, 0), (2**31 - 1, 5), (2**31 - 1, None)):
      table = pe.TableSpec("t", vocab, 8, optimizer=pe.Sgd(0.1),
                           storage="host", cache_rows=32,
                           padding_id=padding)
      coll = pe.EmbeddingCollection(
          [table], [pe.FeatureSpec("a", "t"),
                    pe.FeatureSpec("b", "t", combiner="sum")], mesh, "x")
      ids = {"a": spread_ids(rng, (B, SEQ), min(vocab, 2**20)),
             "b": pe.Bag(np.concatenate([
                 rng.integers(vocab - 3, vocab, (B, 2)),
                 rng.integers(-2, 3, (B, 2))], 1).astype(np.int32),
                         np.ones((B, BAG), np.float32))}
      ((name, (rows, counts, trains, entry_rows)),) = (
          host_batches.batch_rows(coll, ids).items())
      self.assertEqual(name, coll.plan.stacks[0].name)
      keys = np.concatenate([
          host_batches.host_keys(ids["a"], vocab, padding),
          host_batches.host_keys(ids["b"].ids, vocab, padding)])
      row = np.where(keys < 0, ~keys, keys)
      self.assertEqual(list(entry_rows), ["a", "b"])
      self.assertEqual(entry_rows["a"].dtype, np.int32)
      np.testing.assert_array_equal(
          np.concatenate([entry_rows["a"], entry_rows["b"]]), row)
      self.assertEqual(entry_rows["a"].size, ids["a"].size)
      want, inverse, want_counts = np.unique(row, return_inverse=True,
                                             return_counts=True)
      want_trains = np.zeros(want.size, bool)
      want_trains[inverse[keys >= 0]] = True
      np.testing.assert_array_equal(rows, want)
      np.testing.assert_array_equal(counts, want_counts)
      np.testing.assert_array_equal(trains, want_trains)
      self.assertGreater(rows.max(), 2**31 - 4 if vocab > 60 else 0)


class WriteBacksTest(absltest.TestCase):

  def test_rows_on_their_way_come_from_the_newest_group(self):
    """Against a model of the groups on their way (a list of row sets):
    `from_newest` places each wanted row that is on its way at its row in
    the newest group, None if one is only in an older group; a row in two
    groups stays on its way until both land."""
    # pylint: disable=protected-access
    gates, landed = [], []

    def land(rows, n, values):
      gates[len(landed)].wait(10)
      landed.append(values)

    write_backs = write_back.WriteBacks(land, [50, 50])
    groups = [([np.array([3, 7, 9]), np.array([1])], 4, "a"),
              ([np.array([9, 2]), np.array([5, 1, 8])], 4, "b")]
    gates.extend(threading.Event() for _ in groups)
    try:
      for rows, n, values in groups:
        write_backs.start(rows, n, values)
      wanted = [np.array([2, 9, 4]), np.array([8, 0])]
      positions, values = write_backs.from_newest(wanted, 3)
      self.assertEqual(values, "b")
      # Part 0: 2 and 9 at rows 1 and 0 of group b; part 1: 8 at row 2.
      np.testing.assert_array_equal(positions, [1, 0, -1, 2, -1, -1])
      # 7 is only in the older group.
      self.assertIsNone(write_backs.from_newest(
          [np.array([7, 2]), np.array([], np.int64)], 2))
      self.assertIsNone(write_backs.from_newest(
          [np.array([4]), np.array([0])], 1))  # none on its way
      gates[0].set()
      while len(landed) < 1:
        time.sleep(0.01)
      time.sleep(0.05)
      # Row 9 of part 0 is still in group b; 3 and 7 landed.
      self.assertTrue(write_backs.on_the_way([np.array([9]),
                                              np.array([], np.int64)]))
      self.assertFalse(write_backs.on_the_way([np.array([3, 7]),
                                               np.array([], np.int64)]))
      self.assertIsNotNone(write_backs.from_newest(
          [np.array([3, 9]), np.array([], np.int64)], 2))
    finally:
      for gate in gates:
        gate.set()
    write_backs.finish()
    self.assertFalse(write_backs.on_the_way([np.arange(50), np.arange(50)]))
    self.assertEqual(landed, ["a", "b"])


class InChunksTest(absltest.TestCase):

  def test_chunks_cover_the_rows_once_and_pools_do_not_queue_on_each_other(
      self):
    n = 4 * host_memory.PARALLEL_ROWS + 3
    release = threading.Event()
    landing = np.zeros(n, np.int32)

    def blocked(a, b):  # a landing that holds every thread of its pool
      release.wait(30)
      landing[a:b] += 1
    writer = threading.Thread(target=host_memory.in_chunks,
                              args=(blocked, n), kwargs={"pool": "write_back"})
    writer.start()
    try:
      seen = np.zeros(n, np.int32)

      def prefetch():
        host_memory.in_chunks(
            lambda a, b: np.add.at(seen, np.arange(a, b), 1), n)
      reader = threading.Thread(target=prefetch)
      reader.start()
      reader.join(10)  # the prefetch's pool is free: it does not wait
      self.assertFalse(reader.is_alive())
      np.testing.assert_array_equal(seen, np.ones(n, np.int32))
    finally:
      release.set()
      writer.join(30)
    np.testing.assert_array_equal(landing, np.ones(n, np.int32))


class TransferSizeTest(absltest.TestCase):

  def test_transfers_pad_to_the_least_quarter_octave(self):
    # The model: every 2^k * j / 4 (j = 4..7) of at least the minimum.
    classes = sorted({(1 << k) * j // 4 for k in range(2, 24)
                      for j in range(4, 8)}
                     | {host_tier.MIN_TRANSFER_ROWS})
    classes = [c for c in classes if c >= host_tier.MIN_TRANSFER_ROWS]
    rng = np.random.default_rng(0)
    sizes = np.concatenate([np.arange(0, 300), rng.integers(300, 1 << 22,
                                                            size=2000)])
    for n in sizes:
      want = classes[np.searchsorted(classes, n)]
      self.assertEqual(host_tier._bucket(n), want, n)  # pylint: disable=protected-access
      self.assertLessEqual(host_tier._bucket(n), max(8, 1.25 * n))  # pylint: disable=protected-access


class SpecTest(absltest.TestCase):

  def test_bad_storage_specs_raise(self):
    opt = pe.Sgd(0.1)
    for kw, match in (
        (dict(storage="disk"), r"storage='disk'; expected one of"),
        (dict(storage="host"), r"storage='host' needs cache_rows=C"),
        (dict(storage="host", cache_rows=0), r"cache_rows=0 must be a "),
        (dict(storage="host", cache_rows=10),
         r"cache_rows=10 is not fewer than its vocab_rows=10"),
        (dict(storage="host", cache_rows=4, placement="table"),
         r"storage='host' with placement='table'"),
        (dict(cache_rows=4), r"has a cache_rows, cache_policy or host_dir "
         r"but storage='device'"),
        (dict(host_dir="tables"), r"has a cache_rows, cache_policy or "
         r"host_dir but storage='device'"),
        (dict(storage="host", cache_rows=4, host_dir=3),
         r"host_dir=3; expected the path of a directory"),
        (dict(storage="host", cache_rows=4, cache_policy="fifo"),
         r"cache_policy='fifo'; expected one of \('lru', 'lfu'\)"),
    ):
      with self.subTest(kw=kw):
        with self.assertRaisesRegex(pe.InputError,
                                    "^pallas_emb TableSpec 't' " + match):
          pe.TableSpec("t", 10, 8, optimizer=opt, **kw)

  def test_a_host_table_is_a_stack_of_its_own(self):
    opt = pe.Sgd(0.1)
    tables = [pe.TableSpec("a", 100, 8, optimizer=opt, storage="host",
                           cache_rows=10),
              pe.TableSpec("b", 100, 8, optimizer=opt),
              pe.TableSpec("c", 100, 8, optimizer=opt)]
    coll = pe.EmbeddingCollection(
        tables, [pe.FeatureSpec(t.name, t.name) for t in tables],
        test_util.mesh({"x": 2}), "x")
    self.assertEqual([s.tables for s in coll.plan.stacks],
                     [("a",), ("b", "c")])
    self.assertIn("host [100, 8], a device cache of 10 rows (lru)",
                  str(coll.plan))
    self.assertIn("host memory: 3200 bytes", coll.plan.describe())


class PlannerTest(absltest.TestCase):

  def test_the_planner_moves_the_largest_table_to_the_host_tier(self):
    opt = pe.RowwiseAdagrad(0.1)
    tables = [pe.TableSpec("big", 1_000_000, 64, optimizer=opt),
              pe.TableSpec("small", 1000, 64, optimizer=opt)]
    features = [pe.FeatureSpec("b", "big"), pe.FeatureSpec("s", "small")]
    mesh = test_util.mesh({"x": 2})
    kw = dict(table_axis="x", batch_size=64, device_memory=100_000_000)
    with self.assertRaisesRegex(pe.PlanInfeasibleError,
                                r"move to the host tier \(host_memory"):
      pe.plan(tables, features, mesh, **kw)
    with self.assertRaisesRegex(pe.PlanInfeasibleError,
                                r"more than host_memory=1000 bytes"):
      pe.plan(tables, features, mesh, host_memory=1000, **kw)
    planned, report = pe.plan(tables, features, mesh, host_memory=1 << 30,
                              **kw)
    big, small = planned
    self.assertEqual((big.storage, big.placement), ("host", "row"))
    # 8 steps' distinct rows (every id of a step distinct: 2 x 64).
    self.assertEqual(big.cache_rows, 1024)
    self.assertEqual(small.storage, "device")
    (row,) = [t for t in report.tables if t.name == "big"]
    self.assertEqual(row.host_bytes, 1_000_000 * (64 * 4 + 4))
    self.assertEqual(row.link_bytes_per_step, 2 * 128 * (64 * 4 + 4))
    self.assertRegex(str(report), r"big: row.*\n    host tier: 260000000 "
                     r"bytes in host memory, a device cache of 1024 rows, "
                     r"up to 66560 bytes per step over the host link; no "
                     r"placement fits the device budget")
    coll = pe.EmbeddingCollection(planned, features, mesh, "x")
    self.assertEqual(report.memory_per_rank[0], sum(
        sum(s.rank_bytes()) for s in coll.plan.stacks))
    self.assertLessEqual(report.memory_per_rank[0], report.budget)


class HostTierTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # Every batch here is small: translate its entries on the host, as a
    # large batch is (test_against_the_numpy_model also runs the map's).
    patch = mock.patch.object(host_tier, "HOST_ENTRIES_MIN", 0)
    patch.start()
    self.addCleanup(patch.stop)

  def check_equal(self, host, device, hstate, dstate, msg):
    test_util.assert_bits_equal(self, host.table_arrays(hstate)["t"],
                                device.table_arrays(dstate)["t"], msg)
    for h, d in zip(host.optimizer_arrays(hstate)["t"],
                    device.optimizer_arrays(dstate)["t"]):
      if d is not None:
        test_util.assert_bits_equal(self, h, d, msg)

  @parameterized.named_parameters(
      ("column_lru_lazy_adagrad", "column", "lru",
       pe.RowwiseAdagrad(0.1, half_life_steps=3.0, lazy=True), jnp.float32),
      ("row_lfu_adam_bf16", "row", "lfu", pe.Adam(0.05), jnp.bfloat16),
      ("replicated_lru_sgd", "replicated", "lru", pe.Sgd(0.1), jnp.float32),
      # The Mosaic backend's stored rows (words, 128 lanes) in the cache.
      # (One rank: the interpreter's simulated devices wait for each other.)
      ("column_lru_adam_bf16_mosaic", "column", "lru", pe.Adam(0.05),
       jnp.bfloat16, "mosaic_tpu_interpret", 2, 1),
      # The host's row copies in chunks on threads, as large batches do.
      ("row_lru_adagrad_threaded", "row", "lru", pe.RowwiseAdagrad(0.1),
       jnp.float32, "xla", 4, 2, 2),
  )
  def test_steps_equal_the_device_table(self, placement, policy, optimizer,
                                        dtype, backend="xla", steps=4,
                                        ranks=2, parallel_rows=None):
    """Lookups, tables and optimizer state, bit for bit, every step, with
    evictions (and copies back to host memory) in every step after the
    first."""
    if parallel_rows:
      self.enter_context(mock.patch.object(host_memory, "PARALLEL_ROWS",
                                           parallel_rows))
      self.enter_context(mock.patch.object(host_memory, "_threads",
                                           return_value=2))
    host, device = collections(placement, policy, optimizer, dtype,
                               cache_rows=32 if placement == "row" else 28,
                               backend=backend, ranks=ranks)
    hstate, dstate = same_start(host, device)
    written = 0
    for step, (batch, _) in enumerate(batches(host, steps)):
      hstate, stats = host.prefetch(hstate, batch)
      stats = stats["t"]
      self.assertEqual(stats.fetched, stats.rows - stats.hits)
      self.assertGreater(stats.read_seconds, 0.0)  # some rows were fetched
      self.assertLessEqual(stats.read_seconds + stats.wait_seconds,
                           stats.seconds)
      if step:
        self.assertGreater(stats.evicted, 0, f"step {step}")
      written += stats.written_back
      hemb = host.lookup(hstate, batch)
      demb = device.lookup(dstate, batch)
      for name in demb:
        test_util.assert_bits_equal(self, hemb[name], demb[name],
                                    f"step {step} {name}")
      grads = grads_for(demb, step)
      hstate, hstats = host.apply_gradients(hstate, batch, grads)
      dstate, dstats = device.apply_gradients(dstate, batch, grads)
      self.assertEqual(int(hstats["stack0"].num_overflow), 0)
      self.assertEqual(int(hstats["stack0"].valid), 1)
      # The batch's rows in another order: the same sum to f32 rounding.
      np.testing.assert_allclose(hstats["stack0"].norm,
                                 dstats["stack0"].norm, rtol=1e-6)
      self.check_equal(host, device, hstate, dstate, f"step {step}")
    self.assertGreater(written, 0)

  @parameterized.named_parameters(
      ("column_adam_bf16", "column", pe.Adam(0.05), jnp.bfloat16),
      ("row_lazy_adagrad", "row",
       pe.RowwiseAdagrad(0.1, half_life_steps=3.0, lazy=True), jnp.float32))
  def test_host_dir_trains_as_host_memory(self, placement, optimizer, dtype):
    """A table whose rows and slots live in memory-mapped files trains as
    one in host memory, bit for bit, from `init` and from arrays; its
    `table_arrays` given back take over the same files with no copy."""
    directory = self.enter_context(tempfile.TemporaryDirectory())
    plain, _ = collections(placement, optimizer=optimizer, dtype=dtype,
                           cache_rows=32)
    mapped, _ = collections(placement, optimizer=optimizer, dtype=dtype,
                            cache_rows=32, host_dir=directory)
    for start in ("init", "arrays"):
      if start == "init":
        pstate = plain.init(jax.random.key(3))
        mstate = mapped.init(jax.random.key(3))
      else:
        arrays = (plain.table_arrays(pstate), plain.optimizer_arrays(pstate))
        pstate = plain.state_from_arrays(*arrays)
        mstate = mapped.state_from_arrays(*arrays)
      seed = 0 if start == "init" else 1
      for step, (batch, _) in enumerate(batches(plain, 3, seed=seed)):
        pstate, _ = plain.prefetch(pstate, batch)
        mstate, stats = mapped.prefetch(mstate, batch)
        if step:
          self.assertGreater(stats["t"].evicted, 0)
        grads = grads_for(plain.lookup(pstate, batch), step)
        pstate, _ = plain.apply_gradients(pstate, batch, grads)
        mstate, _ = mapped.apply_gradients(mstate, batch, grads)
      self.check_equal(mapped, plain, mstate, pstate, start)
    host = mstate.host.stacks["stack0"]
    spec = mapped.tables["t"]
    for part, array in [("rows", host.table)] + list(host.slots.items()):
      self.assertIsInstance(array, np.memmap)
      self.assertEqual(os.path.getsize(os.path.join(directory, f"t.{part}")),
                       array.nbytes)
    # The state's own arrays back: the same files, no copy made.
    tables = mapped.table_arrays(mstate)
    with mock.patch.object(host_memory, "chunk_rows",
                           side_effect=AssertionError("copied")):
      again = mapped.state_from_arrays(tables, mapped.optimizer_arrays(mstate))
    self.assertTrue(os.path.samefile(
        again.host.stacks["stack0"].table.filename,
        host_memory.host_path(spec, "rows")))
    self.check_equal(mapped, plain, again, pstate, "again")

  def test_host_dir_files_are_mapped_for_random_rows(self):
    """A `host_dir` file's mapping carries MADV_RANDOM (Linux shows it as
    "rr" in /proc/self/smaps), so a row's page fault reads that page
    alone; MAP_ADVICE=None leaves the OS's default."""
    if not os.path.exists("/proc/self/smaps"):
      self.skipTest("no /proc/self/smaps on this platform")

    def vm_flags(path):
      with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        lines = f.read().splitlines()
      for i, line in enumerate(lines):
        if line.endswith(" " + path):
          flags = next(l for l in lines[i + 1:] if l.startswith("VmFlags:"))
          return flags.split()[1:]
      raise AssertionError(f"{path} is not mapped")

    with tempfile.TemporaryDirectory() as directory:
      for advice, advised in (("random", True), (None, False)):
        spec = pe.TableSpec(f"t{advised}", 1000, 8,
                            optimizer=pe.RowwiseAdagrad(0.1),
                            storage="host", cache_rows=16,
                            host_dir=directory)
        with mock.patch.object(host_memory, "MAP_ADVICE", advice):
          rows = host_memory.host_array(spec, "rows", (1000, 8), np.float32)
          path = os.path.realpath(host_memory.host_path(spec, "rows"))
          self.assertEqual("rr" in vm_flags(path), advised, advice)
        del rows

  def test_host_dir_errors_before_allocating(self):
    directory = self.enter_context(tempfile.TemporaryDirectory())
    missing, _ = collections(host_dir=os.path.join(directory, "absent"))
    with self.assertRaisesRegex(pe.InputError, "which is not a directory; "
                                "create it"):
      missing.init(jax.random.key(0))
    mapped, _ = collections(host_dir=directory)
    need = mapped.plan.stacks[0].host_bytes()
    never = mock.patch.object(host_memory, "init_table",
                              side_effect=AssertionError("allocated"))
    full = mock.patch.object(shutil, "disk_usage", return_value=(
        types.SimpleNamespace(total=10 * need, used=9 * need, free=need - 1)))
    with never, full, self.assertRaisesRegex(
        pe.InputError, r"the host-tier tables \['t'\] need 0.00 GB of files "
        r"in their host_dir and its disk has 0.00 GB free"):
      mapped.init(jax.random.key(0))
    # The arrays given are written to the files even without a copy.
    tables = {"t": np.zeros((60, 8), np.float32)}
    for copy in (True, False):
      with full, self.assertRaisesRegex(pe.InputError, "state_from_arrays: "
                                        r"the host-tier tables \['t'\]"):
        mapped.state_from_arrays(tables, copy=copy)
    # Host memory is not what a host_dir table takes.
    with mock.patch.object(host_memory, "available_host_bytes",
                           return_value=0):
      mapped.init(jax.random.key(0))

  @parameterized.parameters((True, "column"), (False, "column"),
                            (True, "row"))
  def test_a_row_on_its_way_back_is_taken_back_or_waited_for(self, take,
                                                             placement):
    """Write-backs land on a thread of their own, here late: a prefetch
    that fetches a row still on its way to host memory takes it from the
    newest group's rows on the devices (`take`), or waits for it to land
    (a row only in an older group; here every one, with `from_newest`
    made to find none), and the steps still equal the device table's bit
    for bit."""
    # pylint: disable=protected-access
    land = write_back.WriteBacks._land
    wait = write_back.WriteBacks.wait_for
    newest = write_back.WriteBacks.from_newest
    waits, taken = [], []

    def from_newest(write_backs, rows, size):
      got = newest(write_backs, rows, size) if take else None
      taken.append(0 if got is None else int((got[0] >= 0).sum()))
      return got

    def late(write_backs, *args):
      time.sleep(0.2)
      land(write_backs, *args)

    def wait_for(write_backs, rows):
      waits.append(write_backs.on_the_way(rows))
      wait(write_backs, rows)

    self.enter_context(mock.patch.object(write_back.WriteBacks, "_land",
                                         late))
    self.enter_context(mock.patch.object(write_back.WriteBacks, "wait_for",
                                         wait_for))
    self.enter_context(mock.patch.object(write_back.WriteBacks,
                                         "from_newest", from_newest))
    # (A row-placed cache's part must hold a rank's rows of a batch.)
    host, device = collections(placement, "lru", pe.RowwiseAdagrad(0.1),
                               cache_rows=28 if placement == "column" else 32)
    hstate, dstate = same_start(host, device)
    # Two batches in turn: each evicts rows the other reads next.
    pair = [b for b, _ in batches(host, 2, seed=3)]
    waited = []
    for step, batch in enumerate(pair * 3):
      hstate, stats = host.prefetch(hstate, batch)
      waited.append(stats["t"].wait_seconds)
      self.assertLessEqual(stats["t"].read_seconds + waited[-1],
                           stats["t"].seconds)
      # (Not `table_arrays` between steps: it flushes, waiting for all.)
      demb = device.lookup(dstate, batch)
      for name, got in host.lookup(hstate, batch).items():
        test_util.assert_bits_equal(self, got, demb[name],
                                    f"step {step} {name}")
      grads = grads_for(demb, step)
      hstate, _ = host.apply_gradients(hstate, batch, grads)
      dstate, _ = device.apply_gradients(dstate, batch, grads)
    if take:
      self.assertGreater(max(taken), 0)  # rows were taken back
    else:
      self.assertIn(True, waits)  # some fetch met a row on its way
      self.assertGreater(max(waited), 0.0)  # and the stats say how long
    self.assertEqual(waited[0], 0.0)  # nothing was on its way yet
    self.check_equal(host, device, hstate, dstate, "end")

  @parameterized.parameters(0, 10**9)
  def test_against_the_numpy_model(self, entries_min):
    """With the entries translated on the host (0) and by the device's
    cache map (a batch under `HOST_ENTRIES_MIN`)."""
    host_tier.HOST_ENTRIES_MIN = entries_min  # setUp's patch restores it
    host, _ = collections("column", "lfu", pe.RowwiseAdagrad(0.1),
                          cache_rows=30)
    state = test_util.random_state(host, 3)
    model = placements_test.Model(host, {
        "t": np.array(host.table_arrays(state)["t"])})
    for step, (batch, raw) in enumerate(batches(host, 3, seed=5)):
      state, stats = host.prefetch(state, batch)
      self.assertEqual(state.stacks["stack0"].cache_entries is None,
                       entries_min > 0)
      if step:
        self.assertGreater(stats["t"].evicted, 0)
      embs = host.lookup(state, batch)
      # Lookups of the current table are exact (the tables themselves
      # follow the model to the rounding of sums in another order).
      want = placements_test.Model(host, {
          "t": np.array(host.table_arrays(state)["t"])}).lookup(raw)
      for name in embs:
        np.testing.assert_array_equal(np.asarray(embs[name]), want[name],
                                      f"step {step} {name}")
      grads = grads_for(embs, step)
      state, _ = host.apply_gradients(state, batch, grads)
      model.step(raw, grads)
      placements_test.assert_tables_close(
          host.table_arrays(state)["t"], model.models["t"].table,
          f"step {step}")

  @parameterized.parameters("lru", "lfu")
  def test_pipelined_trainer_equals_the_device_table(self, policy):
    """One step stale: the rows of the batches whose update is in flight
    stay in the cache while others are evicted, and nothing is lost."""
    host, device = collections("column", policy, cache_rows=70, vocab=120)
    hstate, dstate = same_start(host, device, seed=1)

    def loss_fn(params, emb, batch):
      del batch
      x = emb["seq"].sum(1) + emb["bag"] + emb["wbag"]
      return jnp.sum((x @ params["w"]) ** 2), ()

    params = {"w": jnp.full((8, 1), 0.1)}
    data = [b for b, _ in batches(host, 8, seed=2)]
    trainers = [pe.Trainer(c, loss_fn, optax.sgd(0.1))
                for c in (host, device)]
    hrun = trainers[0].init(hstate, params, data[0])
    drun = trainers[1].init(dstate, jax.tree.map(jnp.copy, params), data[0])
    dstep = jax.jit(trainers[1].step, donate_argnums=0)
    for t, batch in enumerate(data):
      after = data[min(t + 1, len(data) - 1)]
      hrun, hm = trainers[0].step(hrun, batch, after)
      drun, dm = dstep(drun, batch, after)
      test_util.assert_bits_equal(self, hm.loss, dm.loss, f"step {t}")
      self.assertIsNone(dm.cache)
      if 2 <= t < len(data) - 1:  # the first batches fill the cache
        self.assertGreater(hm.cache["t"].evicted, 0, f"step {t}")
      if t == 3:  # an evaluation between steps keeps the updates in flight
        embedding, _ = host.prefetch(hrun.embedding, data[0], train=False)
        hrun = hrun._replace(embedding=embedding)
        want = device.lookup(drun.embedding, data[0])
        for name, got in host.lookup(hrun.embedding, data[0]).items():
          test_util.assert_bits_equal(self, got, want[name], "evaluation")
    hrun, _ = trainers[0].flush(hrun)
    drun, _ = trainers[1].flush(drun)
    self.check_equal(host, device, hrun.embedding, drun.embedding, "end")

  def test_the_trainer_checks_overflow_on_the_host_a_step_late(self):
    """The host-tier step has no host callback in it (the devices would
    wait for the host, busy with the next prefetch): the next step, or
    flush, raises for the step before; nothing is dropped silently."""
    spec = dict(optimizer=pe.Sgd(0.1), max_unique=2)
    host = pe.EmbeddingCollection(
        [pe.TableSpec("t", 60, 8, storage="host", cache_rows=40, **spec)],
        [pe.FeatureSpec("seq", "t")], test_util.mesh({"x": 2}), "x")

    def loss_fn(params, emb, batch):
      del batch
      return jnp.sum((emb["seq"].sum(1) @ params["w"]) ** 2), ()

    fits = {"seq": np.array([[1, 1, 2]] * B, np.int32)}  # 2 distinct rows
    over = {"seq": np.arange(B * SEQ, dtype=np.int32).reshape(B, SEQ)}
    for pipelined in (True, False):
      trainer = pe.Trainer(host, loss_fn, optax.sgd(0.1),
                           pipelined=pipelined)
      params = lambda: {"w": jnp.full((8, 1), 0.1)}
      run = trainer.init(host.init(jax.random.key(0)), params(), fits)
      run, _ = trainer.step(run, fits, fits)
      run, _ = trainer.step(run, fits, fits)  # nothing over the cap
      compiled = trainer._jitted_step.lower(  # pylint: disable=protected-access
          run, fits, fits).as_text()
      self.assertFalse("callback" in compiled,
                       "a host callback in the host-tier step")
      # A pipelined step looks up its next batch, and the step after the
      # one that trains it applies its update; the step after raises.
      steps = ([(fits, over), (over, fits), (fits, fits)] if pipelined
               else [(over, fits)])
      for batch, after in steps:
        run, _ = trainer.step(run, batch, after)
      with self.assertRaisesRegex(pe.UniqueOverflowError, r"max_unique"):
        trainer.step(run, fits, fits)
      # Flush raises for the last step, or applies the update over the cap.
      run = trainer.init(host.init(jax.random.key(0)), params(), fits)
      for batch, after in steps[:2]:
        run, _ = trainer.step(run, batch, after)
      with self.assertRaisesRegex(pe.UniqueOverflowError, r"max_unique"):
        trainer.flush(run)
      # Under jit, flush keeps the callback (nothing to read on the host).
      run = trainer.init(host.init(jax.random.key(0)), params(), fits)
      run, _ = trainer.step(run, fits, fits)
      run, stats = jax.jit(trainer.flush)(run)
      if pipelined:
        self.assertEqual(int(stats["stack0"].num_overflow), 0)

  def test_a_cache_too_small_is_an_error_before_anything_changes(self):
    host, _ = collections("row", cache_rows=8)
    state = test_util.random_state(host)
    batch, _ = batches(host, 1)[0]
    directory = [c.row_slot.copy() for c in
                 state.host.stacks["stack0"].caches]
    with self.assertRaisesRegex(
        pe.InputError, r"host-tier table 't' needs \d+ rows in its device "
        r"cache at once .* on rank \d, whose part of the row-placed cache "
        r"holds ceil\(cache_rows / 2\) = 4. Raise cache_rows to at least"):
      host.prefetch(state, batch)
    for before, cache in zip(directory, state.host.stacks["stack0"].caches):
      np.testing.assert_array_equal(cache.row_slot, before)

  def test_tables_larger_than_the_host_are_an_error_before_allocating(self):
    host, _ = collections("row", optimizer=pe.Adam(0.1), cache_rows=28)
    need = host.plan.stacks[0].host_bytes()
    arrays = test_util.random_state(host)
    tables = {"t": np.asarray(host.table_arrays(arrays)["t"])}
    short = mock.patch.object(host_memory, "available_host_bytes",
                              return_value=need - 1)
    never = mock.patch.object(host_memory, "init_table",
                              side_effect=AssertionError("allocated"))
    message = (r"pallas_emb coll.init: the host-tier tables need 0.00 GB of "
               r"host memory \(t 0.00 GB: rows and optimizer state\) and this "
               r"host has 0.00 GB available; give them fewer rows")
    with short, never, self.assertRaisesRegex(pe.InputError, message):
      host.init(jax.random.key(0))
    with short, self.assertRaisesRegex(pe.InputError, "state_from_arrays"):
      host.state_from_arrays(tables)
    with short:  # the arrays given become the host memory: nothing new
      host.state_from_arrays(tables, copy=False)
    with mock.patch.object(host_memory, "available_host_bytes",
                           return_value=need):
      host.state_from_arrays(tables)
    have = host_memory.available_host_bytes()
    self.assertTrue(have is None or have > 0, have)

  def test_the_pipelined_trainer_needs_three_batches_resident(self):
    host, _ = collections("column", cache_rows=40)
    data = [b for b, _ in batches(host, 3, seed=4)]
    loss = lambda p, emb, b: (sum(jnp.sum(e) for e in emb.values()), ())
    trainer = pe.Trainer(host, loss, optax.sgd(0.1))
    run = trainer.init(test_util.random_state(host), {}, data[0])
    with self.assertRaisesRegex(pe.InputError,
                                r"2 batches still in flight"):
      for t in range(2):
        run, _ = trainer.step(run, data[t], data[t + 1])
    with self.assertRaisesRegex(pe.InputError, r"call trainer.step\("):
      jax.jit(trainer.step)(run, data[0], data[1])

  def test_rows_not_prefetched_are_never_silent(self):
    host, _ = collections("column")
    state = test_util.random_state(host)
    batch, _ = batches(host, 1)[0]
    with self.assertRaisesRegex(pe.InputError,
                                r"collection lookup: \d+ rows of host-tier "
                                r"table 't' .* coll.prefetch"):
      host.lookup(state, batch)
    # Under jit nothing is checked before; the update counts them.
    embs, routing = jax.jit(host.lookup_and_route)(state, batch)
    _, stats = host.apply_gradients(state, routing, grads_for(embs, 0))
    self.assertGreater(int(stats["stack0"].num_overflow), 0)
    with self.assertRaisesRegex(pe.UniqueOverflowError,
                                r"not in its device cache"):
      host.raise_if_overflow(stats)

  def test_checkpoints_move_between_host_and_device_tables(self):
    host, device = collections("row", cache_rows=28)
    hstate, _ = same_start(host, device)
    data = batches(host, 3, seed=6)
    for step, (batch, _) in enumerate(data[:2]):
      hstate, _ = host.prefetch(hstate, batch)
      embs = host.lookup(hstate, batch)
      hstate, _ = host.apply_gradients(hstate, batch, grads_for(embs, step))
    with tempfile.TemporaryDirectory() as d:
      with self.assertRaisesRegex(pe.CheckpointError, r"save_collection"):
        checkpoint.save(d, hstate, step=0)
      checkpoint.save_collection(d, host, hstate, step=1)
      dstate, _ = checkpoint.restore_collection(d, device)
      self.check_equal(host, device, hstate, dstate, "host -> device")
      checkpoint.save_collection(d, device, dstate, step=2)
      back, _ = checkpoint.restore_collection(d, host, step=2)
      self.check_equal(host, device, back, dstate, "device -> host")
    # Training goes on from the restored host tier as on the device.
    batch, _ = data[2]
    back, _ = host.prefetch(back, batch)
    embs = device.lookup(dstate, batch)
    back, _ = host.apply_gradients(back, batch, grads_for(embs, 2))
    dstate, _ = device.apply_gradients(dstate, batch, grads_for(embs, 2))
    self.check_equal(host, device, back, dstate, "after restore")

  def test_checkpoints_restore_into_host_dir_files(self):
    """A host_dir table's checkpoint is read straight into its files, a
    chunk at a time, and they become the restored state's host memory."""
    directory = self.enter_context(tempfile.TemporaryDirectory())
    host, device = collections("column", cache_rows=28,
                               optimizer=pe.Adam(0.05), dtype=jnp.bfloat16)
    mapped, _ = collections("column", cache_rows=28, optimizer=pe.Adam(0.05),
                            dtype=jnp.bfloat16, host_dir=directory)
    hstate, dstate = same_start(host, device, seed=9)
    for step, (batch, _) in enumerate(batches(host, 2, seed=10)):
      hstate, _ = host.prefetch(hstate, batch)
      grads = grads_for(host.lookup(hstate, batch), step)
      hstate, _ = host.apply_gradients(hstate, batch, grads)
      dstate, _ = device.apply_gradients(dstate, batch, grads)
    reads = []
    real_read = orbax_io._read_into  # pylint: disable=protected-access

    async def read_into(ocp, ts, info, out):
      reads.append(out.filename)
      return await real_read(ocp, ts, info, out)

    with tempfile.TemporaryDirectory() as d:
      checkpoint.save_collection(d, host, hstate, step=1)
      checkpoint.save_collection(d, device, dstate, step=2)
      for step, want in ((1, hstate), (2, dstate)):
        reads.clear()
        # 7 rows a chunk: 60 rows in 9 chunks, the last one short.
        with mock.patch.object(host_memory, "chunk_rows", return_value=7), \
            mock.patch.object(orbax_io, "_read_into", read_into):
          back, _ = checkpoint.restore_collection(d, mapped, step=step)
        spec = mapped.tables["t"]
        self.assertEqual(sorted(reads), sorted(
            host_memory.host_path(spec, part) for part in ("rows", "m", "v")))
        self.assertTrue(os.path.samefile(
            back.host.stacks["stack0"].table.filename,
            host_memory.host_path(spec, "rows")))
        self.check_equal(mapped, device if step == 2 else host, back, want,
                         f"step {step}")

  def test_serving_copy_equals_the_device_tables(self):
    host, device = collections("row", cache_rows=28)
    hstate, dstate = same_start(host, device, seed=7)
    batch, _ = batches(host, 1, seed=8)[0]
    for dtype in ("int8", "bfloat16"):
      hserve, dserve = host.quantize(hstate, dtype), device.quantize(
          dstate, dtype)
      for h, d in zip(jax.tree.leaves(hserve.stacks),
                      jax.tree.leaves(dserve.stacks)):
        test_util.assert_bits_equal(self, h, d, dtype)
      hemb, demb = host.lookup(hserve, batch), device.lookup(dserve, batch)
      for name in demb:
        test_util.assert_bits_equal(self, hemb[name], demb[name], dtype)

  def test_plan_bytes_are_the_state_arrays(self):
    host, _ = collections("row", optimizer=pe.Adam(0.1), cache_rows=28)
    state = test_util.random_state(host)
    stack = host.plan.stacks[0]
    shard_bytes = lambda x: x.addressable_shards[0].data.nbytes
    got = jax.tree.leaves(state.stacks["stack0"])
    table, rest = shard_bytes(got[0]), sum(shard_bytes(x) for x in got[1:])
    self.assertEqual(stack.rank_bytes(), (table, rest))
    self.assertEqual(stack.host_bytes(), sum(
        x.nbytes for x in jax.tree.leaves(host.table_arrays(state))) + sum(
            x.nbytes for x in jax.tree.leaves(host.optimizer_arrays(state))
            if isinstance(x, np.ndarray)))

  @parameterized.parameters("column", "row")
  def test_the_prefetch_translates_the_entries_on_the_host(self, placement):
    """The prefetch gives each entry its cache row (the numpy model: the
    cache map, read back, at the entry's row), so the lookup reads no map
    (one of -1 changes nothing); a batch of the same shape other than the
    last prefetched goes through the map, with the same result."""
    # Two batches read at most 88 rows: the cache holds both.
    host, _ = collections(placement, cache_rows=100, vocab=200)
    state = test_util.random_state(host)
    (first, _), (second, _) = batches(host, 2)
    state, _ = host.prefetch(state, first)
    stack = state.stacks["stack0"]
    cache_map = np.array(stack.cache_map)
    for name, value in first.items():
      ids = value.ids if isinstance(value, pe.Bag) else value
      keys = host_batches.host_keys(ids, 200, 0)
      rows = np.where(keys < 0, ~keys, keys)
      cache, got_rows = (np.asarray(x) for x in stack.cache_entries[name])
      np.testing.assert_array_equal(got_rows, rows)
      np.testing.assert_array_equal(cache, cache_map[rows])
      self.assertTrue((cache >= 0).all())
    want = host.lookup(state, first)
    blind = pe.CollectionState(
        {"stack0": stack._replace(cache_map=jnp.full_like(stack.cache_map,
                                                          -1))},
        state.fingerprint, state.host)
    got = [host.lookup(blind, first)]
    # The next prefetch donates the cache: `blind` shares it, so it is done.
    state, _ = host.prefetch(state, second)
    got += [host.lookup(state, first), jax.jit(host.lookup)(state, first)]
    for embs in got:
      for name, emb in embs.items():
        np.testing.assert_array_equal(emb, want[name], name)
    # The map's gather only runs where an entry is not the host's: a
    # branch, which lowers for a TPU.
    lowered = jax.jit(host.lookup_and_route).trace(state, first).lower(
        lowering_platforms=("tpu",)).as_text()
    self.assertIn("stablehlo.case", lowered)

  def test_the_swap_writes_the_cache_in_place(self):
    """The prefetch's write program updates the donated cache arrays in
    place: no copy of a cache array (in one program with the evicted
    rows' reads, XLA copied each of them twice), and a group of evictions
    does not pad the rows sent to the devices."""
    host, _ = collections("column", cache_rows=28)
    state = host.init(jax.random.key(0))
    stack = state.host.stacks["stack0"]
    writes, original = [], stack._write  # pylint: disable=protected-access
    def recording(*args):
      writes.append(jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=x.sharding), args))
      return original(*args)
    stack._write = recording  # pylint: disable=protected-access
    fetched = []
    for step, (batch, _) in enumerate(batches(host, 3)):
      state, stats = host.prefetch(state, batch)
      fetched.append(stats["t"].fetched)
      grads = grads_for(host.lookup(state, batch), step)
      state, _ = host.apply_gradients(state, batch, grads)
    self.assertLen(writes, 3)
    arrays, _, write_slots, values = writes[-1][:4]
    self.assertEqual(values[0].shape[0], write_slots.shape[0])
    self.assertEqual(write_slots.shape[0],
                     host_tier._bucket(fetched[-1]))  # pylint: disable=protected-access
    # The write that takes rows back from a write-back group's rows on
    # the devices (a group of 8 rows here) is in place too.
    leaving = tuple(jax.ShapeDtypeStruct((8,) + v.shape[1:], v.dtype,
                                         sharding=v.sharding) for v in values)
    for compiled in (
        original.lower(*writes[-1]).compile().as_text(),
        stack._write_taking_back.lower(  # pylint: disable=protected-access
            *writes[-1], leaving, write_slots).compile().as_text()):
      for array in arrays:
        shard = array.sharding.shard_shape(array.shape)
        shape = ",".join(map(str, shard))
        copies = [line for line in compiled.splitlines()
                  if f"[{shape}]" in line and " copy(" in line]
        self.assertEqual(copies, [], shape)

  def test_host_memory_is_freed_with_the_last_state(self):
    """jit keeps the static data of what it compiled for: it must not keep
    a host tier (its table in host memory) once no state holds it."""
    host, _ = collections("column", cache_rows=40)
    state = host.init(jax.random.key(0))
    for batch, _ in batches(host, 2):
      state, _ = host.prefetch(state, batch)
      grads = grads_for(host.lookup(state, batch), 0)
      state, _ = host.apply_gradients(state, batch, grads)
    structure = jax.tree.structure(state)
    tier = weakref.ref(state.host)
    del state, batch, grads
    gc.collect()
    self.assertIsNone(tier())
    with self.assertRaisesRegex(pe.InputError, "host memory was gone"):
      jax.tree.unflatten(structure, [0] * structure.num_leaves)

  def test_layers_refuse_host_tables(self):
    from pallas_emb import flax as pe_flax  # pylint: disable=g-import-not-at-top
    host, _ = collections("column")
    batch, _ = batches(host, 1)[0]
    with self.assertRaisesRegex(pe.InputError, r"host-tier tables \['t'\]"):
      pe_flax.EmbeddingCollection(host).init(jax.random.key(0), batch)


def _bench_host_tier(code: str) -> list[str]:
  """The lines `code` prints, run after `from bench import host_tier` in a
  process of its own (the bench defines absl flags)."""
  return subprocess.run(
      [sys.executable, "-c", "from bench import host_tier\n" + code],
      check=True, capture_output=True, text=True).stdout.splitlines()


class BenchTest(absltest.TestCase):

  def test_file_writes_bench_runs_small(self):
    """`bench.host_file_writes`: both fills, their rows' bytes, and no
    file left behind."""
    if not os.path.exists("/proc/vmstat"):
      self.skipTest("no /proc/vmstat on this platform")
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program(
          "bench.host_file_writes", ["--rows=4096", "--writes=100",
                                     f"--dir={tmp}"], tmp)
      self.assertEqual([r["fill"] for r in doc["results"]],
                       ["sequential", "random"])
      for r in doc["results"]:
        self.assertEqual(r["row_bytes"], 100 * 64 * 4)
        self.assertGreaterEqual(r["written_bytes"], 0)
        self.assertGreater(r["fill_s"], 0)
      self.assertIn("filled under MADV_RANDOM", stdout)
      self.assertEqual(os.listdir(tmp), ["out.json"])

  def test_rows_bench_runs_small(self):
    """`bench.host_rows`: both kinds' fills, reads and writes timed, and
    no file left behind."""
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program(
          "bench.host_rows", ["--rows=4096", "--misses=100", "--repeats=2",
                              f"--dir={tmp}"], tmp)
      self.assertEqual([r["kind"] for r in doc["results"]],
                       ["memory", "file"])
      for r in doc["results"]:
        self.assertLen(r["read_ms"], 2)
        self.assertLen(r["write_ms"], 2)
        self.assertEqual(r["read_later_ms"], r["read_ms"][1])
        self.assertGreater(r["fill_s"], 0)
      self.assertIn("file: [4096, 64] f32 filled in", stdout)
      self.assertEqual(os.listdir(tmp), ["out.json"])

  def test_check_script_runs_small(self):
    """`SMOKE=1 FILES=1 PROFILE=2 bash bench/host_tier_check.sh`: the
    host's facts, both benches' results in its logs (the TPU runtime's
    transfer buffer set, the steps profiled), and its files removed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
      log = os.path.join(tmp, "log")
      done = subprocess.run(
          ["bash", os.path.join(root, "bench", "host_tier_check.sh")],
          env=dict(os.environ, SMOKE="1", FILES="1", PROFILE="2", LOG=log,
                   DIR=tmp, PYTHON=sys.executable),
          capture_output=True, text=True, timeout=300, check=False)
      self.assertEqual(done.returncode, 0, done.stderr[-2000:])
      self.assertIn("cores: ", done.stdout)
      self.assertIn("host_tier_check: done", done.stdout)
      with open(os.path.join(log, "host_rows.json")) as f:
        self.assertEqual([r["kind"] for r in json.load(f)["results"]],
                         ["memory", "file"])
      with open(os.path.join(log, "host_tier.json")) as f:
        doc = json.load(f)
      self.assertEqual(doc["host_dir"],
                       os.path.join(tmp, "host_tier_check_files"))
      self.assertEqual(doc["tpu_premapped_buffer_size"],
                       os.environ.get("TPU_PREMAPPED_BUFFER_SIZE",
                                      "1073741824"))
      (record,) = doc["results"]
      self.assertIn("device_ms_per_step", record["host"])
      self.assertEqual(record["bag"], 4)
      self.assertIn("host_over_device", record)
      self.assertAlmostEqual(
          record["host_over_device_mean"],
          record["host"]["mean_step_s_without_compiles"]
          / record["device"]["mean_step_s_without_compiles"])
      self.assertEqual(sorted(os.listdir(tmp)), ["log"])

  def test_bench_runs_small(self):
    """`python -m bench.host_tier` at tiny sizes: every figure it reports."""
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program("bench.host_tier", [
          "--rows=20000", "--width=8", "--ids=64", "--bag=4",
          "--cache_rows=2048", "--steps=2", "--warmup=2",
          "--compare_device_rows=2000", "--link_mb=1",
          "--memory_kinds_rows=1000", "--profile_steps=2",
          "--host_profile_steps=2"], tmp)
    self.assertIn("host tier / device", stdout)
    self.assertGreater(doc["link"]["to_device_gbps"], 0)
    (record,) = doc["results"]
    host = record["host"]
    self.assertLessEqual(host["mean_step_s_without_compiles"],
                         host["mean_step_s"])
    self.assertGreaterEqual(host["compiled_programs"], 0)
    self.assertIn("device programs, ms a step over 2 traced steps", stdout)
    self.assertEqual(set(host["device_ms_per_step"]), {"programs", "ops"})
    for key in ("step_s", "step_waited_s", "prefetch_s", "hit_rate",
                "id_hit_rate", "bytes_to_device_per_step",
                "bytes_to_host_per_step", "fetched_per_step"):
      self.assertIn(key, host)
    self.assertBetween(host["hit_rate"], 0, 1)
    self.assertLen(host["prefetch_ms"], 2)
    self.assertLen(host["evicted"], 2)
    self.assertEqual(host["host_profile"], {})  # no group: the cache fills
    for side in (host, record["device"]):
      self.assertLen(side["steps_ms"], 2)
      self.assertAlmostEqual(1e3 * side["step_s"],
                             np.median(side["steps_ms"]), delta=0.01)
    # 2 steps of at most 256 distinct rows cannot fill 2,048 cache rows.
    self.assertTrue(host["filling"])
    self.assertIn("the cache was still filling", stdout)
    self.assertGreater(record["device"]["step_s"], 0)
    self.assertIn("numpy_device_put_s", record["gathers"])


  def test_bench_names_the_slow_steps(self):
    """`bench.host_tier`'s line on the steps over 1.5x the median, against
    a hand count of made-up steps (in a process of its own: the bench
    defines absl flags)."""
    out = _bench_host_tier(
        "h = dict(steps_ms=[10, 11, 30, 40, 9], step_s=0.0105,\n"
        "         prefetch_ms=[2, 3, 20, 8, 2], waited_ms=[0, 0, 0, 6, 0],\n"
        "         evicted=[0, 0, 5, 0, 0])\n"
        "print(host_tier._slow_steps(h))\n"
        "print(repr(host_tier._slow_steps(dict(h, step_s=0.04))))\n")
    self.assertEqual(out, [
        "2 of 5 timed steps over 1.5x the median: 35.0 ms on average, "
        "their prefetch 14.0 ms on the host, of it 3.0 waiting for "
        "write-backs; 1 of them evicted", "''"])

  def test_bench_names_the_host_time_grown_after_evictions(self):
    """`bench.host_tier`'s host profile against a hand count of made-up
    steps: step 2 evicts; steps 0, 1, 6 and 7 are quiet (no eviction in
    them nor in the 3 steps before)."""
    out = _bench_host_tier(
        "f = [0.010, 0.012, 0.030, 0.010, 0.011, 0.010, 0.008, 0.010]\n"
        "profiles = [dict(f=x) for x in f]\n"
        "profiles[3]['g'] = 0.005\n"
        "print(host_tier._after_evictions(profiles, [0, 0, 5, 0, 0, 0, 0, 0],"
        " top=2))\n"
        "print(host_tier._after_evictions(profiles, [0] * 8))\n")
    quiet = (0.010 + 0.012 + 0.008 + 0.010) / 4
    want = {"+0": {"steps": 1, "ms": {"f": round(1e3 * (0.030 - quiet), 2)}},
            "+1": {"steps": 1, "ms": {"g": 5.0,
                                      "f": round(1e3 * (0.010 - quiet), 2)}},
            "+2": {"steps": 1, "ms": {"f": round(1e3 * (0.011 - quiet), 2)}},
            "+3": {"steps": 1, "ms": {"f": round(1e3 * (0.010 - quiet), 2)}}}
    self.assertEqual(out, [repr(want), "{}"])

  def test_checkpoint_bench_runs_small(self):
    """`python -m bench.host_checkpoint` at tiny sizes (table in files)."""
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program("bench.host_checkpoint", [
          "--rows=20000", "--width=8"], tmp)
    self.assertIn("restore:", stdout)
    self.assertTrue(doc["host_dir"])
    self.assertEqual(doc["table_bytes"], 20000 * 8 * 4)
    for what in ("save", "restore"):
      self.assertGreater(doc[what]["seconds"], 0)
      self.assertGreaterEqual(doc[what]["anonymous_growth_bytes"], 0)

  def test_row_cache_bench_runs_small(self):
    """`python -m bench.row_cache` at tiny sizes, beside itself as the
    baseline: the same batches, so the same directory at the end."""
    with tempfile.TemporaryDirectory() as tmp:
      doc, stdout = test_util.run_program("bench.row_cache", [
          "--rows=20000", "--slots=4096", "--ids=2048", "--batches=20",
          f"--baseline={row_cache.__file__}"], tmp)
    self.assertIn("an admission that evicts", stdout)
    ours, baseline = doc["results"]["row_cache"], doc["results"]["baseline"]
    self.assertGreater(ours["evicting"], 0)
    self.assertGreater(ours["evicting_s"], 0)
    self.assertEqual(ours["cached"], baseline["cached"])
    self.assertEqual(ours["evicting"], baseline["evicting"])

if __name__ == "__main__":
  absltest.main()
