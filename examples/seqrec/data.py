"""MovieLens-1M for the sequence model: windows, batches, evaluation rows.

Sequences are right-aligned: a row of width L holds a user's last
min(n, L) items with the newest at column L - 1, 0-padded on the left, so
the model's last position always predicts the next item.

The windows live on the device for the whole run: the host only plans
which users each step trains (`batch_plan`, numpy) and `device_batch`
gathers their rows and draws their negatives inside the jitted step, so
no batch crosses from the host per step.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
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
  untied: bool `[U]`, the users whose test item is strictly newer than
  every other item of theirs (their last two ratings do not share a
  timestamp), so that any sort by time, stable or not, agrees on it.
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
  untied: np.ndarray

  @property
  def num_users(self) -> int:
    return self.inputs.shape[0]


def load(path: str, *, max_users: int, max_len: int, train_on_valid: bool,
         hash_rows: int | None = None, all_movies: bool = False) -> SeqData:
  """MovieLens-1M (found, or downloaded when `path` is ''): `from_sequences`.

  all_movies: item ids for all 3,883 movies (ranked and sampled), not only
  the 3,706 rated ones (`datasets.load_movielens1m`).

  Raises datasets.DataError for missing or malformed data.
  """
  seqs = datasets.load_movielens1m(
      datasets.find_movielens1m(path or None, download=not path),
      all_movies=all_movies)
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
  ends = seqs.offsets[1:]
  return SeqData(
      inputs=inputs, targets=targets,
      valid_history=right_aligned(split.train, max_len),
      valid_targets=split.valid,
      test_history=right_aligned(seqs.drop_last(1), max_len),
      test_targets=split.test,
      times=right_aligned(train, max_len + 1, times=True),
      valid_times=right_aligned(seqs.drop_last(1), max_len + 1, times=True),
      test_times=right_aligned(seqs, max_len + 1, times=True),
      num_items=seqs.num_items, item_rows=item_rows,
      untied=seqs.timestamps[ends - 1] != seqs.timestamps[ends - 2])


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


@dataclasses.dataclass(frozen=True)
class Planned:
  """One step's users: int32 `[B]` rows of SeqData (-1: a filler row with
  no loss) and the history length the step reads."""
  users: np.ndarray
  length: int


def batch_plan(data: SeqData, *, batch_size: int, seed: int,
               buckets: tuple[int, ...] = ()) -> Iterator[Planned]:
  """The steps' users forever: every user once per epoch, shuffled.

  With `buckets` (ascending history lengths, the last = the full width),
  a step holds users of one bucket and reads only the bucket's last
  columns: most users have far fewer than 200 items, and attention costs
  the square of the length. The steps of an epoch come in random order;
  the last step of each bucket is filled with filler rows.
  """
  rng = np.random.default_rng([seed, 2])
  buckets = buckets or (data.inputs.shape[1],)
  members = bucket_of(data, buckets)
  while True:
    chunks = []
    for k, length in enumerate(buckets):
      users = rng.permutation(np.flatnonzero(members == k))
      order = np.full(-(-users.size // batch_size) * batch_size, -1,
                      np.int32)
      order[:users.size] = users
      chunks += [Planned(c, length) for c in order.reshape(-1, batch_size)]
    for i in rng.permutation(len(chunks)):
      yield chunks[i]


def device_arrays(data: SeqData, sharding) -> dict[str, jax.Array]:
  """The training windows and (hashed ids only: the identity needs no
  table) the item rows, put on the devices once."""
  arrays = {"inputs": data.inputs, "targets": data.targets,
            "times": data.times}
  if data.item_rows.ndim > 1:
    arrays["item_rows"] = data.item_rows
  return {name: jax.device_put(np.asarray(value), sharding)
          for name, value in arrays.items()}


def catalogue_ids(num_items: int, batch_size: int) -> np.ndarray:
  """int32 `[B, M]`: the item ids 1..num_items row-major, then 0s
  (padding): every item once, laid out as a batch feature
  (M = ceil(num_items / B)); flat position j holds item j + 1."""
  width = -(-num_items // batch_size)
  flat = np.zeros(batch_size * width, np.int32)
  flat[:num_items] = np.arange(1, num_items + 1)
  return flat.reshape(batch_size, width)


def device_batch(arrays: dict[str, jax.Array], users: jax.Array,
                 step: jax.Array, seed: jax.Array, *, length: int,
                 num_items: int, num_negatives: int,
                 per_position: bool) -> dict[str, jax.Array]:
  """A training batch of `users` (`Planned.users`), built on the device.

  Keys as model.FEATURES etc.: the users' last `length` inputs, targets
  and `length + 1` times (0 on filler rows), as table rows (arrays'
  "item_rows" of hashed ids; else the ids) and as ids.
  The negatives: `num_negatives` per user, uniform over the items with
  replacement (model.negatives_key(seed, step)); with `per_position`
  the whole catalogue instead (`catalogue_ids`), from which the loss
  draws each position's own negatives. "step" counts batches (the
  model's dropout key), "seed" is the run's.
  """
  batch_size = users.shape[0]
  real = (users >= 0)[:, None]
  rows = jnp.maximum(users, 0)
  history = jnp.where(real, arrays["inputs"][rows, -length:], 0)
  positives = jnp.where(real, arrays["targets"][rows, -length:], 0)
  times = jnp.where(real, arrays["times"][rows, -length - 1:], 0)
  if per_position:
    negatives = jnp.asarray(catalogue_ids(num_items, batch_size))
  else:
    negatives = jax.random.randint(model.negatives_key(seed, step),
                                   (batch_size, num_negatives), 1,
                                   num_items + 1, jnp.int32)
  if "item_rows" in arrays:  # hashed ids: each item's table rows
    rows_of = arrays["item_rows"].__getitem__
  else:  # an item's row is its id
    rows_of = lambda ids: ids  # pylint: disable=unnecessary-lambda-assignment
  return {model.HISTORY: rows_of(history),
          model.POSITIVES: rows_of(positives),
          model.NEGATIVES: rows_of(negatives), model.POS_ITEMS: positives,
          model.NEG_ITEMS: negatives, model.TIMES: times,
          model.STEP: jnp.full(batch_size, step, jnp.int32),
          model.SEED: jnp.full(batch_size, seed, jnp.int32)}
