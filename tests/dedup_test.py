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
from pallas_emb.dedup import unique_and_segments

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

  def test_default_num_unique_never_overflows(self):
    self.assertEqual(pe.default_num_unique(16, 1000), 17)
    self.assertEqual(pe.default_num_unique(16, 5), 6)


if __name__ == "__main__":
  absltest.main()
