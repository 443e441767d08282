"""The dataset type shared by the loaders, its split and its batches.

Pure numpy + stdlib (no jax), so it can be imported anywhere.

Id convention: the library gives the padding id 0 no gradient, so id 0 is
never a real user or item here. Every real id is >= 1, and
`vocab_sizes[feature]` counts the padding row too (num_distinct + 1).
`eval_batches` pads its last batch with id 0 and weight 0.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Mapping

import numpy as np

PAD_ID = 0
LABEL_KEY = "label"
WEIGHT_KEY = "weight"


class DataError(ValueError):
  """Missing or malformed input data."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """Examples of a rating / CTR task with categorical feature columns.

  Attributes:
    features: feature name -> int32 [N] ids. Real ids are in [1, vocab);
      id 0 is reserved for padding and never occurs.
    labels: float32 [N] targets.
    vocab_sizes: feature name -> rows of its table, padding row included.
    name: a short human-readable name.
    label_floor: the lowest achievable MSE when known (the noise variance
      of synthetic data), else None.
  """

  features: Mapping[str, np.ndarray]
  labels: np.ndarray
  vocab_sizes: Mapping[str, int]
  name: str
  label_floor: float | None = None

  def __post_init__(self):
    _check_dataset(self)

  @property
  def num_examples(self) -> int:
    return int(self.labels.shape[0])

  def __len__(self) -> int:
    return self.num_examples

  def take(self, indices: np.ndarray, name: str | None = None) -> Dataset:
    """The examples at `indices`, with the same vocab sizes."""
    return Dataset(
        features={k: v[indices] for k, v in self.features.items()},
        labels=self.labels[indices],
        vocab_sizes=dict(self.vocab_sizes),
        name=self.name if name is None else name,
        label_floor=self.label_floor)


def _check_dataset(ds: Dataset) -> None:
  labels = ds.labels
  if not isinstance(labels, np.ndarray) or labels.dtype != np.float32 \
      or labels.ndim != 1:
    raise DataError(f"Dataset {ds.name!r}: labels must be a 1-D float32 "
                    f"array; got {getattr(labels, 'dtype', type(labels))} "
                    f"with shape {getattr(labels, 'shape', None)}.")
  if set(ds.features) != set(ds.vocab_sizes):
    raise DataError(f"Dataset {ds.name!r}: features {sorted(ds.features)} "
                    f"and vocab_sizes {sorted(ds.vocab_sizes)} differ.")
  for key, ids in ds.features.items():
    if key in (LABEL_KEY, WEIGHT_KEY):
      raise DataError(f"Dataset {ds.name!r}: feature name {key!r} is "
                      "reserved for batches.")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int32 \
        or ids.shape != labels.shape:
      raise DataError(f"Dataset {ds.name!r}: feature {key!r} must be an "
                      f"int32 array of shape {labels.shape}; got "
                      f"{getattr(ids, 'dtype', type(ids))} with shape "
                      f"{getattr(ids, 'shape', None)}.")
    vocab = ds.vocab_sizes[key]
    if ids.size and (ids.min() < 1 or ids.max() >= vocab):
      raise DataError(f"Dataset {ds.name!r}: feature {key!r} ids span "
                      f"[{ids.min()}, {ids.max()}] but must lie in "
                      f"[1, {vocab}) (id {PAD_ID} is padding).")


def check_positive_int(name: str, value) -> None:
  """Raises ValueError unless `value` is an integer >= 1 (bools are not)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
      or value < 1:
    raise ValueError(f"pallas_emb data: {name}={value!r} must be a positive "
                     "integer.")


# ----------------------------------------------------------------------------
# Splits and batches.


def split(dataset: Dataset, test_fraction: float = 0.2,
          seed: int = 0) -> tuple[Dataset, Dataset]:
  """A seeded random (train, test) split; both keep the full vocab sizes.

  The test set gets round(N * test_fraction) examples; each side keeps the
  original example order.
  """
  if not 0 < test_fraction < 1:
    raise ValueError(f"pallas_emb data: test_fraction={test_fraction} must "
                     "be in (0, 1).")
  n = dataset.num_examples
  num_test = int(round(n * test_fraction))
  if not 0 < num_test < n:
    raise ValueError(f"pallas_emb data: splitting {n} examples with "
                     f"test_fraction={test_fraction} leaves a side empty.")
  order = np.random.default_rng(seed).permutation(n)
  test_idx, train_idx = np.sort(order[:num_test]), np.sort(order[num_test:])
  return (dataset.take(train_idx, f"{dataset.name}/train"),
          dataset.take(test_idx, f"{dataset.name}/test"))


def _batch(dataset: Dataset, idx) -> dict[str, np.ndarray]:
  out = {k: v[idx] for k, v in dataset.features.items()}
  out[LABEL_KEY] = dataset.labels[idx]
  return out


def batches(dataset: Dataset, batch_size: int, *, seed: int,
            epochs: int | None = None,
            drop_remainder: bool = True) -> Iterator[dict[str, np.ndarray]]:
  """Shuffled training batches {feature: int32[B], "label": float32[B]}.

  Epoch e is shuffled by default_rng([seed, e]), so the stream is a pure
  function of (dataset, batch_size, seed) and any epoch can be reproduced
  alone. epochs=None repeats forever. With drop_remainder=False the last
  batch of each epoch may be shorter (a new shape under jit).
  """
  check_positive_int("batch_size", batch_size)
  if epochs is not None and (isinstance(epochs, bool) or epochs < 0):
    raise ValueError(f"pallas_emb data: epochs={epochs!r} must be >= 0 or "
                     "None.")
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
      or seed < 0:
    raise ValueError(f"pallas_emb data: seed={seed!r} must be an integer "
                     ">= 0.")
  n = dataset.num_examples
  per_epoch = n // batch_size if drop_remainder else math.ceil(n / batch_size)
  if per_epoch == 0:
    # Otherwise an infinite stream would spin forever yielding nothing.
    raise ValueError(f"pallas_emb data: {dataset.name!r} has {n} examples, "
                     f"fewer than batch_size={batch_size} with "
                     "drop_remainder=True.")
  return _batch_stream(dataset, batch_size, seed, epochs, per_epoch)


def _batch_stream(dataset, batch_size, seed, epochs, per_epoch):
  epoch = 0
  while epochs is None or epoch < epochs:
    order = np.random.default_rng([seed, epoch]).permutation(
        dataset.num_examples)
    for b in range(per_epoch):
      yield _batch(dataset, order[b * batch_size:(b + 1) * batch_size])
    epoch += 1


def eval_batches(dataset: Dataset,
                 batch_size: int) -> Iterator[dict[str, np.ndarray]]:
  """Every example once, in order, in batches of exactly `batch_size`.

  Yields {feature: int32[B], "label": float32[B], "weight": float32[B]};
  the last batch is padded with id 0, label 0 and weight 0, so weighted
  sums over all batches count each real example exactly once.
  """
  check_positive_int("batch_size", batch_size)
  return _eval_stream(dataset, batch_size)


def _eval_stream(dataset, batch_size):
  n = dataset.num_examples
  for start in range(0, n, batch_size):
    real = min(batch_size, n - start)
    out = {}
    for key, values in list(dataset.features.items()) + [
        (LABEL_KEY, dataset.labels)]:
      padded = np.full(batch_size, PAD_ID, values.dtype)
      padded[:real] = values[start:start + real]
      out[key] = padded
    weight = np.zeros(batch_size, np.float32)
    weight[:real] = 1
    out[WEIGHT_KEY] = weight
    yield out
