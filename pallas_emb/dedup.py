"""Unique rows of a batch's keys, with a static buffer size.

`unique_and_segments` turns the int32 keys of every entry of a stack (the
stacked row an entry trains, or FILL_VALUE for none) into the sorted unique
rows, padded with FILL_VALUE, and each entry's slot among them. The buffer
is split into regions, one per table of the stack, so that a table capped by
its `max_unique` never takes another table's slots.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Pads unique rows; >= any row count, so the update skips it.
FILL_VALUE = np.iinfo(np.int32).max


def unique_and_segments(keys: jax.Array, num_unique: int, *,
                        regions: Sequence[tuple[int, int]] | None = None,
                        on_cpu: bool = False):
  """Sorted unique keys (padded with FILL_VALUE) and each key's slot.

  Args:
    keys: int32 `[N]` rows; FILL_VALUE marks a key that takes no slot.
    num_unique: the size of the unique buffer.
    regions: static `((first_row, slots), ...)` in row order: the keys in
      `[first_row, next first_row)` share `slots` consecutive slots of the
      buffer (the slots of all regions sum to `num_unique`). None: one
      region of `num_unique` slots.
    on_cpu: pick the formulation XLA:CPU runs fastest (the same results):
      accelerators sort once with the positions as payload and scatter every
      key's slot back through that permutation; XLA:CPU sorts a lone int32
      array several times faster than one with a payload, so on CPU the
      keys are sorted alone and each finds its slot by binary search.

  Returns:
    `(unique_tokens [num_unique], segment_ids like keys, num_distinct,
    num_overflow)`: sorted within each region; a key whose region is full
    gets segment -1 and is counted in `num_overflow` (int32 scalars, over
    all regions).
  """
  n = keys.shape[0]
  regions = tuple(regions) if regions else ((0, num_unique),)
  if sum(slots for _, slots in regions) != num_unique:
    raise ValueError(f"pallas_emb unique_and_segments: regions {regions} do "
                     f"not hold num_unique={num_unique} slots.")
  if on_cpu:
    ordered = jnp.sort(keys)
  else:
    ordered, order = lax.sort((keys, lax.iota(jnp.int32, n)), num_keys=1)
  real = ordered != FILL_VALUE
  is_first = real & jnp.concatenate(
      [jnp.ones((min(n, 1),), bool), ordered[1:] != ordered[:-1]])
  rank = jnp.cumsum(is_first, dtype=jnp.int32) - 1  # among all distinct
  slot = jnp.full((n,), -1, jnp.int32)
  num_distinct = jnp.sum(is_first, dtype=jnp.int32)
  num_overflow = jnp.int32(0)
  base = 0
  for r, (first_row, slots) in enumerate(regions):
    inside = real
    if r:
      inside &= ordered >= first_row
    if r + 1 < len(regions):
      inside &= ordered < regions[r + 1][0]
    distinct = (num_distinct if len(regions) == 1 else
                jnp.sum(is_first & inside, dtype=jnp.int32))
    in_region = rank
    if r:  # the distinct keys of the regions before this one
      in_region = rank - jnp.sum(is_first & (ordered < first_row),
                                 dtype=jnp.int32)
    slot = jnp.where(inside & (in_region < slots), base + in_region, slot)
    num_overflow += jnp.maximum(distinct - slots, 0)
    base += slots
  unique_tokens = jnp.full((num_unique,), FILL_VALUE, jnp.int32).at[
      jnp.where(is_first & (slot >= 0), slot, num_unique)].set(
          ordered, mode="drop")
  # `rank` does not grow inside a run of equal keys, so every position of
  # a run already holds its run's slot.
  if on_cpu:
    # Each key's first position in the sorted keys holds its slot.
    first = jnp.searchsorted(ordered, keys).astype(jnp.int32)
    segment_ids = jnp.where(keys != FILL_VALUE,
                            jnp.take(slot, first, mode="clip"), -1)
  else:
    segment_ids = jnp.zeros((n,), jnp.int32).at[order].set(
        slot, unique_indices=True)
  return unique_tokens, segment_ids, num_distinct, num_overflow

