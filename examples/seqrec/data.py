"""MovieLens-1M for the sequence model: windows, batches, evaluation rows.

Numpy only. Sequences are right-aligned: a row of width L holds a user's
last min(n, L) items with the newest at column L - 1, 0-padded on the
left, so the model's last position always predicts the next item.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

import pallas_emb as pe
from pallas_emb import datasets
from pallas_emb.datasets.movielens1m import Sequences
from examples.seqrec import model

# Hash functions per item in the hashed variant.
NUM_HASHES = 2


def first_users(seqs: Sequences, count: int) -> Sequences:
  """The users with dense ids 1..count (all when count is 0 or more)."""
  if not count or count >= seqs.num_users:
    return seqs
  end = int(seqs.offsets[count])
  return dataclasses.replace(
      seqs, items=seqs.items[:end], ratings=seqs.ratings[:end],
      timestamps=seqs.timestamps[:end], offsets=seqs.offsets[:count + 1],
      user_names=seqs.user_names[:count + 1])


def right_aligned(seqs: Sequences, width: int,
                  times: bool = False) -> np.ndarray:
  """int32 `[num_users, width]`: each user's last items (their timestamps
  with `times`), newest last."""
  values = seqs.timestamps if times else seqs.items
  if times and values.size and not 0 <= values.min() <= values.max() < 2**31:
    raise datasets.DataError(
        f"seqrec: timestamps in [{values.min()}, {values.max()}]; expected "
        "seconds in [0, 2**31) (the model reads them as int32).")
  keep = np.minimum(seqs.lengths, width)
  column = np.arange(width)
  inside = column >= (width - keep)[:, None]
  index = seqs.offsets[1:, None] - width + column
  return np.where(inside, values[np.where(inside, index, 0)],
                  0).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SeqData:
  """What a run trains and evaluates on.

  inputs / targets: `[U, L]` training windows (position t's target is the
  item after its input; 0 where the input is padding). `<split>_history`:
  `[U, L]` what the model reads to predict `<split>_targets` `[U]` (the
  validation history is the training items, the test history adds the
  validation item). times, `<split>_times`: `[U, L + 1]` timestamps of
  the inputs / history and, last, of the item the last position predicts
  (HSTU reads them: hstu.HSTU). item_rows: `[V]` or `[V, 2]`, the table
  row(s) of each item id 0..V-1 (the identity, or its hashed ids).
  """
  inputs: np.ndarray
  targets: np.ndarray
  valid_history: np.ndarray
  valid_targets: np.ndarray
  test_history: np.ndarray
  test_targets: np.ndarray
  times: np.ndarray
  valid_times: np.ndarray
  test_times: np.ndarray
  num_items: int
  item_rows: np.ndarray

  @property
  def num_users(self) -> int:
    return self.inputs.shape[0]


def load(path: str, *, max_users: int, max_len: int, train_on_valid: bool,
         hash_rows: int | None = None) -> SeqData:
  """MovieLens-1M (found, or downloaded when `path` is ''): `from_sequences`.

  Raises datasets.DataError for missing or malformed data.
  """
  seqs = datasets.load_movielens1m(
      datasets.find_movielens1m(path or None, download=not path))
  return from_sequences(first_users(seqs, max_users), max_len=max_len,
                        train_on_valid=train_on_valid, hash_rows=hash_rows)


def from_sequences(seqs: Sequences, *, max_len: int, train_on_valid: bool,
                   hash_rows: int | None = None) -> SeqData:
  """Leave-one-out windows and evaluation rows of `seqs`."""
  split = datasets.leave_one_out(seqs)
  train = seqs.drop_last(1) if train_on_valid else split.train
  window = right_aligned(train, max_len + 1)
  inputs = window[:, :-1]
  targets = np.where(inputs != 0, window[:, 1:], 0)
  vocab = seqs.num_items + 1
  item_rows = np.arange(vocab, dtype=np.int32)
  if hash_rows:
    item_rows = pe.hash_ids(item_rows.astype(np.int64),
                            num_hashes=NUM_HASHES, rows=hash_rows)
  return SeqData(
      inputs=inputs, targets=targets,
      valid_history=right_aligned(split.train, max_len),
      valid_targets=split.valid,
      test_history=right_aligned(seqs.drop_last(1), max_len),
      test_targets=split.test,
      times=right_aligned(train, max_len + 1, times=True),
      valid_times=right_aligned(seqs.drop_last(1), max_len + 1, times=True),
      test_times=right_aligned(seqs, max_len + 1, times=True),
      num_items=seqs.num_items, item_rows=item_rows)


def bucket_of(data: SeqData, buckets: tuple[int, ...]) -> np.ndarray:
  """int `[U]`: the index of the shortest bucket length >= each user's
  training positions (the last bucket holds the rest)."""
  positions = np.count_nonzero(data.inputs, axis=1)
  return np.minimum(np.searchsorted(np.asarray(buckets), positions),
                    len(buckets) - 1)


def steps_per_epoch(data: SeqData, batch_size: int,
                    buckets: tuple[int, ...] = ()) -> int:
  buckets = buckets or (data.inputs.shape[1],)
  counts = np.bincount(bucket_of(data, buckets), minlength=len(buckets))
  return int(sum(-(-n // batch_size) for n in counts))


def batches(data: SeqData, *, batch_size: int, num_negatives: int,
            seed: int, buckets: tuple[int, ...] = ()
            ) -> Iterator[dict[str, np.ndarray]]:
  """Training batches forever: every user once per epoch, shuffled.

  With `buckets` (ascending history lengths, the last = the full width),
  a batch holds users of one bucket and only the bucket's last columns:
  most users have far fewer than 200 items, and attention costs the
  square of the length. The batches of an epoch come in random order; the
  last batch of each bucket is filled with all-padding rows (no loss).
  Negatives are uniform over the items, `[B, N]` per example, drawn with
  replacement. "step" counts batches (the model's dropout key). "times"
  holds one more column than the history (the targets' times).
  """
  rng = np.random.default_rng([seed, 2])
  buckets = buckets or (data.inputs.shape[1],)
  members = bucket_of(data, buckets)
  step = 0
  while True:
    chunks = []
    for k, length in enumerate(buckets):
      users = rng.permutation(np.flatnonzero(members == k))
      order = np.full(-(-users.size // batch_size) * batch_size, -1)
      order[:users.size] = users
      chunks += [(length, c) for c in order.reshape(-1, batch_size)]
    for i in rng.permutation(len(chunks)):
      length, chunk = chunks[i]
      real = (chunk >= 0)[:, None]
      history = np.where(real, data.inputs[chunk, -length:], 0)
      positives = np.where(real, data.targets[chunk, -length:], 0)
      times = np.where(real, data.times[chunk, -length - 1:], 0)
      negatives = rng.integers(1, data.num_items + 1,
                               (batch_size, num_negatives)).astype(np.int32)
      rows = data.item_rows
      yield {model.HISTORY: rows[history], model.POSITIVES: rows[positives],
             model.NEGATIVES: rows[negatives], model.POS_ITEMS: positives,
             model.NEG_ITEMS: negatives, model.TIMES: times,
             model.STEP: np.full(batch_size, step, np.int32)}
      step += 1
