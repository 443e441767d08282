"""What a collection is made of: tables, features and pooled bags.

    tables = [pe.TableSpec("items", 10_000_000, 64, optimizer=opt),
              pe.TableSpec("genre", 32, 16, optimizer=opt)]
    features = [pe.FeatureSpec("item_id", table="items"),     # [B]    -> [B, D]
                pe.FeatureSpec("history", table="items"),     # [B, L] -> [B, L, D]
                pe.FeatureSpec("genres", table="genre", combiner="mean")]

Plain frozen dataclasses, checked on construction (before anything is
traced); `pallas_emb.stacking` groups the tables into stacks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import validation
from pallas_emb.errors import InputError

Initializer = Callable[..., jax.Array]

# flax.linen.Embed's default: variance_scaling(1.0, "fan_in", "normal",
# out_axis=0), i.e. N(0, 1 / emb_width) rows.
default_initializer = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "normal", out_axis=0)

COMBINERS = ("sum", "mean", "sqrtn")
# Where a table's rows live over the communicator (see docs/placements.md).
PLACEMENTS = ("column", "row", "table", "replicated")
# Where a table's rows are stored (docs/host_tier.md): on the devices, or
# in host memory with a row cache on the devices.
STORAGES = ("device", "host")
CACHE_POLICIES = ("lru", "lfu")
# Placements a host-tier table may take (its cache is laid out like them).
HOST_PLACEMENTS = ("column", "row", "replicated")
MAX_INT32 = np.iinfo(np.int32).max


def _name_ok(name) -> bool:
  return isinstance(name, str) and bool(name)


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One logical embedding table `[vocab_rows, emb_width]`.

  Attributes:
    name: unique name; features refer to it, checkpoints store it.
    vocab_rows: rows (ids `[-vocab_rows, vocab_rows)` are wrapped once,
      then clamped into the table).
    emb_width: columns; must divide evenly over the communicator.
    optimizer: the sparse optimizer of its rows (e.g. `pe.RowwiseAdagrad`);
      None for a table that is only looked up (`apply_gradients` refuses it).
    dtype: float32 or bfloat16.
    initializer: `(key, shape, dtype) -> array`; default nn.Embed's.
    padding_id: the id of the padding row, in `[-vocab_rows, vocab_rows)`
      (None: none). The padding row is looked up like any row but never
      trains, whatever id reaches it after the wrap and clamp (so with 0,
      also -vocab_rows); in a pooled feature it weighs 0.
    max_unique: cap on the distinct rows of one batch this table may use in
      its stack's unique buffer (default: never overflows); a batch over
      the cap raises `UniqueOverflowError` when its stats are checked.
      `EmbeddingCollection.fit_max_unique` sets it from sample batches.
    placement: "column" (every rank holds all rows and `emb_width / W`
      columns), "row" (global row g of its stack on rank `g % W`, full
      width), "table" (the whole table on one rank) or "replicated" (the
      whole table on every rank).
    rank: the rank holding a "table"-placed table (None: balanced by
      bytes); only for placement "table".
    max_ids_per_partition: "row" and "table" placement: cap on the distinct
      rows of this table one rank sends to one owner per batch (default:
      never overflows); `EmbeddingCollection.fit_max_ids_per_partition`
      sets it from sample batches.
    storage: "device" (the table and its optimizer state on the devices)
      or "host" (both in host memory; the devices keep a cache of
      `cache_rows` of its rows; docs/host_tier.md).
    cache_rows: "host" storage: rows of the device cache (required; fewer
      than vocab_rows). Row placement spreads them over the ranks.
    cache_policy: "host" storage: which rows the cache evicts, "lru" (the
      least recently used) or "lfu" (the least frequently used).
    host_dir: "host" storage: an existing directory whose files
      (`<name>.rows`, `<name>.<slot>`) hold the rows and optimizer state,
      memory-mapped, for a table larger than the host's memory (the OS
      keeps the pages in use in RAM); None: plain host memory.
  """
  name: str
  vocab_rows: int
  emb_width: int
  _: dataclasses.KW_ONLY
  optimizer: Any
  dtype: Any = jnp.float32
  initializer: Initializer = default_initializer
  padding_id: int | None = None
  max_unique: int | None = None
  placement: str = "column"
  rank: int | None = None
  max_ids_per_partition: int | None = None
  storage: str = "device"
  cache_rows: int | None = None
  cache_policy: str = "lru"
  host_dir: str | os.PathLike | None = None

  def __post_init__(self):
    if not _name_ok(self.name):
      raise InputError(f"pallas_emb TableSpec name={self.name!r} must be a "
                       "non-empty string.")
    what = f"TableSpec {self.name!r}"
    for field in ("vocab_rows", "emb_width"):
      validation.check_positive(f"{what} {field}", getattr(self, field))
    if self.vocab_rows > MAX_INT32:
      raise InputError(
          f"pallas_emb {what} vocab_rows={self.vocab_rows} exceeds int32 "
          "ids; split the table or hash ids into a smaller range.")
    try:
      dtype = np.dtype(self.dtype)
    except TypeError as e:
      raise InputError(f"pallas_emb {what} dtype={self.dtype!r} is not a "
                       "dtype; use jnp.float32 or jnp.bfloat16.") from e
    if dtype.name not in validation.TABLE_DTYPES:
      raise InputError(f"pallas_emb {what} dtype={dtype.name}; expected one "
                       f"of {validation.TABLE_DTYPES}.")
    object.__setattr__(self, "dtype", dtype)
    if self.optimizer is not None and not hasattr(self.optimizer,
                                                  "update_rows"):
      raise InputError(
          f"pallas_emb {what} optimizer={self.optimizer!r} is not a sparse "
          "optimizer; pass one such as pallas_emb.RowwiseAdagrad(0.05), or "
          "None for a table that is only looked up.")
    if not callable(self.initializer):
      raise InputError(f"pallas_emb {what} initializer must be callable "
                       "(key, shape, dtype) -> array.")
    validation.check_padding_id(self.padding_id, self.vocab_rows, what)
    if self.max_unique is not None:
      validation.check_positive(f"{what} max_unique", self.max_unique)
    if self.placement not in PLACEMENTS:
      raise InputError(
          f"pallas_emb {what} placement={self.placement!r} is not a "
          f"placement; expected one of {PLACEMENTS}.")
    if self.rank is not None:
      if self.placement != "table":
        raise InputError(
            f"pallas_emb {what} rank={self.rank!r} is given for placement="
            f"{self.placement!r}; only a 'table'-placed table has a rank, so "
            "drop rank= or set placement='table'.")
      if (not isinstance(self.rank, (int, np.integer))
          or isinstance(self.rank, bool) or self.rank < 0):
        raise InputError(f"pallas_emb {what} rank={self.rank!r}; expected "
                         "an int >= 0 (a rank of the communicator).")
    if self.max_unique is not None and self.placement in ("row", "table"):
      raise InputError(
          f"pallas_emb {what} max_unique is given for placement="
          f"{self.placement!r}, whose owners size their buffers by "
          "max_ids_per_partition instead; give that cap.")
    if self.max_ids_per_partition is not None:
      if self.placement not in ("row", "table"):
        raise InputError(
            f"pallas_emb {what} max_ids_per_partition is given for "
            f"placement={self.placement!r}; it caps the ids a rank sends to "
            "an owner, so only 'row' and 'table' placements take it.")
      validation.check_positive(f"{what} max_ids_per_partition",
                                self.max_ids_per_partition)
    self._check_storage(what)

  def _check_storage(self, what: str) -> None:
    if self.storage not in STORAGES:
      raise InputError(f"pallas_emb {what} storage={self.storage!r}; "
                       f"expected one of {STORAGES}.")
    if self.cache_policy not in CACHE_POLICIES:
      raise InputError(f"pallas_emb {what} cache_policy="
                       f"{self.cache_policy!r}; expected one of "
                       f"{CACHE_POLICIES}.")
    if self.storage == "device":
      if (self.cache_rows is not None or self.cache_policy != "lru"
          or self.host_dir is not None):
        raise InputError(
            f"pallas_emb {what} has a cache_rows, cache_policy or host_dir "
            "but storage='device', whose rows all live on the devices; give "
            "storage='host' to keep the table in host memory with a device "
            "cache, or drop them.")
      return
    if self.host_dir is not None and not isinstance(self.host_dir,
                                                    (str, os.PathLike)):
      raise InputError(
          f"pallas_emb {what} host_dir={self.host_dir!r}; expected the path "
          "of a directory (str or os.PathLike), or None for host memory.")
    if self.cache_rows is None:
      raise InputError(
          f"pallas_emb {what} storage='host' needs cache_rows=C, the rows "
          "of its device cache (at least the distinct rows the batches in "
          "flight read: one batch's, three under the pipelined Trainer).")
    validation.check_positive(f"{what} cache_rows", self.cache_rows)
    if self.cache_rows >= self.vocab_rows:
      raise InputError(
          f"pallas_emb {what} cache_rows={self.cache_rows} is not fewer than "
          f"its vocab_rows={self.vocab_rows}: the whole table fits the "
          "cache; keep it on the devices (storage='device').")
    if self.placement not in HOST_PLACEMENTS:
      raise InputError(
          f"pallas_emb {what} storage='host' with placement="
          f"{self.placement!r}: a host-tier table's cache is column-, row- "
          f"or replicated-placed ({HOST_PLACEMENTS}); 'row' spreads it over "
          "every rank.")

  @property
  def host(self) -> bool:
    """Whether the table lives in host memory (with a device row cache)."""
    return self.storage == "host"

  @property
  def stack_key(self):
    """Tables with equal keys share one physical array; a host-tier table
    is a stack of its own (its cache and host store are its own)."""
    key = (self.placement, self.emb_width, self.dtype.name, self.optimizer)
    return key + (("host", self.name) if self.host else ())


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One sparse input feature read from `batch[name]`.

  Attributes:
    name: the batch key of its ids and the key of its embeddings.
    table: the name of the table its ids index.
    combiner: None for a sequence feature (ids of any shape `[B, ...]` give
      `[B, ..., D]`); "sum", "mean" or "sqrtn" pools a bag `[B, L]` into
      `[B, D]`.
    weighted: a pooled feature whose per-id weights are required (from
      `batch[name + "_weights"]` or a `pe.Bag`); any pooled feature may be
      given weights, e.g. the 0/1 padding mask of `pe.pad_ragged`.
  """
  name: str
  table: str
  _: dataclasses.KW_ONLY
  combiner: str | None = None
  weighted: bool = False

  def __post_init__(self):
    if not _name_ok(self.name):
      raise InputError(f"pallas_emb FeatureSpec name={self.name!r} must be "
                       "a non-empty string.")
    if not _name_ok(self.table):
      raise InputError(f"pallas_emb FeatureSpec {self.name!r} table="
                       f"{self.table!r} must name a TableSpec.")
    if self.combiner is not None and self.combiner not in COMBINERS:
      raise InputError(
          f"pallas_emb FeatureSpec {self.name!r} combiner={self.combiner!r}; "
          f"expected None (a sequence feature) or one of {COMBINERS}.")
    if self.weighted and self.combiner is None:
      raise InputError(f"pallas_emb FeatureSpec {self.name!r} weighted=True "
                       "needs a combiner ('sum', 'mean' or 'sqrtn').")


class Bag(NamedTuple):
  """The ids `[B, L]` of a pooled feature, with what marks the real ones.

  weights: f32 `[B, L]` per-id weights (a weighted feature); 0 = padding.
  lengths: int `[B]` valid ids per example (the first `lengths[b]`).
  Without either, the table's padding id (if any) marks the padding.
  """
  ids: Any
  weights: Any = None
  lengths: Any = None

