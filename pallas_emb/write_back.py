"""Evicted rows on their way back to host memory.

A host-tier table's evicted rows that changed are read off the devices
and copied into host memory on one thread of their own, a group per
prefetch, in the order they left, beside the steps that follow.
`WriteBacks` tracks the groups on their way: until a group lands, a count
per row of each table part marks its rows. A prefetch that would fetch
one of them takes it from the newest group's rows still on the devices
(`from_newest`: the latest values, with no wait), or, where one is only
in an older group, waits for the groups first (`wait_for`). `finish`
waits for every group (checkpoints, serving copies, `table_arrays`); at
most `MAX_PENDING_WRITE_BACKS` groups are on their way at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
from typing import Callable, Sequence

import numpy as np

# Groups on their way to host memory at once, at most: a group that would
# be one more first waits for the oldest.
MAX_PENDING_WRITE_BACKS = 4


@functools.cache
def _thread() -> concurrent.futures.ThreadPoolExecutor:
  """One thread: groups land in host memory in the order they left."""
  return concurrent.futures.ThreadPoolExecutor(
      1, thread_name_prefix="pallas_emb_write_back")


class WriteBacks:
  """The write-back groups of one host-tier table on their way.

  `land(rows, *args)` copies one group into host memory (on the write-back
  thread); `rows` is each table part's local rows, and `part_rows` the
  rows of each part (the masks' sizes; they are made at the first group).
  """

  def __init__(self, land: Callable[..., None], part_rows: Sequence[int]):
    self._copy = land
    self._part_rows = tuple(part_rows)
    self._pending = collections.deque()  # futures, oldest first
    # The newest group: (each part's local rows, rows per part, the rows'
    # values on the devices), kept until it lands.
    self._newest = None
    # Per part, how many groups on their way hold each row (a row taken
    # back from a group and evicted again is in two), changed under the
    # lock by `start` and the thread.
    self._leaving = None
    self._lock = threading.Lock()
    self.waited = 0.0  # seconds spent waiting for groups to land, in all

  def start(self, rows, n: int, values) -> None:
    """Sends a group on its way: `rows` each part's local rows, `n` rows
    per part in `values` (per array, on the devices; part r's at rows
    `r * n + k`), which `land(rows, n, values)` copies."""
    if self._leaving is None:
      self._leaving = [np.zeros(k, np.uint8) for k in self._part_rows]
    with self._lock:
      for leaving, local in zip(self._leaving, rows):
        leaving[local] += 1
    self._newest = (rows, n, values)
    self._pending.append(_thread().submit(self._land, rows, n, values))
    while len(self._pending) > MAX_PENDING_WRITE_BACKS:
      self._wait_oldest()

  def _land(self, rows, n, values) -> None:
    """On the write-back thread: one group into host memory."""
    self._copy(rows, n, values)
    with self._lock:
      for leaving, local in zip(self._leaving, rows):
        leaving[local] -= 1

  def on_the_way(self, rows) -> bool:
    """Whether one of `rows` (each part's local rows) has not landed."""
    return bool(self._pending) and any(
        (leaving[local] > 0).any()
        for leaving, local in zip(self._leaving, rows))

  def from_newest(self, rows, size: int):
    """Where the newest group still on its way holds `rows` (each part's
    local rows, distinct): `(positions, values)`, `positions` int32
    `[parts * size]`, part r's k-th row at `r * size + k`, its row in
    part r's block of `values` (the group's arrays on the devices) or -1
    where it is not on its way; None when no row is on its way, or one is
    only in an older group (then `wait_for` them)."""
    if not self.on_the_way(rows):
      return None
    group, _, values = self._newest
    positions = np.full(len(rows) * size, -1, np.int32)
    for r, (leaving, local, left) in enumerate(zip(self._leaving, rows,
                                                   group)):
      wanted = np.flatnonzero(leaving[local] > 0)
      if not wanted.size:
        continue
      # The group's rows looked up among the few wanted ones (sorted).
      order = np.argsort(local[wanted])
      keys = local[wanted][order]
      at = np.minimum(np.searchsorted(keys, left), keys.size - 1)
      found = keys[at] == left
      if np.count_nonzero(found) < wanted.size:
        return None  # one is only in an older group
      positions[r * size + wanted[order[at[found]]]] = np.flatnonzero(found)
    return positions, values

  def wait_for(self, rows) -> None:
    """Waits for the groups on their way when one of `rows` (each part's
    local rows, about to be read from host memory) is among them."""
    if self.on_the_way(rows):
      self.finish()

  def reap(self) -> None:
    """Forgets the groups that landed; a failed one raises here."""
    while self._pending and self._pending[0].done():
      self._pending.popleft().result()
    if not self._pending:
      self._newest = None  # its rows on the devices are not needed

  def finish(self) -> None:
    """Waits until every group on its way is in host memory."""
    while self._pending:
      self._wait_oldest()
    self._newest = None

  def _wait_oldest(self) -> None:
    start = time.perf_counter()
    try:
      self._pending.popleft().result()
    finally:
      self.waited += time.perf_counter() - start
