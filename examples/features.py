"""Host-side features of the MovieLens feature model (numpy only).

The side features and the implicit-feedback bag belong to users and items,
not to examples, so the feature model pools them per entity: every batch
carries, besides its examples' "user" and "item" ids `[B]`, the features of
every user and every item, and the model indexes the pooled rows with the
examples' ids. Pooling all 943 users' and 1,682 items' bags once per step
costs the same whatever the batch size (pooling per example costs B bags).

A bag feature (genres, title words, the implicit bag) is carried in
buckets of similar length, each its own `[rows_k, L_k]` feature of the same
table and combiner, so padding stays small: the implicit bags run from 16
to 582 items. Each entity is one row of one bucket (so sqrtn / mean pool
its whole bag), and `<name>_index` gives each entity's row in the buckets'
concatenation. Every leading dimension is padded with id-0 rows to a
multiple of the device count (the collection shards it).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from pallas_emb import datasets
from pallas_emb.datasets.movielens import SideFeatures

IMPLICIT = "implicit"
INDEX_SUFFIX = "_index"


def implicit_bags(train: datasets.Dataset, max_len: int = 0,
                  seed: int = 0) -> np.ndarray:
  """`[num_users, L]` int32: row u holds the items u rated in `train`.

  Sorted, 0-padded; row 0 (padding) is empty. With `max_len` > 0 a user
  with more items keeps a fixed random subset (seeded) of `max_len`.
  """
  users = train.features["user"]
  items = train.features["item"]
  order = np.lexsort((items, users))
  users, items = users[order], items[order]
  num_users = train.vocab_sizes["user"]
  counts = np.bincount(users, minlength=num_users)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  longest = int(counts.max()) if counts.size else 0
  width = max(1, min(longest, max_len) if max_len else longest)
  bags = np.zeros((num_users, width), np.int32)
  rng = np.random.default_rng([seed, 1])
  for user in np.flatnonzero(counts):
    row = items[starts[user]:starts[user] + counts[user]]
    if row.size > width:
      row = np.sort(rng.choice(row, width, replace=False))
    bags[user, :row.size] = row
  return bags


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _pad_rows(values: np.ndarray, multiple: int) -> np.ndarray:
  out = np.full((_round_up(values.shape[0], multiple),) + values.shape[1:],
                datasets.PAD_ID, values.dtype)
  out[:values.shape[0]] = values
  return out


def bucket_bags(bags: np.ndarray, multiple: int = 1
                ) -> tuple[list[np.ndarray], np.ndarray]:
  """Left-aligned 0-padded bags `[rows, L]` in buckets of similar length.

  Bucket k holds the bags of length in (2^(k-1), 2^k] (empty bags go to the
  first), `[rows_k, L_k]` with L_k its longest bag and rows_k padded with
  empty bags to a multiple of `multiple`. Returns (buckets, index): row r
  of `bags` is row index[r] of the buckets' concatenation.
  """
  lengths = np.count_nonzero(bags != datasets.PAD_ID, axis=1)
  keys = np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
  buckets, index, offset = [], np.zeros(bags.shape[0], np.int32), 0
  for key in np.unique(keys):
    rows = np.flatnonzero(keys == key)
    width = max(1, int(lengths[rows].max()))
    buckets.append(_pad_rows(bags[rows, :width], multiple))
    index[rows] = offset + np.arange(rows.size)
    offset += buckets[-1].shape[0]
  return buckets, index


@dataclasses.dataclass(frozen=True)
class EntityFeature:
  """A feature of users or items as the batch carries it.

  name: "user_<name>", "item_<name>" or "implicit"; side: whose ids index
  it ("user" / "item"); table: the table its ids index; parts: its batch
  keys (one `[rows]` array, or a bag's buckets); combiner: None for one id
  per entity, else the bags' combiner.
  """
  name: str
  side: str
  table: str
  parts: tuple[str, ...]
  combiner: str | None = None

  @property
  def index(self) -> str | None:
    """The batch key of a bag's row index (None for one id per entity)."""
    return self.name + INDEX_SUFFIX if self.combiner else None


class Featurizer:
  """Adds the per-entity features to rating batches.

  Args:
    users, items: the side features (None: that group is off).
    bags: `implicit_bags(train)` (None: no implicit feature).
    implicit_table: the table of the implicit bag's ids.
    combiners: the combiner of each side bag, by name.
    multiple: leading dimensions are padded to a multiple of this (the
      number of devices the batch is sharded over).
  """

  def __init__(self, users: SideFeatures | None, items: SideFeatures | None,
               bags: np.ndarray | None, *, implicit_table: str,
               combiners: Mapping[str, str], multiple: int = 1):
    self.features: list[EntityFeature] = []
    self.arrays: dict[str, np.ndarray] = {}
    for side, table in (("user", users), ("item", items)):
      for name, values in (table.values.items() if table else ()):
        self._add(f"{side}_{name}", side, name, values,
                  combiners.get(name) if values.ndim == 2 else None, multiple)
    if bags is not None:
      self._add(IMPLICIT, "user", implicit_table, bags, "sqrtn", multiple)

  def _add(self, name, side, table, values, combiner, multiple):
    if combiner is None:
      parts = (name,)
      self.arrays[name] = _pad_rows(values, multiple)
    else:
      buckets, index = bucket_bags(values, multiple)
      parts = tuple(f"{name}_{k}" for k in range(len(buckets)))
      self.arrays.update(zip(parts, buckets))
      self.arrays[name + INDEX_SUFFIX] = _pad_rows(index, multiple)
    self.features.append(EntityFeature(name, side, table, parts, combiner))

  def side_features(self) -> dict[str, tuple[EntityFeature, ...]]:
    """{"user": the user side features, "item": the item ones}."""
    return {side: tuple(f for f in self.features
                        if f.side == side and f.name != IMPLICIT)
            for side in ("user", "item")}

  @property
  def implicit(self) -> EntityFeature | None:
    return next((f for f in self.features if f.name == IMPLICIT), None)

  def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(batch, **self.arrays)
