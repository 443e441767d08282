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
The cost: the process keeps its peak heap (a freed large array stays
resident), and its threads share one arena's lock.

The user's settings win. A parameter that the environment sets (glibc's
`MALLOC_*` variables or `GLIBC_TUNABLES`' `glibc.malloc.*`: `USER_SETTINGS`)
is left as it is. A `mallopt` the process made before importing
pallas_emb cannot be read back from glibc, so it would be overridden: set
the variable instead. `PALLAS_EMB_SYSTEM_MALLOC=1` (or true / yes) leaves
malloc alone altogether; 0 / false / no / empty keep the settings; any
other value is an error at import. Other C libraries (musl, macOS) are left
alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import logging
import os
import platform

from pallas_emb.errors import InputError

OPT_OUT = "PALLAS_EMB_SYSTEM_MALLOC"
_OPT_OUT_VALUES = {"1": True, "true": True, "yes": True,
                   "0": False, "false": False, "no": False, "": False}
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1

# Per parameter we set: (mallopt's number, our value), and the glibc
# environment variables and tunables (`GLIBC_TUNABLES=glibc.malloc.<name>=
# ...`) through which a user sets it or the behaviour it governs (the
# mmap threshold for mmapping, the top pad for trimming, the arena test
# for arenas). Any of them set: the parameter is the user's.
_PARAMETERS = {
    "M_ARENA_MAX": (_M_ARENA_MAX, 1),
    "M_MMAP_MAX": (_M_MMAP_MAX, 0),
    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, _INT_MAX),
}
USER_SETTINGS = {
    "M_ARENA_MAX": (("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST"),
                    ("arena_max", "arena_test")),
    "M_MMAP_MAX": (("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_"),
                   ("mmap_max", "mmap_threshold")),
    "M_TRIM_THRESHOLD": (("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"),
                         ("trim_threshold", "top_pad")),
}

_kept: bool | None = None
# Whether every thread allocates from the main heap (set by `at_import`,
# or by the user's own MALLOC_ARENA_MAX=1).
_one_arena: bool = False


def opted_out() -> bool:
  """`PALLAS_EMB_SYSTEM_MALLOC`, parsed strictly (InputError otherwise)."""
  value = os.environ.get(OPT_OUT, "")
  try:
    return _OPT_OUT_VALUES[value.strip().lower()]
  except KeyError:
    raise InputError(
        f"pallas_emb {OPT_OUT}={value!r} is not a yes or no; expected one "
        "of 1, true, yes (leave glibc malloc as it is) or 0, false, no, "
        "empty (let pallas_emb keep freed memory on CPU), in any "
        "case.") from None


def user_setting(parameter: str) -> str | None:
  """The environment variable or tunable by which the user set `parameter`
  (a key of `USER_SETTINGS`), or None. An empty variable is unset."""
  variables, tunables = USER_SETTINGS[parameter]
  for name in variables:
    if os.environ.get(name, ""):
      return name
  for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
    name = item.split("=", 1)[0].strip()
    if name in {f"glibc.malloc.{t}" for t in tunables}:
      return f"GLIBC_TUNABLES={name}"
  return None


def _set(libc, parameter: str) -> bool:
  """mallopt(parameter) unless the user set it; True if it is ours now."""
  if user_setting(parameter) is not None:
    return False
  number, value = _PARAMETERS[parameter]
  return libc.mallopt(number, value) == 1


def at_import() -> None:
  """At `import pallas_emb`: in a process whose JAX will run on CPU and has
  not started its backends, one arena and freed memory kept (each unless
  the user set it)."""
  global _one_arena
  libc = _glibc()
  if libc is None or not _jax_will_run_on_cpu():
    return
  _one_arena = _set(libc, "M_ARENA_MAX")
  keep_freed_memory()


def keep_freed_memory() -> bool:
  """Applies the settings that can still take effect and that the user did
  not make, once per process; True if freed memory is kept (both ours).
  Logs how to get one arena if it is too late for it (XLA's threads
  already have theirs) and the user did not choose."""
  global _kept
  if _kept is not None:
    return _kept
  libc = _glibc()
  if libc is None:
    _kept = False
    return _kept
  mmap, trim = _set(libc, "M_MMAP_MAX"), _set(libc, "M_TRIM_THRESHOLD")
  _kept = mmap and trim
  ours = [name for name, done in (("M_MMAP_MAX=0", mmap), (
      f"M_TRIM_THRESHOLD={_INT_MAX}", trim), ("M_ARENA_MAX=1", _one_arena))
          if done]
  if ours:
    logging.info("pallas_emb: glibc malloc keeps freed memory for reuse "
                 "(%s); set %s=1 to leave it as it is.", ", ".join(ours),
                 OPT_OUT)
  if _kept and not _one_arena and user_setting("M_ARENA_MAX") is None:
    logging.warning(
        "pallas_emb: JAX ran before pallas_emb was imported, so XLA:CPU's "
        "threads have their own malloc arenas, which mmap every block over "
        "64 MiB afresh each step (page faults: up to 6x slower steps with "
        "large temporaries); import pallas_emb before running JAX, or start "
        "the process with MALLOC_ARENA_MAX=1.")
  return _kept


def _glibc():
  """glibc through ctypes, or None (another C library, or opted out)."""
  if opted_out():
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
