"""Host-side padding of ragged bags for pooled features."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pallas_emb.errors import InputError


_INT32 = np.iinfo(np.int32)


def _row(i: int, row) -> np.ndarray:
  try:
    return np.asarray(row)
  except ValueError as e:  # e.g. a bag of nested lists of unequal lengths
    raise InputError(f"pallas_emb pad_ragged row {i} is not a flat list of "
                     "numbers; give one list of ids per example.") from e


def _rows(rows) -> list[np.ndarray]:
  """The bags of `rows`: a tuple `(values, row_lengths)`, else a sequence of
  bags (lists of ids)."""
  if not (isinstance(rows, tuple) and len(rows) == 2):
    return [_row(i, r) for i, r in enumerate(rows)]
  values, lengths = np.asarray(rows[0]), np.asarray(rows[1])
  if (values.ndim != 1 or lengths.ndim != 1
      or (lengths.size and lengths.dtype.kind not in "iu")
      or (lengths < 0).any()):
    raise InputError(
        "pallas_emb pad_ragged (values, row_lengths) needs a flat array of "
        "values and a 1-D array of non-negative integer lengths; for a list "
        "of bags pass a list, not a tuple.")
  if int(lengths.sum()) != values.shape[0]:
    raise InputError(
        f"pallas_emb pad_ragged got {values.shape[0]} values but row_lengths "
        f"sum to {int(lengths.sum())}; they must match.")
  return np.split(values, np.cumsum(lengths, dtype=np.int64)[:-1])


def _check_ids(i: int, bag: np.ndarray) -> None:
  """Row i holds integer ids that fit int32; anything else raises (a float
  cast to an id, or a wide id wrapped, would train another row)."""
  if bag.ndim != 1:
    raise InputError(f"pallas_emb pad_ragged row {i} has shape {bag.shape}; "
                     "expected a flat list of ids.")
  if not bag.size:
    return  # np.asarray([]) is float64
  if bag.dtype.kind not in "iu":
    raise InputError(
        f"pallas_emb pad_ragged row {i} holds {bag.dtype} values "
        f"{bag[:4].tolist()}; expected integer ids (floats and bools are not "
        "ids). Map them to integer ids first, e.g. np.asarray(row, "
        "np.int64) once they are whole numbers.")
  low, high = bag.min(), bag.max()
  if low < _INT32.min or high > _INT32.max:
    raise InputError(
        f"pallas_emb pad_ragged row {i} holds ids in [{low}, {high}], outside "
        "int32; hash them into the table's range first.")


def _check_weights(i: int, w: np.ndarray) -> None:
  """Row i's weights are finite as float32 (a NaN or inf weight makes the
  pooled embedding and every gradient through it NaN)."""
  if not w.size:
    return
  if w.dtype.kind not in "biuf":
    raise InputError(f"pallas_emb pad_ragged row {i} has weights of dtype "
                     f"{w.dtype}; expected numbers.")
  w = w.astype(np.float64)
  bad = ~(np.abs(w) <= np.finfo(np.float32).max)  # NaN, inf, f32 overflow
  if bad.any():
    raise InputError(
        f"pallas_emb pad_ragged row {i} has weights {w[bad][:4].tolist()}; "
        "expected numbers finite in float32. Drop or fix those entries "
        "upstream (weight 0 is padding).")


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

  Ids must be integers of any integer dtype that fit int32 and weights
  finite numbers: a float id (even a whole one, as for `lookup`), a bool,
  or a NaN weight raises InputError naming the row.
  """
  if (isinstance(pad_id, (bool, np.bool_))
      or not isinstance(pad_id, (int, np.integer))
      or not _INT32.min <= pad_id <= _INT32.max):
    raise InputError(f"pallas_emb pad_ragged pad_id={pad_id!r} must be an "
                     "int32 id.")
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
      _check_weights(i, w)
  longest = max((b.shape[0] for b in bags), default=0)
  if max_len is None:
    max_len = max(longest, 1)
  elif isinstance(max_len, bool) or not isinstance(max_len, int) or (
      max_len < 1):
    raise InputError(f"pallas_emb pad_ragged max_len={max_len!r} must be a "
                     "positive integer.")
  for i, b in enumerate(bags):
    _check_ids(i, b)
    if b.shape[0] > max_len:
      raise InputError(
          f"pallas_emb pad_ragged row {i} has {b.shape[0]} ids, more than "
          f"max_len={max_len}; raise max_len (or drop ids upstream).")
  ids = np.full((len(bags), max_len), pad_id, np.int32)
  out_weights = np.zeros((len(bags), max_len), np.float32)
  for i, (b, w) in enumerate(zip(bags, bag_weights)):
    ids[i, :b.shape[0]] = b
    out_weights[i, :b.shape[0]] = w
  return ids, out_weights
