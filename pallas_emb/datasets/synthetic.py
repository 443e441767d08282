"""Synthetic rating data: Zipf-skewed ids and a planted low-rank signal.

`zipf_ids` is also what the benchmarks draw their ids from.
"""

from __future__ import annotations

import numpy as np

from pallas_emb.datasets.dataset import check_positive_int
from pallas_emb.datasets.dataset import Dataset

# Synthetic signal: dot(U, V) has variance 1 (entries have std rank**-0.25),
# plus small per-id biases and a non-zero mean a model must learn.
_BIAS_STD = 0.3
_GLOBAL_MEAN = 1.0
_DOT_CHUNK = 1 << 20  # rows per chunk, bounds the gathered [chunk, rank] temps


def _zipf_ranks(rng: np.random.Generator, n: int, size: int,
                exponent: float) -> np.ndarray:
  """`size` draws from a truncated Zipf over ranks [0, n): p_k ∝ (k+1)^-a."""
  # Inverse CDF on explicit probabilities: O(n) memory, no rejection loop.
  cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)
  cdf /= cdf[-1]
  u = rng.random(size)
  # Searched in sorted order, so that neighbouring searches share the cache
  # (1.7x faster at 1e8 ranks); the same ranks.
  order = np.argsort(u)
  ranks = np.empty(size, np.intp)
  ranks[order] = np.searchsorted(cdf, u[order], side="right")
  return np.minimum(ranks, n - 1)  # guards u == cdf[-1] rounding


def zipf_ids(rng: np.random.Generator, num_ids: int, size: int,
             exponent: float, *, permute: bool = True) -> np.ndarray:
  """`size` int32 ids in [1, num_ids], Zipf(exponent) over popularity ranks.

  The rank k (0-based) has probability ∝ (k+1)^-exponent, truncated to
  `num_ids` ranks (exponent 0: uniform). With `permute` (the default), a
  random permutation drawn from `rng` maps ranks to ids, so the hottest ids
  are not simply the smallest; without it, rank k is id k + 1. Id 0 (the
  padding id) never occurs. Draw every batch of a stream in one call: the
  permutation, i.e. which ids are hot, is drawn per call.
  """
  check_positive_int("num_ids", num_ids)
  if exponent < 0:
    raise ValueError(f"pallas_emb data: zipf exponent={exponent} must be "
                     ">= 0.")
  ranks = _zipf_ranks(rng, num_ids, size, exponent)
  if not permute:
    return (ranks + 1).astype(np.int32)
  rank_to_id = rng.permutation(num_ids).astype(np.int32) + 1
  return rank_to_id[ranks]


def _factor_rows(rng: np.random.Generator, ids: np.ndarray, num_rows: int,
                 rank: int, dense: bool) -> tuple[np.ndarray, np.ndarray]:
  """Factors [rows, rank] and each example's row into them.

  dense=False draws factors only for the distinct ids that occur, which
  keeps 1e7-row vocabs cheap; dense=True draws one row per vocab id.
  """
  if dense:
    rows = ids
    count = num_rows
  else:
    distinct, rows = np.unique(ids, return_inverse=True)
    count = distinct.size
  scale = np.float32(rank ** -0.25)  # so dot(U[u], V[i]) has variance 1
  factors = rng.standard_normal((count, rank), dtype=np.float32) * scale
  return factors, rows.reshape(-1)


def _rowwise_dot(a: np.ndarray, a_rows: np.ndarray, b: np.ndarray,
                 b_rows: np.ndarray) -> np.ndarray:
  """dot(a[a_rows[n]], b[b_rows[n]]) for every n, in bounded-memory chunks."""
  out = np.empty(a_rows.shape[0], np.float32)
  for start in range(0, out.shape[0], _DOT_CHUNK):
    sl = slice(start, start + _DOT_CHUNK)
    out[sl] = np.einsum("nr,nr->n", a[a_rows[sl]], b[b_rows[sl]])
  return out


def synthetic(num_examples: int,
              num_users: int,
              num_items: int,
              rank: int = 8,
              zipf_exponent: float = 1.05,
              noise_std: float = 0.1,
              seed: int = 0,
              *,
              dense_factors: bool = False) -> Dataset:
  """A rating task with Zipf-skewed ids and a planted low-rank signal.

  label = dot(U[user], V[item]) + b_user + b_item + mu + N(0, noise_std^2),
  with dot(U, V) of variance 1, biases of std 0.3 and mu = 1, so labels have
  variance about 1.2 + noise_std^2 and `label_floor = noise_std**2` is the
  best achievable MSE.

  Args:
    num_examples: rows N.
    num_users, num_items: distinct real ids; ids are 1..num (0 is padding),
      so vocab_sizes are num_users + 1 and num_items + 1.
    rank: rank of the planted signal.
    zipf_exponent: a in p_k ∝ k^-a over popularity ranks (0 = uniform).
    noise_std: std of the label noise.
    seed: everything is a deterministic function of the arguments.
    dense_factors: draw factors for every vocab id ([vocab, rank] float32
      each) instead of only for the ids drawn (the default, far cheaper for
      huge vocabs). The two give different, equally valid, datasets.
  """
  for name, value in (("num_examples", num_examples), ("num_users", num_users),
                      ("num_items", num_items), ("rank", rank)):
    check_positive_int(name, value)
  if max(num_users, num_items) >= np.iinfo(np.int32).max:
    raise ValueError("pallas_emb data: num_users and num_items must fit "
                     "int32 ids.")
  if zipf_exponent < 0 or noise_std < 0:
    raise ValueError("pallas_emb data: zipf_exponent and noise_std must be "
                     f">= 0; got {zipf_exponent} and {noise_std}.")

  # Independent streams, so e.g. the users drawn do not change with num_items.
  streams = [np.random.default_rng(s)
             for s in np.random.SeedSequence(seed).spawn(6)]
  users = zipf_ids(streams[0], num_users, num_examples, zipf_exponent)
  items = zipf_ids(streams[1], num_items, num_examples, zipf_exponent)
  u_fac, u_rows = _factor_rows(streams[2], users, num_users + 1, rank,
                               dense_factors)
  v_fac, v_rows = _factor_rows(streams[3], items, num_items + 1, rank,
                               dense_factors)
  u_bias = streams[4].normal(0, _BIAS_STD, u_fac.shape[0]).astype(np.float32)
  v_bias = streams[4].normal(0, _BIAS_STD, v_fac.shape[0]).astype(np.float32)
  noise = streams[5].normal(0, noise_std, num_examples).astype(np.float32)

  labels = _rowwise_dot(u_fac, u_rows, v_fac, v_rows)
  labels += u_bias[u_rows] + v_bias[v_rows] + np.float32(_GLOBAL_MEAN) + noise
  return Dataset(
      features={"user": users, "item": items},
      labels=labels,
      vocab_sizes={"user": num_users + 1, "item": num_items + 1},
      name=f"synthetic-{num_users}x{num_items}-r{rank}",
      label_floor=float(noise_std) ** 2)
