"""glibc malloc kept from unmapping XLA:CPU's per-step temporaries.

XLA:CPU takes a step's temporaries from malloc. glibc serves a block of
32 MiB or more (its dynamic mmap threshold's ceiling) by a fresh `mmap`
and unmaps it on free, so every step faults every page of it in again (a
4 KiB page costs microseconds here): a 10M-row step with 33 MiB of
temporaries ran 30.7 ms this way against 14.5 ms with the blocks reused
(`bench.fbgemm_compare`, docs/cpu_performance.md). So a collection on CPU
devices sets, once per process, `M_MMAP_MAX = 0` (no block is mmapped) and
`M_TRIM_THRESHOLD` to its maximum (freed memory stays in the heap for the
next step): the settings of `MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=...`, applied with `mallopt`. The cost: the process
keeps its peak heap. `PALLAS_EMB_SYSTEM_MALLOC=1` leaves malloc as it is.
Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

OPT_OUT = "PALLAS_EMB_SYSTEM_MALLOC"
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1

_applied: bool | None = None


def keep_freed_memory() -> bool:
  """Applies the settings once per process; True if they are in force."""
  global _applied
  if _applied is None:
    _applied = _apply()
  return _applied


def _apply() -> bool:
  if os.environ.get(OPT_OUT, "") not in ("", "0"):
    return False
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    ok = (libc.mallopt(_M_MMAP_MAX, 0) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1)
  except (OSError, AttributeError):
    return False
  if ok:
    logging.info("pallas_emb: glibc malloc keeps freed memory for reuse "
                 "(M_MMAP_MAX=0, M_TRIM_THRESHOLD=%d); set %s=1 to leave "
                 "it as it is.", _INT_MAX, OPT_OUT)
  return ok
