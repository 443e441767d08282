"""dedup against the numpy model of the dedup rule, with and without jit."""

import functools

import test_util

import chex
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import numpy_model
import pallas_emb as pe
from pallas_emb.dedup import empty_slot_map
from pallas_emb.dedup import MAP_SENTINEL
from pallas_emb.dedup import unique_and_segments
from pallas_emb.dedup import unique_by_slot_map
from pallas_emb.testing import hlo

VOCAB = 29


def batch(rng, tokens, vocab=VOCAB):
  """Zipf ids with repeats, padding 0, negatives and out-of-range ids."""
  ids = (np.minimum(rng.zipf(1.3, tokens), vocab + 3) - 1).astype(np.int32)
  ids[rng.integers(0, tokens, 4)] = [0, -2, vocab + 4, -vocab - 1]
  return ids


def context(ranks, tokens, num_unique, padding_id=0, explicit=False):
  return pe.make_context(test_util.mesh({"x": ranks}, explicit=explicit), "x",
                         tokens_per_batch=tokens, emb_width=ranks,
                         num_unique=num_unique, padding_id=padding_id)


class DedupTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(ranks=[1, 2, 8], padding_id=[0, None, 3])
  def test_matches_model(self, ranks, padding_id):
    rng = np.random.default_rng(ranks)
    ctx = context(ranks, 48, 20, padding_id)
    ids = batch(rng, 48).reshape(24, 2)
    result = self.variant(functools.partial(pe.dedup, ctx, vocab_rows=VOCAB))(
        jax.device_put(ids, pe.token_sharding(ctx)))
    uniq, segs, distinct = numpy_model.dedup(ids, 20, VOCAB, padding_id)
    np.testing.assert_array_equal(result.unique_tokens, uniq)
    np.testing.assert_array_equal(result.segment_ids, segs)
    self.assertEqual(int(result.num_distinct), distinct)
    self.assertEqual(int(result.num_overflow), max(0, distinct - 20))
    self.assertEqual(result.segment_ids.shape, (24, 2))
    self.assertTrue(result.segment_ids.sharding.is_equivalent_to(
        pe.token_sharding(ctx), 2))

  def test_negative_ids_share_the_wrapped_row(self):
    # -1 and VOCAB-1 are one row: one unique slot, one segment.
    ctx = context(2, 4, 5)
    result = pe.dedup(ctx, np.array([-1, VOCAB - 1, 3, 3], np.int32),
                      vocab_rows=VOCAB)
    np.testing.assert_array_equal(result.unique_tokens[:2], [3, VOCAB - 1])
    np.testing.assert_array_equal(result.segment_ids, [1, 1, 0, 0])
    self.assertEqual(int(result.num_distinct), 2)

  def test_ids_outside_the_table_take_no_slot(self):
    # Still outside after one wrap: lookup clamps them, the update skips
    # them; a second wrap (-VOCAB-1 -> VOCAB-1) would update the wrong row.
    ctx = context(2, 4, 5)
    result = pe.dedup(ctx, np.array([-VOCAB - 1, VOCAB, VOCAB - 1, 2**31 - 1],
                                    np.int32), vocab_rows=VOCAB)
    np.testing.assert_array_equal(result.unique_tokens,
                                  [VOCAB - 1] + [pe.FILL_VALUE] * 4)
    np.testing.assert_array_equal(result.segment_ids, [-1, -1, 0, -1])

  @parameterized.parameters((0, [-VOCAB, 0, -VOCAB - 1, 5], [-1, -1, -1, 0]),
                            (VOCAB - 1, [-1, VOCAB, 3, 3], [-1, -1, 0, 0]),
                            (-1, [VOCAB - 1, -1, 3, 5], [-1, -1, 0, 1]))
  def test_ids_reaching_the_padding_row_take_no_slot(self, padding_id, ids,
                                                      segments):
    """The padding row never trains, whatever id reaches it after the wrap
    (-VOCAB with padding 0; -1 with padding VOCAB - 1) or the clamp."""
    ctx = context(2, 4, 5, padding_id)
    result = pe.dedup(ctx, np.array(ids, np.int32), vocab_rows=VOCAB)
    np.testing.assert_array_equal(result.segment_ids, segments)
    uniq, segs, _ = numpy_model.dedup(np.array(ids), 5, VOCAB, padding_id)
    np.testing.assert_array_equal(result.unique_tokens, uniq)
    np.testing.assert_array_equal(segs, segments)

  def test_vocab_rows_is_required(self):
    ctx = context(2, 4, 5)
    with self.assertRaisesRegex(TypeError, "vocab_rows"):
      pe.dedup(ctx, np.arange(4, dtype=np.int32))  # pytype: disable=missing-parameter
    with self.assertRaisesRegex(pe.InputError, "vocab_rows=0 must be a "
                                "positive integer"):
      pe.dedup(ctx, np.arange(4, dtype=np.int32), vocab_rows=0)

  @parameterized.parameters(
      ("list", lambda ids: ids.tolist()),
      ("numpy", lambda ids: ids),
      ("numpy_int64", lambda ids: ids.astype(np.int64)),
      ("jnp_unplaced", jnp.asarray))
  def test_unplaced_ids_on_explicit_mesh(self, _, convert):
    ctx = context(4, 16, 17, explicit=True)
    ids = np.arange(16, dtype=np.int32).reshape(8, 2) % 5
    result = pe.dedup(ctx, convert(ids), vocab_rows=VOCAB)
    uniq, segs, _ = numpy_model.dedup(ids, 17, VOCAB)
    np.testing.assert_array_equal(result.unique_tokens, uniq)
    np.testing.assert_array_equal(result.segment_ids, segs)

  def test_overflow_is_reported_and_raised(self):
    ctx = context(2, 16, 4)
    result = pe.dedup(ctx, np.arange(1, 17, dtype=np.int32), vocab_rows=VOCAB)
    self.assertEqual(int(result.num_overflow), 12)
    self.assertEqual(int(result.num_distinct), 16)
    # Ids that did not fit get no segment (their gradient is not applied).
    self.assertEqual(int(jnp.sum(result.segment_ids >= 0)), 4)
    with self.assertRaisesRegex(
        pe.UniqueOverflowError, "batch has 16 distinct ids but num_unique=4"):
      pe.raise_if_overflow(result.num_overflow, result.num_distinct, 4)
    pe.raise_if_overflow(jnp.int32(0), jnp.int32(3), 4)

  @parameterized.parameters(5, 40, 200)
  def test_cpu_and_accelerator_formulations_agree(self, num_unique):
    # The CPU runs sort + searchsorted, accelerators one sort with the
    # positions as payload: the same results, FILL keys and overflow too.
    rng = np.random.default_rng(num_unique)
    keys = rng.integers(0, 60, 300).astype(np.int32)
    keys[rng.random(300) < 0.2] = pe.FILL_VALUE
    both = [jax.jit(functools.partial(unique_and_segments,
                                      num_unique=num_unique, on_cpu=c))(keys)
            for c in (True, False)]
    for a, b in zip(*both):
      np.testing.assert_array_equal(a, b)
    uniq = np.unique(keys[keys != pe.FILL_VALUE])
    np.testing.assert_array_equal(both[0][0][:min(num_unique, uniq.size)],
                                  uniq[:num_unique])
    self.assertEqual(int(both[0][3]), max(0, uniq.size - num_unique))

  @parameterized.parameters((40, None, False), (12, None, True),
                            (20, ((0, 8), (30, 12)), False),
                            (9, ((0, 4), (30, 5)), True))
  def test_sort_along_gives_the_entries_in_slot_order(self, num_unique,
                                                      regions, on_tpu):
    # A numpy model: each entry's slot from the dedup's segments, then a
    # stable sort of the entries by it (no slot: num_unique, placed where
    # the entry's key sorts; here FILL keys sort last, overflow keys among
    # the others).
    rng = np.random.default_rng(num_unique)
    keys = rng.integers(0, 60, 300).astype(np.int32)
    keys[rng.random(300) < 0.2] = pe.FILL_VALUE
    rows = rng.integers(0, 1000, 300).astype(np.int32)
    weights = rng.standard_normal(300).astype(np.float32)
    run = jax.jit(functools.partial(
        unique_and_segments, num_unique=num_unique, regions=regions,
        on_tpu=on_tpu))
    plain = run(keys)
    *dedup, (slots, got_rows, got_weights) = run(keys, sort_along=(
        jnp.asarray(rows), jnp.asarray(weights)))
    for a, b in zip(plain, dedup):
      np.testing.assert_array_equal(a, b)
    segments = np.asarray(dedup[1])
    if num_unique < 20:  # some keys overflow: no slot, among the others
      self.assertGreater(int(dedup[3]), 0)
    order = np.lexsort((np.arange(300), keys))  # by key, then position
    np.testing.assert_array_equal(
        slots, np.where(segments[order] >= 0, segments[order], num_unique))
    np.testing.assert_array_equal(got_rows, rows[order])
    np.testing.assert_array_equal(got_weights, weights[order])
    # Each slot's entries come together, in entry order.
    taken = np.asarray(slots) < num_unique
    self.assertTrue(np.all(np.diff(np.asarray(slots)[taken]) >= 0))

  def test_default_num_unique_never_overflows(self):
    self.assertEqual(pe.default_num_unique(16, 1000), 17)
    self.assertEqual(pe.default_num_unique(16, 5), 6)


def first_occurrence_model(keys, rows, regions):
  """numpy: per region, its distinct keys in first-occurrence order, the
  first `slots` kept, after the rows the regions before it kept; each
  key's slot (-1: FILL/outside, or not kept)."""
  starts = [r for r, _ in regions] + [np.inf]
  kept = [[] for _ in regions]
  seen, distinct, overflow = set(), 0, 0
  for k in keys.tolist():
    if 0 <= k < rows and k not in seen:
      seen.add(k)
      distinct += 1
      r = max(i for i in range(len(regions)) if k >= starts[i])
      if len(kept[r]) < regions[r][1]:
        kept[r].append(k)
      else:
        overflow += 1
  order = [k for rows_of_region in kept for k in rows_of_region]
  unique = np.full(sum(s for _, s in regions), pe.FILL_VALUE, np.int32)
  unique[:len(order)] = order
  slot_of = {k: i for i, k in enumerate(order)}
  segs = [slot_of.get(k, -1) if 0 <= k < rows else -1 for k in keys.tolist()]
  return unique, np.asarray(segs, np.int32), distinct, overflow


def sorted_model(keys, rows, regions):
  """`first_occurrence_model`, the rows sorted (FILL last)."""
  unique, segs, distinct, overflow = first_occurrence_model(keys, rows,
                                                            regions)
  order = np.argsort(unique, kind="stable")
  renumber = np.argsort(order)
  return (unique[order], np.where(segs >= 0, renumber[segs], -1), distinct,
          overflow)


ROWS = 97
# ((first_row, slots), ...): one region, three with room for all their
# rows, the middle one full.
REGIONS = {"one": ((0, ROWS),), "three": ((0, 40), (40, 20), (60, 37)),
           "overflow": ((0, 40), (40, 3), (60, 37))}


class SlotMapTest(parameterized.TestCase):

  def run_map(self, keys, regions, rows=ROWS, sort_unique=False):
    num_unique = sum(s for _, s in regions)
    run = jax.jit(functools.partial(unique_by_slot_map,
                                    num_unique=num_unique, regions=regions,
                                    sort_unique=sort_unique))
    *out, slot_map = run(jnp.asarray(keys, jnp.int32),
                         slot_map=empty_slot_map(rows))
    np.testing.assert_array_equal(slot_map, MAP_SENTINEL)  # reset
    return out

  @parameterized.product(regions=list(REGIONS), seed=[0, 1, 2],
                         sort_unique=[False, True])
  def test_matches_first_occurrence_model(self, regions, seed, sort_unique):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, ROWS, 200).astype(np.int32)
    keys[rng.random(200) < 0.2] = pe.FILL_VALUE
    keys[rng.integers(0, 200, 3)] = [-5, ROWS, ROWS + 7]  # outside the map
    got = self.run_map(keys, REGIONS[regions], sort_unique=sort_unique)
    want = (sorted_model if sort_unique else first_occurrence_model)(
        keys, ROWS, REGIONS[regions])
    self.assertEqual(want[3] > 0, regions == "overflow")
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)

  @parameterized.product(regions=["one", "three"], seed=[3, 4])
  def test_agrees_with_the_sort_up_to_the_slot_order(self, regions, seed):
    # Room for every row: the sort and the map keep the same rows.
    regions = REGIONS[regions]
    rng = np.random.default_rng(seed)
    keys = np.minimum(rng.zipf(1.2, 300), ROWS) - 1
    keys = keys.astype(np.int32)
    keys[rng.random(300) < 0.1] = pe.FILL_VALUE
    got = self.run_map(keys, regions)
    want = jax.jit(functools.partial(
        unique_and_segments, num_unique=sum(s for _, s in regions),
        regions=regions, on_cpu=True))(keys)
    # The same rows, in another order.
    np.testing.assert_array_equal(np.sort(got[0]), want[0])
    for (unique, segs) in (got[:2], want[:2]):  # each key finds its row
      np.testing.assert_array_equal(
          np.where(segs >= 0, np.asarray(unique)[segs], pe.FILL_VALUE), keys)
    self.assertEqual([int(x) for x in got[2:]], [int(want[2]), 0])
    # Sorting the unique slots afterwards gives the sort's results exactly.
    for g, w in zip(self.run_map(keys, regions, sort_unique=True), want):
      np.testing.assert_array_equal(g, w)

  @parameterized.named_parameters(
      ("all_equal", [7] * 16, 1, 0), ("all_fill", [pe.FILL_VALUE] * 5, 0, 0),
      ("empty", [], 0, 0), ("one_slot_overflows", [4, 9, 4, 2, 9], 3, 2))
  def test_edge_cases(self, keys, distinct, overflow):
    keys = np.asarray(keys, np.int32)
    regions = ((0, 1),) if overflow else ((0, 6),)
    unique, segs, got_distinct, got_overflow = self.run_map(keys, regions)
    want = first_occurrence_model(keys, ROWS, regions)
    np.testing.assert_array_equal(unique, want[0])
    np.testing.assert_array_equal(segs, want[1])
    self.assertEqual((int(got_distinct), int(got_overflow)),
                     (distinct, overflow))

  def test_the_map_is_reused_across_steps(self):
    run = jax.jit(functools.partial(unique_by_slot_map, num_unique=8),
                  donate_argnames="slot_map")
    slot_map = empty_slot_map(ROWS)
    for keys in ([3, 5, 3], [5, 1, 1, 96], [0, 3]):
      unique, segs, _, _, slot_map = run(jnp.asarray(keys, jnp.int32),
                                         slot_map=slot_map)
      want = first_occurrence_model(np.asarray(keys), ROWS, ((0, 8),))
      np.testing.assert_array_equal(unique, want[0])
      np.testing.assert_array_equal(segs, want[1])
    np.testing.assert_array_equal(slot_map, MAP_SENTINEL)

  def test_donated_map_is_updated_in_place(self):
    # 4099 rows against 64 keys: any [rows] op is a copy or a full pass.
    rows, keys = 4099, jnp.zeros((64,), jnp.int32)

    def compiled_ops(**donate):
      run = jax.jit(functools.partial(unique_by_slot_map, num_unique=16,
                                      regions=((0, 8), (2000, 8))), **donate)
      text = run.lower(keys, slot_map=empty_slot_map(rows)).compile()
      return hlo.full_table_ops(text.as_text(), rows)

    self.assertEqual(compiled_ops(donate_argnames="slot_map"), [])
    # The control: without donation XLA must copy the map.
    self.assertNotEqual(compiled_ops(), [])

  def test_a_map_that_is_not_int32_rows_raises(self):
    with self.assertRaisesRegex(ValueError, "expected an int32 \\[rows\\]"):
      unique_by_slot_map(jnp.zeros((4,), jnp.int32), 4,
                         jnp.zeros((8,), jnp.float32))


if __name__ == "__main__":
  absltest.main()
