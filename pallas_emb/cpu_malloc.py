"""glibc malloc kept from unmapping XLA:CPU's per-step temporaries.

XLA:CPU takes a step's temporaries from malloc, in its own threads. glibc
serves a block from fresh pages by `mmap`, and unmaps it on free, when the
block is over 32 MiB (its dynamic mmap threshold's ceiling) or when a
thread's arena cannot hold it: a thread other than the main one allocates
from an arena of 64 MiB heaps, so a larger block is always mmapped,
whatever `M_MMAP_MAX` says. Every step then faults every page of it in
again (a 4 KiB page costs microseconds): a jitted scatter-add into a fresh
`[327,680, 64]` f32 buffer ran 41 ms against 6.4 ms with the block reused
(docs/cpu_performance.md, "A step's temporaries and glibc's malloc").

So, in a process whose JAX runs on CPU:
- `M_MMAP_MAX = 0` (no block is mmapped) and `M_TRIM_THRESHOLD` at its
  maximum (freed memory stays in the heap for the next step), set by a
  collection on CPU devices or at import;
- `M_ARENA_MAX = 1` (every thread allocates from the main heap, which has
  no 64 MiB limit), set at `import pallas_emb`, before any thread of
  XLA's has an arena of its own. Imported later, a collection logs how to
  get it: `MALLOC_ARENA_MAX=1` in the environment.
The cost: the process keeps its peak heap, and its threads share one
arena's lock. `PALLAS_EMB_SYSTEM_MALLOC=1` leaves malloc as it is. Other C
libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import os
import platform

OPT_OUT = "PALLAS_EMB_SYSTEM_MALLOC"
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

_kept: bool | None = None
# Whether every thread allocates from the main heap (set by the
# environment, or by `at_import`).
_one_arena: bool = os.environ.get("MALLOC_ARENA_MAX") == "1"


def at_import() -> None:
  """At `import pallas_emb`: in a process whose JAX will run on CPU and has
  not started its backends, one arena and freed memory kept."""
  global _one_arena
  libc = _glibc()
  if libc is None or not _jax_will_run_on_cpu():
    return
  _one_arena = _one_arena or libc.mallopt(_M_ARENA_MAX, 1) == 1
  keep_freed_memory()


def keep_freed_memory() -> bool:
  """Applies the settings that can still take effect, once per process;
  True if freed memory is kept. Logs how to get one arena if it is too
  late for it (XLA's threads already have theirs)."""
  global _kept
  if _kept is not None:
    return _kept
  libc = _glibc()
  _kept = bool(libc and libc.mallopt(_M_MMAP_MAX, 0) == 1
               and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1)
  if _kept:
    logging.info("pallas_emb: glibc malloc keeps freed memory for reuse "
                 "(M_MMAP_MAX=0, M_TRIM_THRESHOLD=%d%s); set %s=1 to leave "
                 "it as it is.", _INT_MAX,
                 ", M_ARENA_MAX=1" if _one_arena else "", OPT_OUT)
  if _kept and not _one_arena:
    logging.warning(
        "pallas_emb: JAX ran before pallas_emb was imported, so XLA:CPU's "
        "threads have their own malloc arenas, which mmap every block over "
        "64 MiB afresh each step (page faults: up to 6x slower steps with "
        "large temporaries); import pallas_emb before running JAX, or start "
        "the process with MALLOC_ARENA_MAX=1.")
  return _kept


def _glibc():
  """glibc through ctypes, or None (another C library, or opted out)."""
  if os.environ.get(OPT_OUT, "") not in ("", "0"):
    return None
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt  # pylint: disable=pointless-statement
  except (OSError, AttributeError):
    return None
  return libc


def _jax_will_run_on_cpu() -> bool:
  """Before JAX starts its backends: whether its default one will be the
  CPU (JAX_PLATFORMS names cpu first, or no accelerator is installed:
  neither libtpu nor a PJRT plugin). False once the backends started."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge.backends_are_initialized():
    return False
  import jax  # pylint: disable=import-outside-toplevel
  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  if importlib.util.find_spec("libtpu") is not None:
    return False
  if importlib.util.find_spec("jax_plugins") is not None:
    return False
  return not importlib.metadata.entry_points(group="jax_plugins")
