"""Unique rows of a batch's keys, with a static buffer size.

`unique_and_segments` turns the int32 keys of every entry of a stack (the
stacked row an entry trains, or FILL_VALUE for none) into the sorted unique
rows, padded with FILL_VALUE, and each entry's slot among them. The buffer
is shared by regions, one per table of the stack, so that a table capped by
its `max_unique` never takes another table's slots: a region's kept rows
take the slots right after the regions before it, so a batch's rows fill a
prefix of the buffer (the xla backend's update follows that prefix).

`unique_by_slot_map` has the same contract without a sort: it marks each
key's first position in a persistent int32 `[rows]` map (a scatter-min),
so its unique rows come in first-occurrence order (or sorted afterwards,
a sort of the unique slots only). Measured on XLA:CPU only
(docs/cpu_performance.md, "Dedup without a sort"); a collection's column
and replicated stacks run it with `dedup="slot_map"` (their maps live in
the state, `StackState.slot_map`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Pads unique rows; >= any row count, so the update skips it.
FILL_VALUE = np.iinfo(np.int32).max
# Every entry of a slot map between steps: above any key's position.
MAP_SENTINEL = np.iinfo(np.int32).max


def _check_regions(regions, num_unique: int, name: str):
  regions = tuple(regions) if regions else ((0, num_unique),)
  if sum(slots for _, slots in regions) != num_unique:
    raise ValueError(f"pallas_emb {name}: regions {regions} do not hold "
                     f"num_unique={num_unique} slots.")
  return regions


def _region_bounds(keys: jax.Array, real: jax.Array, regions, r: int):
  """Whether each key is a real key of region r (regions in row order)."""
  inside = real
  if r:
    inside &= keys >= regions[r][0]
  if r + 1 < len(regions):
    inside &= keys < regions[r + 1][0]
  return inside


def unique_and_segments(keys: jax.Array, num_unique: int, *,
                        regions: Sequence[tuple[int, int]] | None = None,
                        on_cpu: bool = False, on_tpu: bool = False,
                        sort_along: Sequence[jax.Array] = ()):
  """Sorted unique keys (padded with FILL_VALUE) and each key's slot.

  Args:
    keys: int32 `[N]` rows; FILL_VALUE marks a key that takes no slot.
    num_unique: the size of the unique buffer.
    regions: static `((first_row, slots), ...)` in row order: the keys in
      `[first_row, next first_row)` keep at most `slots` distinct rows (the
      slots of all regions sum to `num_unique`), numbered right after the
      rows the regions before kept: the kept rows are a sorted prefix of
      the buffer. None: one region of `num_unique` slots.
    on_cpu: pick the formulation XLA:CPU runs fastest (the same results):
      accelerators sort once with the positions as payload and scatter every
      key's slot back through that permutation; XLA:CPU sorts a lone int32
      array several times faster than one with a payload, so on CPU the
      keys are sorted alone and each finds its slot by binary search.
    on_tpu: no scatter (a TPU runs XLA's scatters a row at a time, about
      20 ns each on a v5e, and sorts 327,680 pairs in 0.6 ms): the unique
      rows are compacted and the slots put back in entry order by two more
      sorts.
    sort_along: arrays `[N]` that the first sort carries, the keys' positions
      breaking ties (on every platform): the entries in slot order, each
      slot's in entry order, for a consumer that would otherwise sort them
      again (the Mosaic gradient sums).

  Returns:
    `(unique_tokens [num_unique], segment_ids like keys, num_distinct,
    num_overflow)`: the kept rows sorted, then FILL_VALUE; a key whose
    region is full
    gets segment -1 and is counted in `num_overflow` (int32 scalars, over
    all regions). Given `sort_along`, a fifth: `(slots, *sort_along)`
    in slot order, `slots` holding each entry's slot (`num_unique` for
    none; those sit among the others where their keys sort).
  """
  n = keys.shape[0]
  regions = _check_regions(regions, num_unique, "unique_and_segments")
  along = ()
  if sort_along:
    ordered, order, *along = lax.sort(
        (keys, lax.iota(jnp.int32, n), *sort_along), num_keys=2)
  elif on_cpu:
    ordered = jnp.sort(keys)
  else:
    ordered, order = lax.sort((keys, lax.iota(jnp.int32, n)), num_keys=1)
  real = ordered != FILL_VALUE
  is_first = real & jnp.concatenate(
      [jnp.ones((min(n, 1),), bool), ordered[1:] != ordered[:-1]])
  rank = jnp.cumsum(is_first, dtype=jnp.int32) - 1  # among all distinct
  slot = jnp.full((n,), -1, jnp.int32)
  num_distinct = jnp.sum(is_first, dtype=jnp.int32)
  num_overflow = base = jnp.int32(0)
  for r, (first_row, slots) in enumerate(regions):
    inside = _region_bounds(ordered, real, regions, r)
    distinct = (num_distinct if len(regions) == 1 else
                jnp.sum(is_first & inside, dtype=jnp.int32))
    in_region = rank
    if r:  # the distinct keys of the regions before this one
      in_region = rank - jnp.sum(is_first & (ordered < first_row),
                                 dtype=jnp.int32)
    slot = jnp.where(inside & (in_region < slots), base + in_region, slot)
    kept = jnp.minimum(distinct, slots)
    num_overflow += distinct - kept
    base += kept
  kept_slot = jnp.where(is_first & (slot >= 0), slot, num_unique)
  by_slot = ((jnp.where(slot >= 0, slot, num_unique), *along),) if (
      sort_along) else ()
  if on_tpu:
    # The kept rows sorted by their slots come first; the slots, sorted by
    # the positions the keys came from, are back in entry order.
    _, compact = lax.sort((kept_slot, ordered), num_keys=1)
    compact = jnp.where(jnp.arange(n) < num_distinct - num_overflow,
                        compact, FILL_VALUE)
    unique_tokens = (compact[:num_unique] if n >= num_unique else
                     jnp.pad(compact, (0, num_unique - n),
                             constant_values=FILL_VALUE))
    _, segment_ids = lax.sort((order, slot), num_keys=1)
    return (unique_tokens, segment_ids, num_distinct, num_overflow, *by_slot)
  unique_tokens = jnp.full((num_unique,), FILL_VALUE, jnp.int32).at[
      kept_slot].set(ordered, mode="drop")
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
  return (unique_tokens, segment_ids, num_distinct, num_overflow, *by_slot)



def empty_slot_map(rows: int) -> jax.Array:
  """The slot map of `unique_by_slot_map` for keys in `[0, rows)`: int32
  `[rows]`, every entry at MAP_SENTINEL (4 bytes a row)."""
  return jnp.full((rows,), MAP_SENTINEL, jnp.int32)


def unique_by_slot_map(keys: jax.Array, num_unique: int, slot_map: jax.Array,
                       *, regions: Sequence[tuple[int, int]] | None = None,
                       sort_unique: bool = False):
  """`unique_and_segments` without a sort, through a persistent slot map.

  Each key's first position is the min over its positions (a scatter-min
  into `slot_map`, then a gather); a cumsum over the "I am the first" flags
  numbers the distinct keys; every key gathers its first position's slot;
  a scatter puts the touched entries back to MAP_SENTINEL. A min over int32
  positions does not depend on the scatter's order, so the result is exact
  and deterministic. Under `jit` with `slot_map` donated the map is updated
  in place: O(N) work, no `[rows]` pass.

  Differences from `unique_and_segments` (the same slots up to their
  order): the unique rows of a region are in FIRST-OCCURRENCE order, not
  sorted (unless `sort_unique`), after the kept rows of the regions before
  it (a prefix of the buffer, as there); a full region keeps its first distinct
  keys, not its smallest (the same counts: `num_overflow` does not change);
  a key outside `[0, rows)` takes no slot, like FILL_VALUE (the sort gives
  one to any key but FILL_VALUE). Which consumer needs sorted rows:
  docs/cpu_performance.md, "Dedup without a sort".

  Args:
    keys: int32 `[N]` rows in `[0, rows)`; FILL_VALUE (or any key outside)
      takes no slot.
    num_unique, regions: as `unique_and_segments`.
    slot_map: int32 `[rows]`, every entry MAP_SENTINEL (`empty_slot_map`).
    sort_unique: then sort the unique rows (a sort of the `num_unique`
      slots, not of the N keys) and renumber the segments:
      the results equal `unique_and_segments`' wherever no region is full.

  Returns:
    `(unique_tokens, segment_ids, num_distinct, num_overflow, slot_map)`:
    the first four as `unique_and_segments` (order aside), the map with
    every entry back at MAP_SENTINEL.
  """
  n, rows = keys.shape[0], slot_map.shape[0]
  regions = _check_regions(regions, num_unique, "unique_by_slot_map")
  if slot_map.dtype != jnp.int32 or slot_map.ndim != 1:
    raise ValueError(f"pallas_emb unique_by_slot_map: slot_map is "
                     f"{slot_map.dtype}{list(slot_map.shape)}; expected an "
                     "int32 [rows] array (empty_slot_map(rows)).")
  real = (keys >= 0) & (keys < rows)
  index = jnp.where(real, keys, rows)  # outside the map: dropped
  position = lax.iota(jnp.int32, n)
  slot_map = slot_map.at[index].min(position, mode="drop")
  first = slot_map.at[index].get(mode="fill", fill_value=n)
  is_first = real & (first == position)
  slot = jnp.full((n,), -1, jnp.int32)  # at first positions only
  num_overflow = base = jnp.int32(0)
  for r, (_, slots) in enumerate(regions):
    firsts = is_first & _region_bounds(keys, real, regions, r)
    in_region = jnp.cumsum(firsts, dtype=jnp.int32) - 1
    slot = jnp.where(firsts & (in_region < slots), base + in_region, slot)
    distinct = jnp.sum(firsts, dtype=jnp.int32)
    kept = jnp.minimum(distinct, slots)
    num_overflow += distinct - kept
    base += kept
  unique_tokens = jnp.full((num_unique,), FILL_VALUE, jnp.int32).at[
      jnp.where(slot >= 0, slot, num_unique)].set(keys, mode="drop")
  segment_ids = jnp.where(real, jnp.take(slot, first, mode="clip"), -1)
  if sort_unique:
    unique_tokens, segment_ids = _sort_slots(unique_tokens, segment_ids)
  # The reset writes what it read (made MAP_SENTINEL): depending on the
  # gather orders the gather first, so XLA updates the map in place.
  slot_map = slot_map.at[index].set(
      jnp.maximum(first, MAP_SENTINEL), mode="drop")
  return (unique_tokens, segment_ids, jnp.sum(is_first, dtype=jnp.int32),
          num_overflow, slot_map)


def _sort_slots(unique_tokens: jax.Array, segment_ids: jax.Array):
  """The unique rows sorted (FILL_VALUE last), the segments renumbered to
  follow their rows. Regions keep row order, so one sort sorts each.
  Sorted alone and found by binary search: XLA:CPU sorts a lone int32
  array several times faster than one with a payload."""
  ordered = jnp.sort(unique_tokens)
  # A real row is distinct in the buffer; FILL slots take no segment.
  renumber = jnp.searchsorted(ordered, unique_tokens).astype(jnp.int32)
  return ordered, jnp.where(
      segment_ids >= 0, jnp.take(renumber, segment_ids, mode="clip"), -1)
