"""Reading a batch on the host for the host tier: each host-tier stack's
distinct rows, the ids reading each, and whether some id trains it, in
numpy (`batch_rows`), for the prefetch to make them resident while the
devices run the step before (docs/host_tier.md).
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_emb import host_memory
from pallas_emb import inputs as inputs_lib
from pallas_emb import validation
from pallas_emb.specs import Bag


def host_keys(ids: np.ndarray, vocab_rows: int, padding_id) -> np.ndarray:
  """`stack.entry_keys` of one table's ids (weights not read), in numpy.

  The host reads a batch while the devices run the step before; on a CPU
  platform a jitted `entry_keys` would queue behind that step on the same
  device, so the prefetch runs the same rule in numpy
  (`tests/host_tier_test.py` holds the two equal on every edge case).
  """
  x = ids.reshape(-1).astype(np.int64)
  wrapped = np.where(x < 0, x + vocab_rows, x)
  row = np.clip(wrapped, 0, vocab_rows - 1)
  trains = (wrapped >= 0) & (wrapped < vocab_rows)
  if padding_id is not None:  # the padding row, whatever id reaches it
    trains &= row != padding_id % vocab_rows
  return np.where(trains, row, ~row)


def _host_ids(ids, what: str) -> np.ndarray:
  """A feature's ids as host int32 (`validation.as_ids`' checks)."""
  if isinstance(ids, np.ndarray) and ids.dtype == np.int32:
    return ids
  with jax.default_device(host_memory.cpu_device()):
    return np.asarray(validation.as_ids(ids, what))


def batch_rows(coll, batch) -> dict[str, tuple]:
  """Host-side: per host-tier stack, `(rows, counts, trains, keys)`: the
  distinct logical rows its features' ids read (`stack.entry_keys`' rule:
  wrap once, clamp), the ids reading each, whether some id trains it
  (inside its table, not padding; weights are not read, so a row of
  weight-0 entries counts as trained: at worst it is copied back
  unchanged), and `{feature: the row of each of its ids}` (int32, flat:
  `host_keys`' row)."""
  inputs_lib.check_per_feature(coll.features, batch, "batch", "ids",
                               "Give every feature's ids.")
  out = {}
  for stack in coll.plan.stacks:
    if not stack.host:
      continue
    spec = coll.tables[stack.tables[0]]
    by_feature = {}
    for name in stack.features:
      value = batch[name]
      ids = _host_ids(value.ids if isinstance(value, Bag) else value,
                      f"batch[{name!r}]")
      by_feature[name] = host_keys(ids, spec.vocab_rows, spec.padding_id)
    keys = np.concatenate(list(by_feature.values()))
    # One sort of (row, does not train): a row's first entry says whether
    # any of its ids trains (a numpy `searchsorted` of every id into the
    # distinct rows costs 20x more). Rows are below 2**31, so the pairs fit
    # 32 bits, whose sort takes about half the time of 64-bit keys'.
    rows = np.where(keys < 0, ~keys, keys).astype(np.uint32)
    order = np.sort((rows << 1) | (keys < 0))
    starts = np.flatnonzero(np.concatenate(
        [[True], (order[1:] >> 1) != (order[:-1] >> 1)]))
    first = order[starts]
    # Each feature's entries' rows, as int32 views (rows are below 2**31).
    ends = np.cumsum([k.size for k in by_feature.values()])[:-1]
    entry_rows = dict(zip(by_feature, np.split(rows.view(np.int32), ends)))
    out[stack.name] = ((first >> 1).astype(np.int64),
                       np.diff(np.append(starts, order.size)),
                       (first & 1) == 0, entry_rows)
  return out
