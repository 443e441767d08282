"""Host-side padding of ragged bags for pooled features (DESIGN §11)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pallas_emb.errors import InputError


def _rows(rows) -> list[np.ndarray]:
  """The bags of `rows`: a tuple `(values, row_lengths)`, else a sequence of
  bags (lists of ids)."""
  if not (isinstance(rows, tuple) and len(rows) == 2):
    return [np.asarray(r) for r in rows]
  values, lengths = np.asarray(rows[0]), np.asarray(rows[1])
  if values.ndim != 1 or lengths.ndim != 1 or (lengths < 0).any():
    raise InputError(
        "pallas_emb pad_ragged (values, row_lengths) needs a flat array of "
        "values and a 1-D array of non-negative lengths; for a list of bags "
        "pass a list, not a tuple.")
  if int(lengths.sum()) != values.shape[0]:
    raise InputError(
        f"pallas_emb pad_ragged got {values.shape[0]} values but row_lengths "
        f"sum to {int(lengths.sum())}; they must match.")
  return np.split(values, np.cumsum(lengths)[:-1])


def pad_ragged(rows, max_len: int | None = None, *,
               weights: Sequence | None = None, pad_id: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
  """`(ids [B, L] int32, weights [B, L] float32)` of ragged bags.

  Args:
    rows: a list with one list of ids per example, or a tuple
      `(values, row_lengths)`.
    max_len: L; default the longest bag (at least 1). A bag longer than
      `max_len` is an error naming it: nothing is cut silently.
    weights: optional per-id weights, given like `rows` (default 1).
    pad_id: the id written into padding slots (they get weight 0, so they
      take no unique slot and no gradient).
  """
  bags = _rows(rows)
  if weights is None:
    bag_weights = [np.ones(b.shape[0], np.float32) for b in bags]
  else:
    bag_weights = _rows(weights)
    for i, (b, w) in enumerate(zip(bags, bag_weights)):
      if w.shape[0] != b.shape[0]:
        raise InputError(
            f"pallas_emb pad_ragged row {i} has {b.shape[0]} ids but "
            f"{w.shape[0]} weights; give one weight per id.")
  longest = max((b.shape[0] for b in bags), default=0)
  if max_len is None:
    max_len = max(longest, 1)
  elif isinstance(max_len, bool) or not isinstance(max_len, int) or (
      max_len < 1):
    raise InputError(f"pallas_emb pad_ragged max_len={max_len!r} must be a "
                     "positive integer.")
  for i, b in enumerate(bags):
    if b.ndim != 1:
      raise InputError(f"pallas_emb pad_ragged row {i} has shape {b.shape}; "
                       "expected a flat list of ids.")
    if b.shape[0] > max_len:
      raise InputError(
          f"pallas_emb pad_ragged row {i} has {b.shape[0]} ids, more than "
          f"max_len={max_len}; raise max_len (or drop ids upstream).")
  ids = np.full((len(bags), max_len), pad_id, np.int64)
  out_weights = np.zeros((len(bags), max_len), np.float32)
  for i, (b, w) in enumerate(zip(bags, bag_weights)):
    ids[i, :b.shape[0]] = b
    out_weights[i, :b.shape[0]] = w
  info = np.iinfo(np.int32)
  if ids.size and (ids.min() < info.min or ids.max() > info.max):
    raise InputError("pallas_emb pad_ragged ids do not fit int32; hash them "
                     "into the table's range first.")
  return ids.astype(np.int32), out_weights
