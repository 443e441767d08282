"""Which rows of a host-tier table its device cache holds, and which go.

A `RowCache` is the host's directory of one cache of `slots` rows over a
table part of `rows` rows (one rank's part for a row-placed table, the
whole table otherwise): numpy arrays only, no device. `admit` takes one
batch's distinct rows and says what must move:

  hits      rows already cached keep their slots (their use is recorded)
  misses    rows to bring from host memory, into free slots
  evictions when too few slots are free, cached rows that no batch in
            flight reads (`pinned`) leave, by the policy: "lru" the least
            recently used first, "lfu" the fewest ids read since they
            came in (ties: the least recently used)

Evictions come in groups of at least `slots // EVICT_FRACTION` rows (or as
many as needed). LRU finds them in a log of the slots each batch used, in
the order of use, from its oldest end: a slot's entry whose clock is no
longer the slot's stamp is stale (the slot was used again, or emptied) and
is dropped as the log is read, so the work follows the rows the batches
read, not O(slots) a group (docs/host_tier.md has the figures). Once
fewer slots are free than a group, the admissions that do not evict
read the log's oldest entries ahead (`READ_AHEAD_BATCHES`), so that most
of a pass's reading is done before it: the pass stalls a pipelined step,
the admissions before it run beside the devices' step. When the
log outgrows `LOG_SLOTS` times the slots, a compaction pass starts: each
admission then filters the stale entries out of the oldest part of the
log, at least `COMPACT_BATCHES` times its own rows, until the pass has
been over every entry the log held when it began (one pass at once was a
pause of 0.76 s at 8M slots). LFU ranks every cached slot by its count in one
O(slots) scan per group.

An evicted row that a batch trained since it came in is *dirty*: the
caller copies it back to host memory before anything reads it there. LFU
counts halve at every eviction pass (older popularity fades) and start
again from the batch's count when a row comes back in.

`admit` checks before it changes anything: a batch whose rows, with the
rows pinned by the batches in flight, need more than `slots` slots is a
`CacheTooSmall` (an `InputError`) and leaves the directory as it was.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from pallas_emb.errors import InputError

POLICIES = ("lru", "lfu")
# Evict at least this fraction of the slots per pass (see module doc).
EVICT_FRACTION = 32
# The LRU log is compacted when it holds this many times the slots, by
# each admission at least this many times its own rows (the log grows by
# at most a quarter of its size during a pass).
LOG_SLOTS = 3
COMPACT_BATCHES = 4
# LRU: an admission that does not evict, once fewer slots are free than a
# group, reads at least this many times its own rows off the log's oldest
# end ahead of the next eviction pass (`_read_ahead`).
READ_AHEAD_BATCHES = 2
_STAMP_BITS = 32


class CacheTooSmall(InputError):
  """A batch's rows and the rows in flight need more slots than a cache has.

  `needed`: the slots they need; `slots`: the cache's.
  """

  def __init__(self, message: str, needed: int, slots: int):
    super().__init__(message)
    self.needed, self.slots = needed, slots


class Admission(NamedTuple):
  """What one batch changes in one cache (rows are the part's local rows).

  slots: int32, the cache slot of each of the batch's rows (in the order
    given), after the batch is admitted.
  hit: bool, whether each of the batch's rows was cached already.
  fetch_rows, fetch_slots: the misses and the free slots they go to.
  evict_rows, evict_slots: the rows that left and the slots they held.
  dirty: bool per evicted row, whether a batch trained it since it came in
    (its values must be copied back to host memory).
  """
  slots: np.ndarray
  hit: np.ndarray
  fetch_rows: np.ndarray
  fetch_slots: np.ndarray
  evict_rows: np.ndarray
  evict_slots: np.ndarray
  dirty: np.ndarray


class RowCache:
  """The directory of one cache of `slots` rows over `rows` rows."""

  def __init__(self, slots: int, rows: int, policy: str = "lru"):
    if policy not in POLICIES:
      raise InputError(f"pallas_emb cache policy {policy!r}; expected one of "
                       f"{POLICIES}.")
    self.policy = policy
    self.num_slots = int(slots)
    self.row_slot = np.full(rows, -1, np.int32)
    self.slot_row = np.full(slots, -1, np.int32)
    # The clock at the slot's last use; -1 once emptied, so that a log
    # entry is current exactly where its clock is the stamp (int32: half
    # the bytes of the log's random reads; 2^31 admissions).
    self.stamp = np.full(slots, -1, np.int32)
    # LFU: ids read since it came in (LRU keeps none).
    self.count = np.zeros(slots if policy == "lfu" else 0, np.int64)
    self.dirty = np.zeros(slots, bool)
    # A stack of free slots, popped from the end: 0, 1, 2, ... first.
    self._free = np.arange(slots, dtype=np.int32)[::-1].copy()
    self._num_free = int(slots)
    self.clock = 0
    # LRU: (clock, slots used at that clock), oldest first, in two parts
    # (after `_ready`, below): `_head`, the entries a compaction pass has
    # filtered, all older than those of `_log`; their length together; the
    # entries of `_log` the pass has still to filter (0: no pass).
    self._head = collections.deque()
    self._log = collections.deque()
    self._log_size = 0
    self._to_compact = 0
    # LRU: entries read off the log's oldest end ahead of an eviction pass
    # (older than `_head`'s and `_log`'s, current when read), and their
    # length.
    self._ready = collections.deque()
    self._ready_size = 0
    self._excluded = np.zeros(slots, bool)  # scratch: pinned or in the batch

  @property
  def cached(self) -> int:
    """Rows in the cache now."""
    return self.num_slots - self._num_free

  def slots_of(self, rows: np.ndarray) -> np.ndarray:
    """int32 cache slot of each row (-1: not cached)."""
    return self.row_slot[rows]

  def needed(self, rows: np.ndarray, pinned: np.ndarray) -> int:
    """Slots that `rows` (distinct) and the `pinned` slots need together."""
    slots = self.row_slot[rows]
    # A mask over the slots: O(slots), but 15x faster than a sorted union.
    held = np.zeros(self.num_slots, bool)
    held[pinned] = True
    held[slots[slots >= 0]] = True
    return int(np.count_nonzero(held) + np.count_nonzero(slots < 0))

  def admit(self, rows: np.ndarray, counts: np.ndarray, trains: np.ndarray,
            pinned: np.ndarray, what: str = "cache") -> Admission:
    """Makes the distinct `rows` of one batch resident.

    Args:
      rows: int, the batch's distinct (local) rows.
      counts: int, ids of the batch that read each row (the LFU count).
      trains: bool, whether some id of the batch trains each row (it is
        marked dirty: its update will change it).
      pinned: int32 slots that batches in flight read (never evicted).
      what: names the cache in a `CacheTooSmall` message.
    """
    rows = np.asarray(rows, np.int64)
    slots = self.row_slot[rows]
    hit = slots >= 0
    misses = rows[~hit]
    n = misses.size
    evict_slots = np.zeros(0, np.int32)
    if n > self._num_free:
      evict_slots = self._victims(n - self._num_free, slots[hit], pinned,
                                  rows, what)
    evict_rows = self.slot_row[evict_slots].astype(np.int64)
    dirty = self.dirty[evict_slots].copy()
    # Evictions.
    self.row_slot[evict_rows] = -1
    self.slot_row[evict_slots] = -1
    self.stamp[evict_slots] = -1
    self.dirty[evict_slots] = False
    self._push(evict_slots)
    # Misses into free slots.
    fetch_slots = self._pop(n)
    self.row_slot[misses] = fetch_slots
    self.slot_row[fetch_slots] = misses
    slots = slots.copy()
    slots[~hit] = fetch_slots
    # Use, frequency and dirt of every row of the batch (counts: LFU's).
    self.stamp[slots] = self.clock
    self.dirty[slots[np.asarray(trains, bool)]] = True
    if self.policy == "lfu":
      self.count[fetch_slots] = 0
      self.count[slots] += np.asarray(counts, np.int64)
    elif slots.size:
      self._log.append((self.clock, slots))
      self._log_size += slots.size
      if not self._to_compact and (self._log_size
                                   > LOG_SLOTS * self.num_slots):
        self._to_compact = len(self._log)
      if self._to_compact:
        self._compact_log(COMPACT_BATCHES * slots.size)
      if not evict_slots.size and self._num_free < self._group_size():
        self._read_ahead(READ_AHEAD_BATCHES * slots.size)
    self.clock += 1
    return Admission(slots, hit, misses, fetch_slots, evict_rows,
                     evict_slots, dirty)

  def clean(self, slots: np.ndarray) -> None:
    """Marks `slots` as copied back to host memory."""
    self.dirty[slots] = False

  def dirty_slots(self) -> np.ndarray:
    return np.flatnonzero(self.dirty).astype(np.int32)

  # --- internals -------------------------------------------------------------

  def _victims(self, k: int, hit_slots, pinned, rows, what) -> np.ndarray:
    """At least `k` slots to evict (a group, see the module doc), none of
    them pinned or read by the batch; CacheTooSmall if there are fewer."""
    pinned = np.asarray(pinned, np.int64)
    excluded = self._excluded  # a mask, cleared again below
    excluded[pinned[self.slot_row[pinned] >= 0]] = True
    excluded[hit_slots] = True
    evictable = self.cached - np.count_nonzero(excluded)
    if evictable < k:
      excluded[pinned] = excluded[hit_slots] = False
      needed = self.needed(rows, pinned)
      raise CacheTooSmall(
          f"pallas_emb {what} needs {needed} rows resident at once (this "
          f"batch's {rows.size} distinct rows and those of the batches in "
          f"flight) but holds {self.num_slots}; raise cache_rows or use "
          "smaller batches.", needed, self.num_slots)
    group = min(evictable, max(k, self._group_size()))
    try:
      if self.policy == "lru":
        victims = self._least_recent(group)
      else:
        victims = self._least_frequent(group)
    finally:
      excluded[pinned] = excluded[hit_slots] = False
    # Sorted: without it a v5e host's evicting prefetch took 54-61 ms, not
    # 48-50 (a group of 393,216 slots), though the sort alone is about 6
    # ms on a 2-core CPU. Sorted, the group's slots are read and written
    # in the order of the directory's arrays, the likely reason.
    return np.sort(victims).astype(np.int32)

  def _group_size(self) -> int:
    return self.num_slots // EVICT_FRACTION

  def _oldest_entry(self):
    """`(clock, slots)` popped off the log's oldest end (the head first)."""
    if self._head:
      clock, entry = self._head.popleft()
    else:
      clock, entry = self._log.popleft()
      self._to_compact = max(self._to_compact - 1, 0)
    self._log_size -= entry.size
    return clock, entry

  def _read_ahead(self, budget: int) -> None:
    """Filters at least `budget` of the log's oldest entries into
    `_ready`, until it holds a group: the next eviction pass then reads
    few stale entries. (A stale entry never becomes current again: a
    slot's stamp only moves on, or to -1.)"""
    while (self._ready_size < self._group_size() and budget > 0
           and (self._head or self._log)):
      clock, entry = self._oldest_entry()
      budget -= entry.size
      entry = entry[self.stamp[entry] == clock]
      if entry.size:
        self._ready.append((clock, entry))
        self._ready_size += entry.size

  def _least_recent(self, group: int) -> np.ndarray:
    """The `group` least recently used evictable slots, from the log's
    oldest end, the entries read ahead first (ties: in the order the
    batch listed its rows)."""
    taken, kept = [], []
    while group:
      if self._ready:
        clock, entry = self._ready.popleft()
        self._ready_size -= entry.size
      else:
        clock, entry = self._oldest_entry()
      entry = entry[self.stamp[entry] == clock]
      free = np.flatnonzero(~self._excluded[entry])[:group]
      taken.append(entry[free])
      group -= free.size
      rest = np.delete(entry, free)
      if rest.size:
        kept.append((clock, rest))
        self._ready_size += rest.size
    # What is left of the entries read is filtered, and older than every
    # entry not read: the front of the entries read ahead.
    self._ready.extendleft(reversed(kept))
    return np.concatenate(taken)

  def _least_frequent(self, group: int) -> np.ndarray:
    """The `group` evictable slots of the fewest counts (ties: the least
    recently used), by one scan of the slots; the counts then halve."""
    candidates = np.flatnonzero((self.slot_row >= 0) & ~self._excluded)
    count = np.minimum(self.count[candidates], 2**(62 - _STAMP_BITS))
    key = (count << _STAMP_BITS) | self.stamp[candidates].astype(np.int64)
    if group < candidates.size:
      candidates = candidates[np.argpartition(key, group - 1)[:group]]
    self.count >>= 1  # aging: every eviction pass halves the counts
    return candidates

  def _compact_log(self, budget: int) -> None:
    """Filters the stale entries out of the oldest entries of the pass
    (above), at least `budget` of them, onto the head; at the pass's end
    the head and the rest of the log are one log again."""
    while self._to_compact and budget > 0:
      clock, entry = self._log.popleft()
      self._to_compact -= 1
      budget -= entry.size
      self._log_size -= entry.size
      entry = entry[self.stamp[entry] == clock]
      if entry.size:
        self._head.append((clock, entry))
        self._log_size += entry.size
    if not self._to_compact:
      self._log.extendleft(reversed(self._head))
      self._head.clear()

  def _push(self, slots: np.ndarray) -> None:
    n = slots.size
    self._free[self._num_free:self._num_free + n] = slots[::-1]
    self._num_free += n

  def _pop(self, n: int) -> np.ndarray:
    out = self._free[self._num_free - n:self._num_free][::-1].copy()
    self._num_free -= n
    return out
