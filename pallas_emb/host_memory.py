"""Host memory for host-tier tables: its size, the check that it fits,
and filling it.

A host-tier table (docs/host_tier.md) keeps its rows and optimizer slots
in numpy arrays of host memory. `check_host_memory` compares what they
take (`StackPlan.host_bytes`) with what the host has available before
anything is allocated; `init_table` and `init_slots` fill them, a table
chunk by chunk on the host's CPU device (never a second copy of it);
`in_chunks` runs the large row copies in and out of them on threads.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

import jax
import numpy as np

from pallas_emb.errors import InputError

# Host arrays are filled, quantized and checked in chunks of about this
# many bytes (a 25.6 GB table never needs a second copy).
CHUNK_BYTES = 1 << 28
# Host row copies of at least this many rows run on up to MAX_THREADS
# threads (`in_chunks`).
PARALLEL_ROWS = 16384
MAX_THREADS = 8


def cpu_device():
  """The host's CPU device (host arrays are computed on it)."""
  return jax.devices("cpu")[0]


def chunk_rows(width: int, itemsize: int) -> int:
  return max(1, CHUNK_BYTES // max(1, width * itemsize))


def available_host_bytes() -> int | None:
  """The host memory the kernel says is available (Linux `MemAvailable`),
  or None where it does not say."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def check_host_memory(coll, what: str) -> None:
  """Raises InputError, before any of it is allocated, when the host-tier
  tables' rows and optimizer state (`StackPlan.host_bytes`) exceed the
  host's available memory: a clear error instead of the kernel's
  out-of-memory kill part way through filling them."""
  stacks = [s for s in coll.plan.stacks if s.host]
  need = sum(s.host_bytes() for s in stacks)
  have = available_host_bytes()
  if have is not None and need > have:
    sizes = ", ".join(f"{s.tables[0]} {s.host_bytes() / 1e9:.2f} GB"
                      for s in stacks)
    raise InputError(
        f"pallas_emb {what}: the host-tier tables need {need / 1e9:.2f} GB "
        f"of host memory ({sizes}: rows and optimizer state) and this host "
        f"has {have / 1e9:.2f} GB available; give them fewer rows, keep "
        "some on the devices, or run on a host with more memory.")


def init_table(spec, key) -> np.ndarray:
  """A host-tier table from its initializer, chunk by chunk on the host's
  CPU device: rows `[i c, (i + 1) c)` from `initializer(fold_in(key, i),
  (c, width))` (chunk 0 from `key` itself, so a table of one chunk gets
  the device table's values)."""
  rows, width = spec.vocab_rows, spec.emb_width
  out = np.empty((rows, width), spec.dtype)
  step = chunk_rows(width, spec.dtype.itemsize)
  # Jitted, as the device table's init (eager ops round differently).
  init = jax.jit(lambda k, n: spec.initializer(k, (n, width), spec.dtype)
                 .astype(spec.dtype), static_argnums=1)
  with jax.default_device(cpu_device()):
    key = jax.device_put(key, cpu_device())
    for i, start in enumerate(range(0, rows, step)):
      n = min(step, rows - start)
      out[start:start + n] = np.asarray(
          init(key if i == 0 else jax.random.fold_in(key, i), n))
  return out


def init_slots(spec) -> dict[str, np.ndarray]:
  """A host-tier table's optimizer slots at their initial values."""
  opt = spec.optimizer
  if opt is None:
    return {}
  return {s.name: np.full((spec.vocab_rows,) + (
      (spec.emb_width,) if s.kind == "element" else ()), s.init, s.dtype)
          for s in opt.slots()}


def in_chunks(fn, n: int) -> None:
  """`fn(start, stop)` over `[0, n)`: in chunks on the host's cores when n
  is large (numpy's take and row assignment release the GIL; a random row
  read waits on memory, so threads overlap the waits), else at once."""
  chunks = min(_threads(), n // max(1, PARALLEL_ROWS // 2))
  if n < PARALLEL_ROWS or chunks < 2:
    fn(0, n)
    return
  bounds = np.linspace(0, n, chunks + 1).astype(int)
  futures = [_pool().submit(fn, a, b) for a, b in zip(bounds, bounds[1:])]
  for future in futures:
    future.result()


def _threads() -> int:
  return min(MAX_THREADS, os.cpu_count() or 1)


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(
      _threads(), thread_name_prefix="pallas_emb_host_rows")
