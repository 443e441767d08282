"""Host memory for host-tier tables: its size, the check that it fits,
and filling it.

A host-tier table (docs/host_tier.md) keeps its rows and optimizer slots
in numpy arrays of host memory, or, with `TableSpec.host_dir`, in files
there mapped into memory (`host_array`: the OS keeps the pages in use in
RAM and writes the others back, so a table may outgrow the host's
memory). `check_host_memory` compares what they take
(`StackPlan.host_bytes`) with what the host has available, in memory or
on the directory's disk, before anything is allocated; `init_table` and
`init_slots` fill them, a table chunk by chunk on the host's CPU device
(never a second copy of it); `in_chunks` runs the large row copies in and
out of them on threads.
"""

from __future__ import annotations

import concurrent.futures
import functools
import mmap
import os
import shutil

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
# How a `host_dir` table's files are mapped: "random" (madvise
# MADV_RANDOM) has a page fault bring its own page only. The OS's default
# reads ahead, as for a file read in order: it moved tens of pages from the
# disk for each row a step touched (on a 2-core CPU with 23 GB of memory,
# a 100M x 64 f32 table's steps of 16,384 sequence ids took 909 ms with
# it, 50 and 54 ms without), and it fills the page cache with large folios
# (up to 2 MB on Linux 6.x's ext4), each of which a changed 256-byte row
# sends back to the disk whole: 20,000 rows written back in a 4 GB file
# wrote 4.07 GB, against 81 MB with the file filled under MADV_RANDOM
# (`python -m bench.host_file_writes`). So the files are filled under it
# too, a page at a time (2.2-2.4x slower at 100M rows on one thread;
# `fill_rows` spreads the faults over the host's cores). None leaves the
# OS's default.
MAP_ADVICE = "random"


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


def host_path(spec, part: str) -> str:
  """The file of a `host_dir` table's `part` ("rows" or a slot's name)."""
  return os.path.join(os.fspath(spec.host_dir), f"{spec.name}.{part}")


def host_array(spec, part: str, shape, dtype) -> np.ndarray:
  """Host memory for one of a host-tier table's arrays (`part`: "rows" or
  an optimizer slot's name), for the caller to fill: a numpy array, or
  with `spec.host_dir` that directory's file of it, memory-mapped. A file
  of the right size is reused as it is (never truncated under a mapping
  of it an older state may hold: one live state per table and host_dir)."""
  if spec.host_dir is None:
    return np.empty(shape, dtype)
  path, shape = host_path(spec, part), tuple(shape)
  size = int(np.prod(shape)) * np.dtype(dtype).itemsize
  mode = "r+" if os.path.isfile(path) and os.path.getsize(path) == size else (
      "w+")
  mapped = np.memmap(path, dtype=dtype, mode=mode, shape=shape)
  advise_random(mapped)
  return mapped


def advise_random(mapped) -> None:
  """Tells the OS that `mapped` (a `host_array`) is read and written a row
  here and there (`MAP_ADVICE`), where it is a file's map and the
  platform can be told."""
  advice = getattr(mmap, "MADV_RANDOM", None)
  handle = getattr(mapped, "_mmap", None)
  if MAP_ADVICE == "random" and advice is not None and handle is not None:
    handle.madvise(advice)



def _maps_whole_file(x, path: str, dtype) -> bool:
  """Whether `x` is a memory map of all of the file at `path` (e.g. the
  read-only `table_arrays` of a state of the same table)."""
  filename = getattr(x, "filename", None)
  return (isinstance(x, np.memmap) and filename is not None
          and os.path.isfile(path) and os.path.samefile(filename, path)
          and x.dtype == dtype and x.offset == 0 and x.flags.c_contiguous
          and x.nbytes == os.path.getsize(path))


def _check_host_dirs(coll, stacks, what: str) -> None:
  """Each `host_dir` exists and its disk holds its tables' files."""
  need = {}
  for s in stacks:
    spec = coll.tables[s.tables[0]]
    directory = os.fspath(spec.host_dir)
    if not os.path.isdir(directory):
      raise InputError(
          f"pallas_emb {what}: host-tier table {spec.name!r} has "
          f"host_dir={directory!r}, which is not a directory; create it, "
          "or give host_dir=None to keep the table in host memory.")
    # The files this replaces free their bytes.
    parts = ["rows"] + ([sl.name for sl in spec.optimizer.slots()]
                        if spec.optimizer else [])
    old = sum(os.path.getsize(p) for p in (host_path(spec, x) for x in parts)
              if os.path.isfile(p))
    device = os.stat(directory).st_dev
    free, bytes_, names = need.get(device, (shutil.disk_usage(directory).free,
                                            0, []))
    need[device] = (free + old, bytes_ + s.host_bytes(), names + [spec.name])
  for free, bytes_, names in need.values():
    if bytes_ > free:
      raise InputError(
          f"pallas_emb {what}: the host-tier tables {names} need "
          f"{bytes_ / 1e9:.2f} GB of files in their host_dir and its disk "
          f"has {free / 1e9:.2f} GB free; free some, or give a host_dir on "
          "a larger disk.")


def check_host_memory(coll, what: str, memory: bool = True) -> None:
  """Raises InputError, before any of it is allocated, when the host-tier
  tables' rows and optimizer state (`StackPlan.host_bytes`) exceed the
  host's available memory (`memory=False`: none is allocated there) or,
  for tables with a `host_dir`, the free space of its disk: a clear error
  instead of the kernel's out-of-memory kill part way through filling
  them."""
  stacks = [s for s in coll.plan.stacks if s.host]
  in_files = [s for s in stacks if coll.tables[s.tables[0]].host_dir
              is not None]
  _check_host_dirs(coll, in_files, what)
  stacks = [s for s in stacks if s not in in_files and memory]
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
  out = host_array(spec, "rows", (rows, width), spec.dtype)
  step = chunk_rows(width, spec.dtype.itemsize)
  # Jitted, as the device table's init (eager ops round differently).
  init = jax.jit(lambda k, n: spec.initializer(k, (n, width), spec.dtype)
                 .astype(spec.dtype), static_argnums=1)
  with jax.default_device(cpu_device()):
    key = jax.device_put(key, cpu_device())
    for i, start in enumerate(range(0, rows, step)):
      n = min(step, rows - start)
      fill_rows(out, start, np.asarray(
          init(key if i == 0 else jax.random.fold_in(key, i), n)))
  return out


def fill_rows(out: np.ndarray, start: int, values) -> None:
  """`out[start:start + len(values)] = values`, or with a scalar `values`
  every row from `start` on, on the host's cores: a file's map is filled a
  page fault at a time, and faults of separate pages run in parallel."""
  scalar = np.ndim(values) == 0
  n = out.shape[0] - start if scalar else len(values)

  def fill(a, b):
    out[start + a:start + b] = values if scalar else values[a:b]

  in_chunks(fill, n)


def init_slots(spec) -> dict[str, np.ndarray]:
  """A host-tier table's optimizer slots at their initial values."""
  opt = spec.optimizer
  if opt is None:
    return {}
  slots = {}
  for s in opt.slots():
    slots[s.name] = host_array(spec, s.name, (spec.vocab_rows,) + (
        (spec.emb_width,) if s.kind == "element" else ()), s.dtype)
    fill_rows(slots[s.name], 0, s.init)
  return slots


def as_host_array(spec, part: str, x, dtype, copy: bool = True
                  ) -> np.ndarray:
  """`x` (numpy or jax) as host memory of `spec`'s `part`: with
  `copy=False` a writable numpy array of `dtype` is taken as it is (no
  second copy of a huge table), unless the table has a `host_dir`, whose
  file must hold it (then copied there a chunk at a time); else a copy."""
  if spec.host_dir is not None and _maps_whole_file(x, host_path(spec, part),
                                                   dtype):
    return host_array(spec, part, x.shape, dtype)  # writable, no copy
  if (not copy and spec.host_dir is None and isinstance(x, np.ndarray)
      and x.dtype == dtype and x.flags.writeable):
    return x
  if spec.host_dir is None:
    return np.array(jax.device_get(x), dtype)
  out = host_array(spec, part, x.shape, dtype)
  step = chunk_rows(int(np.prod(x.shape[1:])), np.dtype(dtype).itemsize)
  for start in range(0, x.shape[0], step):
    fill_rows(out, start, np.asarray(jax.device_get(x[start:start + step]),
                                     dtype))
  return out


def in_chunks(fn, n: int, pool: str = "rows") -> None:
  """`fn(start, stop)` over `[0, n)`: in chunks on the host's cores when n
  is large (numpy's take and row assignment release the GIL; a random row
  read waits on memory, so threads overlap the waits), else at once.

  `pool` names the threads: callers that run at once use pools of their
  own, so that one's chunks never queue behind the other's (the
  write-backs' landing, on a thread of its own, beside the prefetch)."""
  chunks = min(_threads(), n // max(1, PARALLEL_ROWS // 2))
  if n < PARALLEL_ROWS or chunks < 2:
    fn(0, n)
    return
  bounds = np.linspace(0, n, chunks + 1).astype(int)
  futures = [_pool(pool).submit(fn, a, b)
             for a, b in zip(bounds, bounds[1:])]
  for future in futures:
    future.result()


def _threads() -> int:
  return min(MAX_THREADS, os.cpu_count() or 1)


@functools.cache
def _pool(name: str) -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(
      _threads(), thread_name_prefix=f"pallas_emb_host_{name}")
