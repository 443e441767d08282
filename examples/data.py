"""Data of a training run: the train / eval splits and batch placement."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from examples.config import ConfigError
from examples.config import FeaturesConfig
from examples.config import TrainConfig
from pallas_emb import datasets
from pallas_emb.datasets import movielens


# The validation split of split_seed s is carved from its training split
# with seed VALIDATION_SEED_OFFSET + s.
VALIDATION_SEED_OFFSET = 1000


@dataclasses.dataclass
class Data:
  """What a run trains and evaluates on.

  `evaluate` is the test split, or (with FeaturesConfig.validation_fraction)
  a validation split carved from the training split; `eval_name` says which.
  `users` / `items`: the MovieLens side features (feature model only).
  """
  train: datasets.Dataset
  evaluate: datasets.Dataset
  eval_name: str = "test"
  users: movielens.SideFeatures | None = None
  items: movielens.SideFeatures | None = None


def split(dataset: datasets.Dataset, fraction: float, seed: int):
  try:
    return datasets.split(dataset, fraction, seed=seed)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def movielens_path(config: TrainConfig) -> str:
  """`config.data_path`, or the ML-100k copy found (fetched when missing).

  A fresh machine has none: `datasets.find_movielens(download=True)` then
  runs `pip download --no-deps recbole==1.2.1 -d ~/.cache/pallas_emb` (the
  wheel holds ML-100k and its side features), as the test suite does.
  """
  return config.data_path or datasets.find_movielens(download=True)


def load_data(config: TrainConfig) -> Data:
  """Raises datasets.DataError for missing or malformed data."""
  users = items = None
  if isinstance(config, FeaturesConfig):
    dataset, users, items = movielens.load_movielens_features(
        movielens_path(config), zip_prefix_len=config.zip_prefix_len,
        year_bucket=config.year_bucket, title_buckets=config.title_buckets)
  elif config.data == "movielens":
    dataset = datasets.load_movielens(movielens_path(config))
  else:
    dataset = datasets.synthetic(
        config.num_examples, config.num_users, config.num_items,
        rank=config.signal_rank, zipf_exponent=config.zipf_exponent,
        noise_std=config.noise_std, seed=config.data_seed)
  train, test = split(dataset, config.test_fraction, config.split_seed)
  if getattr(config, "validation_fraction", 0):
    # Tuning: the test split is dropped here and never seen.
    train, val = split(train, config.validation_fraction,
                        VALIDATION_SEED_OFFSET + config.split_seed)
    return Data(train, val, "val", users, items)
  return Data(train, test, "test", users, items)


def place(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """A global host batch onto the token sharding (each process its shards)."""
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
  return {k: jax.make_array_from_callback(v.shape, sharding,
                                          lambda index, v=v: v[index])
          for k, v in batch.items()}
