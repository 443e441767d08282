"""Caps fit to a sample of the stream (`fit_max_unique`,
`fit_max_ids_per_partition`).

Without caps a stack's buffers are sized for the worst case (every id
distinct); on skewed ids a batch uses a fraction of that. A fit sets each
table's cap to headroom x the most a sample batch needed, in multiples of 8.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import numpy as np

from pallas_emb import inputs as inputs_lib
from pallas_emb import stack as stack_lib
from pallas_emb.errors import InputError


def distinct_rows(coll, batch) -> dict[str, int]:
  """`{table: distinct rows one batch trains}` (`coll.distinct_rows`)."""
  inputs = inputs_lib.read_batch(coll, batch)
  rows = {name: [] for name in coll.tables}
  for layout in coll.layouts(batch):
    for f in layout.features:
      keys = np.asarray(jax.device_get(stack_lib.entry_keys(
          f, inputs.ids[f.name], inputs.weights.get(f.name))))
      rows[coll.features[f.name].table].append(keys[keys >= 0])
  return {name: int(np.unique(np.concatenate(r)).size)
          for name, r in rows.items()}


def fit_caps(coll, field: str, count, batches, headroom, placements):
  """`coll` with `field` (a `TableSpec` cap) of the tables of `placements`
  set to headroom x the most `count(batch)[table]` over `batches`, rounded
  up to a multiple of 8 (a table that had a cap keeps the smaller one)."""
  if (not isinstance(headroom, numbers.Real) or isinstance(headroom, bool)
      or not (np.isfinite(headroom) and headroom >= 1)):
    raise InputError(f"pallas_emb fit_{field} headroom={headroom!r}; "
                     "expected a finite number >= 1.")
  batches = list(batches)
  if not batches:
    raise InputError(f"pallas_emb fit_{field} got no batches; give at "
                     "least one sample batch of the stream.")
  most = {name: 0 for name in coll.tables}
  for batch in batches:
    for name, n in count(batch).items():
      most[name] = max(most[name], n)
  tables = []
  for name, spec in coll.tables.items():
    if spec.placement in placements:
      cap = 8 * max(1, math.ceil(headroom * most[name] / 8))
      if getattr(spec, field) is not None:
        cap = min(cap, getattr(spec, field))
      spec = dataclasses.replace(spec, **{field: cap})
    tables.append(spec)
  return type(coll)(
      tables, tuple(coll.features.values()), coll.mesh, coll.table_axis,
      data_axis=coll.data_axis, replica_axis=coll.replica_axis,
      backend=coll.backend, kernel_config=coll.kernel_config,
      dedup=coll.dedup)
