"""Evicted rows on their way back to host memory.

A host-tier table's evicted rows that changed are read off the devices
and copied into host memory on one thread of their own, a group per
prefetch, in the order they left, beside the steps that follow.
`WriteBacks` tracks the groups on their way: until a group lands, a mask
per table part marks its rows, so a prefetch that would fetch one of them
waits first (`wait_for`: a row evicted and wanted again reads its latest
values); `finish` waits for every group (checkpoints, serving copies,
`table_arrays`); at most `MAX_PENDING_WRITE_BACKS` groups are on their
way at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
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
    self._leaving = None  # per part: a mask of the rows on their way
    self.waited = 0.0  # seconds spent waiting for groups to land, in all

  def start(self, rows, *args) -> None:
    """Sends a group (`rows`: each part's local rows) on its way."""
    if self._leaving is None:
      self._leaving = [np.zeros(n, bool) for n in self._part_rows]
    for leaving, local in zip(self._leaving, rows):
      leaving[local] = True
    self._pending.append(_thread().submit(self._land, rows, *args))
    while len(self._pending) > MAX_PENDING_WRITE_BACKS:
      self._wait_oldest()

  def _land(self, rows, *args) -> None:
    """On the write-back thread: one group into host memory."""
    self._copy(rows, *args)
    for leaving, local in zip(self._leaving, rows):
      leaving[local] = False

  def on_the_way(self, rows) -> bool:
    """Whether one of `rows` (each part's local rows) has not landed."""
    return bool(self._pending) and any(
        leaving[local].any() for leaving, local in zip(self._leaving, rows))

  def wait_for(self, rows) -> None:
    """Waits for the groups on their way when one of `rows` (each part's
    local rows, about to be read from host memory) is among them."""
    if self.on_the_way(rows):
      self.finish()

  def reap(self) -> None:
    """Forgets the groups that landed; a failed one raises here."""
    while self._pending and self._pending[0].done():
      self._pending.popleft().result()

  def finish(self) -> None:
    """Waits until every group on its way is in host memory."""
    while self._pending:
      self._wait_oldest()

  def _wait_oldest(self) -> None:
    start = time.perf_counter()
    try:
      self._pending.popleft().result()
    finally:
      self.waited += time.perf_counter() - start
