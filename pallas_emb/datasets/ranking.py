"""Full-ranking evaluation of next-item prediction, in numpy.

Each user has one target item; the model scores every item id; the target's
rank is counted among the candidate items that are not filtered (the user's
history, as is usual for MovieLens). From the 1-based ranks r:

* HR@K = 1[r <= K];
* NDCG@K = 1[r <= K] / log2(r + 1) (one relevant item, so IDCG = 1);
* MRR = 1 / r;

each averaged over users. Ties are counted against the target (an item
scoring exactly the target's score ranks ahead of it), so a model that
scores everything alike gets no credit.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pallas_emb.datasets.dataset import DataError


def target_ranks(scores: np.ndarray, targets: np.ndarray,
                 exclude: np.ndarray | None = None,
                 candidates: np.ndarray | None = None) -> np.ndarray:
  """1-based rank of each target among the unfiltered candidates.

  Args:
    scores: float [B, V], the score of every item id 0..V-1 per user.
    targets: int [B] target item ids in [1, V).
    exclude: optional int [B, L] item ids removed from each user's ranking
      (e.g. the history); 0 entries are padding and ignored.
    candidates: optional bool [V], the items that can be ranked at all
      (default: every id but the padding id 0, which is never a candidate).

  Returns:
    int64 [B] ranks: 1 + the number of candidates, other than the target and
    not excluded, scoring at least the target's score.

  Raises:
    DataError: shapes that do not fit, a NaN score, or a target that is
      padding, out of range, not a candidate or excluded.
  """
  scores = np.asarray(scores)
  targets = np.asarray(targets)
  if scores.ndim != 2 or targets.shape != scores.shape[:1]:
    raise DataError(f"pallas_emb target_ranks got scores {scores.shape} and "
                    f"targets {targets.shape}; expected [B, V] and [B].")
  batch, vocab = scores.shape
  if np.isnan(scores).any():
    raise DataError("pallas_emb target_ranks got NaN scores; expected "
                    "finite scores; check the model's outputs.")
  valid = np.ones((batch, vocab), bool)
  if candidates is not None:
    candidates = np.asarray(candidates, bool)
    if candidates.shape != (vocab,):
      raise DataError(f"pallas_emb target_ranks got candidates "
                      f"{candidates.shape}; expected [{vocab}] booleans.")
    valid &= candidates
  valid[:, 0] = False
  if exclude is not None:
    exclude = np.asarray(exclude)
    if exclude.ndim != 2 or exclude.shape[0] != batch or (
        exclude.size and (exclude.min() < 0 or exclude.max() >= vocab)):
      raise DataError(f"pallas_emb target_ranks got exclude {exclude.shape} "
                      f"with ids outside [0, {vocab}); expected [{batch}, L] "
                      "item ids, 0 for padding.")
    valid[np.arange(batch)[:, None], exclude] = False
    valid[:, 0] = False
  rows = np.arange(batch)
  bad = (targets < 1) | (targets >= vocab)
  if not bad.any():
    bad = ~valid[rows, targets]
  if bad.any():
    user = int(np.flatnonzero(bad)[0])
    raise DataError(f"pallas_emb target_ranks: target {int(targets[user])} of "
                    f"row {user} is padding, out of [1, {vocab}), not a "
                    "candidate or excluded; expected a rankable item; drop "
                    "it from the filter or the batch.")
  own = scores[rows, targets][:, None]
  ahead = (scores >= own) & valid
  ahead[rows, targets] = False
  return 1 + ahead.sum(axis=1, dtype=np.int64)


def ranking_metrics(ranks: np.ndarray, ks: Sequence[int] = (10, 50)
                    ) -> dict[str, float]:
  """{"hr@K", "ndcg@K" for K in ks, "mrr"}: means over the ranks."""
  ranks = np.asarray(ranks, np.float64)
  if ranks.ndim != 1 or not ranks.size or (ranks < 1).any():
    raise DataError(f"pallas_emb ranking_metrics got ranks of shape "
                    f"{ranks.shape}; expected a non-empty [B] of ranks >= 1.")
  out = {}
  for k in ks:
    hit = ranks <= k
    out[f"hr@{k}"] = float(hit.mean())
    out[f"ndcg@{k}"] = float(np.where(hit, 1 / np.log2(ranks + 1), 0).mean())
  out["mrr"] = float((1 / ranks).mean())
  return out
