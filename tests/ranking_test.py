"""Tests for pallas_emb.datasets.ranking: hand-computed ranks and metrics,
and a brute-force model on random tied scores."""

import math

from absl.testing import absltest
import numpy as np

from pallas_emb import datasets
from pallas_emb.datasets import ranking

# Item ids 0..5; column 0 is padding and must never count.
_SCORES = np.asarray([[9.0, 0.5, 0.9, 0.2, 0.9, 0.1],
                      [9.0, 0.3, 0.1, 0.8, 0.5, 0.6]])
_TARGETS = np.asarray([2, 1])


class RanksTest(absltest.TestCase):

  def test_hand_computed(self):
    # Row 0: item 4 ties the target (0.9) and counts ahead -> rank 2.
    # Row 1: items 3 (.8), 5 (.6), 4 (.5) beat 0.3 -> rank 4.
    np.testing.assert_array_equal(
        ranking.target_ranks(_SCORES, _TARGETS), [2, 4])
    # Filtering item 4 from row 0 and items 3, 5 from row 1 (0 = padding).
    exclude = np.asarray([[4, 0], [3, 5]])
    np.testing.assert_array_equal(
        ranking.target_ranks(_SCORES, _TARGETS, exclude), [1, 2])
    # Item 4 is no candidate at all: row 1 keeps only items 1, 2 -> rank 1.
    candidates = np.asarray([True, True, True, True, False, True])
    np.testing.assert_array_equal(
        ranking.target_ranks(_SCORES, _TARGETS, exclude, candidates), [1, 1])

  def test_matches_brute_force_on_ties(self):
    rng = np.random.default_rng(0)
    batch, vocab = 40, 30
    scores = rng.integers(0, 6, (batch, vocab)).astype(np.float32)
    targets = rng.integers(1, vocab, batch)
    exclude = rng.integers(0, vocab, (batch, 7))
    exclude[exclude == targets[:, None]] = 0
    candidates = rng.random(vocab) < 0.8
    candidates[targets] = True
    got = ranking.target_ranks(scores, targets, exclude, candidates)
    for b in range(batch):
      ahead = [v for v in range(1, vocab)
               if candidates[v] and v != targets[b] and v not in exclude[b]
               and scores[b, v] >= scores[b, targets[b]]]
      self.assertEqual(got[b], 1 + len(ahead), msg=f"row {b}")

  def test_errors(self):
    with self.assertRaisesRegex(datasets.DataError, "NaN scores"):
      ranking.target_ranks(np.asarray([[0, np.nan, 1.0]]), [2])
    with self.assertRaisesRegex(datasets.DataError, "target 2 of row 0 is "
                                "padding, out of .* or excluded"):
      ranking.target_ranks(_SCORES, _TARGETS, np.asarray([[2], [0]]))
    for targets in ([0, 1], [6, 1]):
      with self.assertRaisesRegex(datasets.DataError, "target"):
        ranking.target_ranks(_SCORES, targets)
    with self.assertRaisesRegex(datasets.DataError, r"expected \[B, V\]"):
      ranking.target_ranks(_SCORES[0], _TARGETS)
    with self.assertRaisesRegex(datasets.DataError, "exclude"):
      ranking.target_ranks(_SCORES, _TARGETS, np.asarray([[7], [0]]))


class MetricsTest(absltest.TestCase):

  def test_hand_computed(self):
    got = ranking.ranking_metrics([1, 3, 12, 60], ks=(10, 50))
    want = {
        "hr@10": 2 / 4,  # ranks 1 and 3
        "ndcg@10": (1 + 1 / 2) / 4,  # 1/log2(2) + 1/log2(4)
        "hr@50": 3 / 4,
        "ndcg@50": (1 + 1 / 2 + 1 / math.log2(13)) / 4,
        "mrr": (1 + 1 / 3 + 1 / 12 + 1 / 60) / 4,
    }
    self.assertEqual(set(got), set(want))
    for key, value in want.items():
      self.assertAlmostEqual(got[key], value, places=12, msg=key)

  def test_errors(self):
    with self.assertRaisesRegex(datasets.DataError, "ranks >= 1"):
      ranking.ranking_metrics([0, 1])
    with self.assertRaisesRegex(datasets.DataError, "non-empty"):
      ranking.ranking_metrics([])


if __name__ == "__main__":
  absltest.main()
