"""Host-tier tables: rows in host memory, a row cache on the devices.

A table with `TableSpec(storage="host", cache_rows=C)` is a stack of its
own (`stacking.py`). Its rows and every optimizer slot's rows live in host
memory as numpy arrays of the logical shape (`HostStack.table`,
`HostStack.slots`); the devices hold a cache of C rows of each, laid out
like a stack of C rows of the table's placement (a row-placed cache gives
every rank `ceil(C / W)` slots for rows `g % W == rank`), and a cache map:
int32 `[vocab_rows]`, each row's cache row or -1, on every rank. The step
counter is the device state's, as for any stack.

Between steps, `HostTier.prefetch` makes a batch's rows resident
(docs/host_tier.md):

  rows      the batch's distinct rows, by the step's own key rule
            (`stack.entry_keys`; its numpy twin `host_batches.host_keys`), split per
            rank for a row-placed table
  directory `row_cache.RowCache` per rank part: hits, misses, evictions by
            the table's policy; rows of the batches still in flight are
            pinned (never evicted)
  the swap two jitted programs per table and prefetch: one reads the
            evicted rows that changed (for host memory; only when there
            are such rows), the other writes the misses (from host memory)
            into their slots and updates the cache map, in place. Apart,
            because in one program XLA copies each donated cache array to
            keep the reads' operand: a whole cache twice a swap. The
            inputs are put on the devices asynchronously and the
            write-backs copied to the host asynchronously, so the host's
            work and the transfers overlap the step in flight

An evicted row that changed is copied into host memory on a thread of its
own (`write_back.WriteBacks`), beside the steps that follow; a prefetch
that fetches a row still on its way there waits for it first, so a row
that comes back reads its latest values, and `flush` (checkpoints,
serving, `table_arrays`) waits for every one.

The step itself translates each entry's logical row to its cache row
through the map (`per_rank.cache_keys`), after the id rules, so the dedup,
the gather and the update run on cache rows as on any stack. A batch of
at least `HOST_ENTRIES_MIN` entries is translated here too
(`HostStack.entries`, into `StackState.cache_entries`): the step checks
each entry against it and gathers from the map only if one differs.

Every read and write of a cache row goes through `read_rows` and
`write_rows` (per rank, on the rank's shard), the one place that knows how
a cache array stores its rows.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_emb import host_batches
from pallas_emb import host_memory
from pallas_emb import placement as placement_lib
from pallas_emb import write_back
from pallas_emb.errors import InputError
from pallas_emb.kernels.mosaic_tpu import row_write
from pallas_emb.kernels.mosaic_tpu import stored as stored_lib
from pallas_emb.row_cache import RowCache
from pallas_emb.state import CollectionState
from pallas_emb.state import StackState

# Transfers are padded to a size class of rows (at least this many), so a
# table's swap programs compile once per class, not per batch. The classes
# are quarter octaves (2^k x 4/4, 5/4, 6/4, 7/4): a whole power of two
# padded a v5e bags step's 38,078 fetched rows to 65,536, 72% more bytes
# over a 1.5 GB/s link; a quarter octave pads at most 25%, for at most
# four programs per octave.
MIN_TRANSFER_ROWS = 8
STEPS_PER_OCTAVE = 4
# A batch of at least this many entries of a table is translated to cache
# rows on the host, in its prefetch: the device map's gather of every
# entry took a TPU v5e 4.45 ms for 327,680 entries (13.6 ns each), the
# host's (a take from the directory, on its cores) about 9 ns an entry on
# two CPU cores. Below it, the map's gather is short (about 0.2 ms for
# 16,384 entries at that rate) beside a step that the host bounds (16,384
# sequence ids: 4.3 ms of prefetch on the host, 1.0 ms of device step), so
# it stays on the device.
HOST_ENTRIES_MIN = 65536
class CacheStats(NamedTuple):
  """One host-tier table's cache in one prefetch (host ints).

  rows: distinct rows the batch reads; hits: of them, those the cache held;
  ids, id_hits: the same counted per id (a hot row once per id reading
  it); fetched: rows brought from host memory (`rows - hits`); evicted:
  rows that left the cache; written_back: evicted rows that had changed,
  copied back to host memory; bytes_to_device / bytes_to_host: what
  crossed the host link (every device's share, padding included);
  seconds: host time of the prefetch, of which read_seconds went to
  gathering the fetched rows from host memory and wait_seconds to waiting
  for evicted rows still on their way there (`write_back`).
  """
  rows: int
  hits: int
  ids: int
  id_hits: int
  fetched: int
  evicted: int
  written_back: int
  bytes_to_device: int
  bytes_to_host: int
  seconds: float
  read_seconds: float = 0.0
  wait_seconds: float = 0.0

  @property
  def hit_rate(self) -> float:
    """Of the batch's distinct rows, the fraction already cached."""
    return self.hits / self.rows if self.rows else 1.0

  @property
  def id_hit_rate(self) -> float:
    """Of the batch's ids, the fraction whose row was already cached."""
    return self.id_hits / self.ids if self.ids else 1.0


# --- the cache's rows on a rank ----------------------------------------------


def read_rows(array: jax.Array, slots: jax.Array) -> jax.Array:
  """Rows `slots` of a rank's shard of a cache array (table or state)."""
  return jnp.take(array, slots, axis=0)


def write_rows(array: jax.Array, slots: jax.Array, values: jax.Array, *,
               by_dma: bool = False, interpret: bool = False) -> jax.Array:
  """`array` with rows `slots` (unique) set to `values` (a slot past the
  shard's rows is dropped: padding). `by_dma`: a stored array of the
  Mosaic backend, written by its row-DMA kernel (`row_write.py`; XLA's
  scatter took a v5e 63 ns a row of 512 B)."""
  if by_dma and row_write.supported(array):
    return row_write.write_rows(array, slots, values, interpret=interpret)
  return array.at[slots].set(values.astype(array.dtype), mode="drop")


def _write(arrays, cache_map, write_slots, values, map_rows, map_values, *,
           layouts):
  """One rank's part of a prefetch's writes: the fetched rows into their
  slots and the map updated (`layouts`: per array, its `RowLayout`, host
  rows <-> device rows)."""
  arrays = tuple(write_rows(a, write_slots, lay.to_device(v),
                            by_dma=lay.stored, interpret=lay.interpret)
                 for a, v, lay in zip(arrays, values, layouts))
  return arrays, cache_map.at[map_rows].set(map_values, mode="drop")


def _write_taking_back(arrays, cache_map, write_slots, values, map_rows,
                       map_values, leaving, positions, *, layouts):
  """`_write`, where the fetched rows at `positions` >= 0 are taken from
  `leaving` (the newest write-back group's rows, still on the devices)
  instead of `values` (read from host memory before they landed)."""
  take = positions >= 0
  at = jnp.maximum(positions, 0)
  values = tuple(
      jnp.where(take.reshape((-1,) + (1,) * (v.ndim - 1)),
                jnp.take(g, at, axis=0), v) for v, g in zip(values, leaving))
  return _write(arrays, cache_map, write_slots, values, map_rows,
                map_values, layouts=layouts)


def _read(arrays, slots, *, layouts):
  """One rank's cache rows `slots` of every array, as host memory holds
  them."""
  return tuple(lay.to_host(read_rows(a, slots))
               for a, lay in zip(arrays, layouts))


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """How a rank's rows of one array are held on the device and in host
  memory: the same, except on the Mosaic backend, whose tables (and
  element-wise state) are stored as whole 128-lane rows of words
  (`kernels/mosaic_tpu/stored.py`), converted here, a batch's rows at a
  time. `kind`: "table", "element" or "row"; `width`, `dtype`: the
  rank's logical columns and the table's dtype; `interpret`: the Mosaic
  kernels through Pallas' interpreter."""
  stored: bool = False
  kind: str = "row"
  width: int = 0
  dtype: Any = None
  interpret: bool = False

  def to_device(self, rows):
    if not self.stored or self.kind == "row":
      return rows
    if self.kind == "table":
      return stored_lib.to_stored(rows)
    return stored_lib.to_grads(rows, self.dtype)

  def to_host(self, rows):
    if not self.stored or self.kind == "row":
      return rows
    if self.kind == "table":
      return stored_lib.from_stored(rows, self.width, self.dtype)
    return stored_lib.from_grads(rows, self.width, self.dtype)


def _bucket(n: int) -> int:
  """The size class of `n` rows: the least multiple of an octave's step
  (its power of two / STEPS_PER_OCTAVE) that holds them."""
  n = max(int(n), MIN_TRANSFER_ROWS)
  step = max(1, (1 << (n - 1).bit_length() - 1) // STEPS_PER_OCTAVE)
  return -(-n // step) * step


def _padded(parts, size, fill, dtype=None):
  """Per part arrays `[k_r, ...]` padded with `fill` to `size` rows each,
  concatenated."""
  parts = [np.asarray(x, dtype) for x in parts]
  out = np.full((len(parts) * size,) + parts[0].shape[1:], fill,
                parts[0].dtype)
  for r, x in enumerate(parts):
    out[r * size:r * size + x.shape[0]] = x
  return out


def _gathered(parts, rows, size) -> np.ndarray:
  """`parts[r][rows[r]]` for every part r, each padded with zeros to `size`
  rows, concatenated: gathered straight into the transfer buffer."""
  out = np.zeros((len(parts) * size,) + parts[0].shape[1:], parts[0].dtype)
  for r, (part, local) in enumerate(zip(parts, rows)):
    at = r * size
    host_memory.in_chunks(lambda a, b, part=part, local=local, at=at: np.take(
        part, local[a:b], axis=0, out=out[at + a:at + b]), local.size)
  return out


# --- one host-tier table -----------------------------------------------------


class HostStack:
  """A host-tier stack's host memory, cache directories and programs.

  `table` `[vocab_rows, emb_width]` (the table's dtype) and `slots`
  (`{slot: [vocab_rows] or [vocab_rows, emb_width]}`) are the logical
  arrays; a row-placed table's rank r owns rows `r, r + W, ...` (local row
  `g // W`), its part the strided view `array[r::W]`.
  """

  def __init__(self, coll, stack, table: np.ndarray,
               slots: dict[str, np.ndarray]):
    self.stack = stack
    self.name = stack.tables[0]
    self.mesh = coll.mesh
    self.table, self.slots = table, slots
    self.parts = stack.ranks if stack.placement == "row" else 1
    self.slot_names = tuple(slots)
    self.caches = [RowCache(stack.local_rows, len(range(r, table.shape[0],
                                                        self.parts)),
                            stack.cache_policy) for r in range(self.parts)]
    # Per prefetched batch (newest last), each part's slots of its rows.
    self.recent = collections.deque(maxlen=3)
    self.write_backs = write_back.WriteBacks(
        self._to_host_memory,
        [self._part(table, r).shape[0] for r in range(self.parts)])
    axis = coll.table_axis
    self._token_sharding = coll.token_sharding()
    self._part_spec = P(axis) if self.parts > 1 else P()
    specs = placement_lib.state_specs(stack, axis)
    self._specs = (placement_lib.table_spec(stack, axis),) + tuple(
        getattr(specs, n) for n in self.slot_names)
    stored = placement_lib.stored_layout(coll.backend)
    self._storage = (stack.dtype if stored else
                     placement_lib.storage_dtype(stack, coll.backend))
    kinds = {s.name: s.kind for s in (stack.optimizer.slots()
                                      if stack.optimizer else ())}
    self._layouts = tuple(
        RowLayout(stored, kind, placement_lib.shard_width(stack),
                  stack.dtype, coll.backend == "mosaic_tpu_interpret")
        for kind in ("table",) + tuple(kinds[n] for n in self.slot_names))
    shard = functools.partial(jax.shard_map, mesh=self.mesh, check_vma=False)
    self._write = jax.jit(shard(
        functools.partial(_write, layouts=self._layouts),
        in_specs=(self._specs, P(), self._part_spec, self._specs, P(), P()),
        out_specs=(self._specs, P())), donate_argnums=(0, 1))
    self._write_taking_back = jax.jit(shard(
        functools.partial(_write_taking_back, layouts=self._layouts),
        in_specs=(self._specs, P(), self._part_spec, self._specs, P(), P(),
                  self._specs, self._part_spec),
        out_specs=(self._specs, P())), donate_argnums=(0, 1))
    self._read = jax.jit(shard(
        functools.partial(_read, layouts=self._layouts),
        in_specs=(self._specs, self._part_spec), out_specs=self._specs))

  # --- views ---------------------------------------------------------------

  def _host_arrays(self):
    return (self.table,) + tuple(self.slots[n] for n in self.slot_names)

  def _part(self, array: np.ndarray, r: int) -> np.ndarray:
    return array[r::self.parts] if self.parts > 1 else array

  def _global_rows(self, local: np.ndarray, r: int) -> np.ndarray:
    return local.astype(np.int64) * self.parts + r

  def _cache_rows(self, slots: np.ndarray, r: int) -> np.ndarray:
    """The cache map's value of a slot of part r: its stacked cache row."""
    return (slots.astype(np.int64) * self.parts + r).astype(np.int32)

  def _device_arrays(self, state: StackState):
    return (state.table,) + tuple(getattr(state.opt_state, n)
                                  for n in self.slot_names)

  def _with_arrays(self, state: StackState, arrays, cache_map) -> StackState:
    opt_state = state.opt_state
    if self.slot_names:
      opt_state = opt_state._replace(**dict(zip(self.slot_names,
                                                arrays[1:])))
    return StackState(arrays[0], opt_state, state.slot_map, cache_map,
                      state.cache_entries)

  def split(self, rows: np.ndarray):
    """Logical rows -> per part `(index into rows, local rows)`."""
    if self.parts == 1:
      return [(np.arange(rows.size), rows)]
    owner = rows % self.parts
    return [(np.flatnonzero(owner == r), rows[owner == r] // self.parts)
            for r in range(self.parts)]

  # --- prefetch ------------------------------------------------------------

  def prefetch(self, state: StackState, rows, counts, trains, entry_rows,
               in_flight: int, train: bool = True):
    """`(state, CacheStats)`: the distinct logical `rows` of a batch
    resident, the rows of the `in_flight` training batches prefetched
    before it kept (their slots are still to be read or updated), and the
    batch's entries (`entry_rows`: per feature, each id's row) translated
    to cache rows (`entries`). A batch that is not trained
    (`train=False`) marks no row changed and does not count as in
    flight."""
    start, waited = time.perf_counter(), self.write_backs.waited
    self.write_backs.reap()
    parts = self.split(rows)
    recent = list(self.recent)[len(self.recent) - in_flight:] if (
        in_flight) else []
    pinned = [np.concatenate([b[r] for b in recent] + [
        np.zeros(0, np.int32)]) for r in range(self.parts)]
    for r, (_, local) in enumerate(parts):
      if local.size + pinned[r].size <= self.stack.local_rows:
        continue  # fits whatever is cached (counting needs O(cache) work)
      needed = self.caches[r].needed(local, pinned[r])
      if needed > self.stack.local_rows:
        where = (f" on rank {r}, whose part of the row-placed cache holds "
                 f"ceil(cache_rows / {self.parts}) = {self.stack.local_rows}"
                 if self.parts > 1 else
                 f", which holds cache_rows={self.stack.cache_rows}")
        raise InputError(
            f"pallas_emb host-tier table {self.name!r} needs {needed} rows "
            f"in its device cache at once (this batch's distinct rows and "
            f"those of the {len(recent)} batches still in flight){where}. "
            f"Raise cache_rows to at least {needed * self.parts}, or use "
            "smaller batches.")
    admitted = [self.caches[r].admit(local, counts[idx],
                                     trains[idx] & train, pinned[r])
                for r, (idx, local) in enumerate(parts)]
    hit = np.zeros(rows.size, bool)
    for (idx, _), a in zip(parts, admitted):
      hit[idx] = a.hit
    if train:
      self.recent.append([a.slots for a in admitted])
    stats = dict(rows=int(rows.size), hits=int(hit.sum()),
                 ids=int(counts.sum()), id_hits=int(counts[hit].sum()),
                 fetched=sum(a.fetch_rows.size for a in admitted),
                 evicted=sum(a.evict_rows.size for a in admitted),
                 written_back=sum(int(a.dirty.sum()) for a in admitted))
    moved = stats["fetched"] or stats["evicted"]
    to_device = to_host = read_s = 0
    entries = self.entries(entry_rows)
    if moved:
      state, entries, to_device, to_host, read_s = self._dispatch_swap(
          state, admitted, entries)
    elif entries is not None:
      entries = jax.device_put(entries, self._token_sharding)
    to_device += sum(_transferred(x) for x in jax.tree.leaves(entries))
    state = state._replace(cache_entries=entries)
    return state, CacheStats(**stats, bytes_to_device=to_device,
                             bytes_to_host=to_host,
                             seconds=time.perf_counter() - start,
                             read_seconds=read_s,
                             wait_seconds=self.write_backs.waited - waited)

  def entries(self, entry_rows) -> dict | None:
    """`{feature: (cache row, logical row)}` of each entry (int32, flat;
    `entry_rows`: `{feature: logical rows}`), from the directories, after
    the batch's rows were admitted, so that the step needs no gather of
    every entry from the device's cache map; None for a batch of fewer
    than `HOST_ENTRIES_MIN` entries (the map's gather is short there)."""
    if sum(x.size for x in entry_rows.values()) < HOST_ENTRIES_MIN:
      return None
    out = {}
    for name, rows in entry_rows.items():
      cache = np.empty(rows.size, np.int32)
      for r in range(self.parts):
        if self.parts == 1:
          mine, local, slots = slice(None), rows, cache
        else:
          mine = np.flatnonzero(rows % self.parts == r)
          local = rows[mine] // self.parts
          slots = np.empty(local.size, np.int32)
        host_memory.in_chunks(
            lambda a, b, local=local, slots=slots, r=r: np.take(
                self.caches[r].row_slot, local[a:b], out=slots[a:b]),
            local.size)
        if self.parts > 1:
          cache[mine] = np.where(slots < 0, -1, self._cache_rows(slots, r))
      out[name] = (cache, rows)
    return out

  def _dispatch_swap(self, state: StackState, admitted, entries):
    """`(state, entries, bytes to the devices, to the host, read
    seconds)`: the swap's programs dispatched, `entries` (or None) put on
    the devices in the same call as the swap's inputs."""
    slots_per_part = self.stack.local_rows
    dirty = [(a.evict_slots[a.dirty], a.evict_rows[a.dirty])
             for a in admitted]
    # The reads and the writes have sizes of their own: a group of
    # evictions does not pad the fetched rows sent to the devices.
    n = _bucket(max(a.fetch_slots.size for a in admitted))
    fetch_rows = [a.fetch_rows for a in admitted]
    # A fetched row still on its way back comes from the newest group's
    # rows on the devices (its latest values), else after its group lands.
    taking_back = self.write_backs.from_newest(fetch_rows, n)
    if taking_back is None:
      self.write_backs.wait_for(fetch_rows)
    write_slots = _padded([a.fetch_slots for a in admitted], n,
                          slots_per_part, np.int32)
    values, reading = [], time.perf_counter()
    for i, array in enumerate(self._host_arrays()):
      host = _gathered([self._part(array, r) for r in range(self.parts)],
                       [a.fetch_rows for a in admitted], n)
      values.append(host.view(self._storage) if i == 0 else host)
    read_s = time.perf_counter() - reading
    map_rows = np.concatenate(
        [self._global_rows(a.evict_rows, r) for r, a in enumerate(admitted)]
        + [self._global_rows(a.fetch_rows, r) for r, a in enumerate(admitted)])
    map_values = np.concatenate(
        [np.full(a.evict_rows.size, -1, np.int32) for a in admitted]
        + [self._cache_rows(a.fetch_slots, r)
           for r, a in enumerate(admitted)])
    m = _bucket(map_rows.size)
    map_rows = _padded([map_rows], m, self.table.shape[0], np.int32)
    map_values = _padded([map_values], m, -1, np.int32)
    index = [write_slots, map_rows, map_values]
    specs = [self._part_spec, P(), P()]
    if taking_back is not None:
      index.append(taking_back[0])
      specs.append(self._part_spec)
    reading = any(s.size for s, _ in dirty)
    if reading:
      n_read = _bucket(max(s.size for s, _ in dirty))
      index.append(_padded([s for s, _ in dirty], n_read, 0, np.int32))
      specs.append(self._part_spec)
    # One call for every transfer of the swap: a call costs more than most
    # of these arrays' bytes.
    sharding = lambda specs: tuple(NamedSharding(self.mesh, s) for s in specs)
    values, index, entries = jax.device_put(
        (tuple(values), tuple(index), entries),
        (sharding(self._specs), sharding(specs), self._token_sharding))
    arrays = self._device_arrays(state)
    to_host = 0
    if reading:
      # Dispatched first: the device reads the rows before the writes.
      read = self._read(arrays, index[-1])
      for x in read:
        x.copy_to_host_async()
      self.write_backs.start([rows for _, rows in dirty], n_read, read)
      to_host = sum(x.nbytes for x in read)
    if taking_back is None:
      arrays, cache_map = self._write(arrays, state.cache_map, index[0],
                                      values, index[1], index[2])
    else:
      arrays, cache_map = self._write_taking_back(
          arrays, state.cache_map, index[0], values, index[1], index[2],
          taking_back[1], index[3])
    to_device = sum(_transferred(x) for x in values + index)
    return (self._with_arrays(state, arrays, cache_map), entries, to_device,
            to_host, read_s)

  def _to_host_memory(self, rows, n: int, read) -> None:
    """Rows read from the cache (`read`: per array, `n` rows per part)
    into host memory at each part's local `rows`."""
    for i, (array, values) in enumerate(zip(self._host_arrays(), read)):
      values = np.asarray(values)
      if i == 0:
        values = values.view(self.table.dtype)
      for r, local in enumerate(rows):
        part, at = self._part(array, r), r * n

        def put(a, b, part=part, local=local, values=values, at=at):
          part[local[a:b]] = values[at + a:at + b]
        host_memory.in_chunks(put, local.size, pool="write_back")

  # --- host memory up to date ----------------------------------------------

  def flush(self, state: StackState, in_flight: int) -> None:
    """Copies every cached row that changed into host memory; the rows of
    the last `in_flight + 1` prefetched batches stay marked changed (an
    update of theirs may still come)."""
    self.write_backs.finish()
    dirty = [c.dirty_slots() for c in self.caches]
    if not any(d.size for d in dirty):
      return
    n = _bucket(max(d.size for d in dirty))
    read = self._read(self._device_arrays(state), jax.device_put(
        _padded(dirty, n, 0, np.int32),
        NamedSharding(self.mesh, self._part_spec)))
    self._to_host_memory([c.slot_row[d] for c, d in zip(self.caches, dirty)],
                         n, read)
    keep = list(self.recent)[len(self.recent) - (in_flight + 1):]
    for r, (cache, slots) in enumerate(zip(self.caches, dirty)):
      cache.clean(np.setdiff1d(slots, np.concatenate(
          [b[r] for b in keep] + [np.zeros(0, np.int32)])))

  def check_cached(self, rows: np.ndarray, what: str) -> None:
    for r, (_, local) in enumerate(self.split(rows)):
      missing = np.count_nonzero(self.caches[r].slots_of(local) < 0)
      if missing:
        raise InputError(
            f"pallas_emb {what}: {missing} rows of host-tier table "
            f"{self.name!r} that the batch reads are not in its device "
            "cache; call `state, _ = coll.prefetch(state, batch)` first "
            "(the Trainer does).")


def _transferred(x: jax.Array) -> int:
  """Bytes putting `x` on its devices moved (every copy counted)."""
  sharding = x.sharding
  shard = int(np.prod(sharding.shard_shape(x.shape), dtype=np.int64))
  return shard * len(sharding.device_set) * x.dtype.itemsize


# --- every host-tier table of a collection ------------------------------------


class HostTier:
  """The host-tier stacks of one collection state (`CollectionState.host`).

  `in_flight`: how many batches prefetched before a new one keep their rows
  in the cache by default (their update is still to come): 0 for a
  synchronous loop; the pipelined Trainer sets 2.
  """

  def __init__(self, stacks: dict[str, HostStack]):
    self.stacks = stacks
    self.in_flight = 0

  def prefetch(self, state, rows, in_flight: int | None = None,
               train: bool = True):
    """`(state, {table: CacheStats})` with each host-tier table's batch
    rows (`host_batches.batch_rows`) resident."""
    in_flight = self.in_flight if in_flight is None else in_flight
    if not isinstance(in_flight, int) or not 0 <= in_flight <= 2:
      raise InputError(f"pallas_emb prefetch in_flight={in_flight!r}; "
                       "expected 0, 1 or 2 batches still in flight.")
    stacks, stats = dict(state.stacks), {}
    for name, host in self.stacks.items():
      stacks[name], stats[host.name] = host.prefetch(
          state.stacks[name], *rows[name], in_flight, train)
    return _replace_stacks(state, stacks), stats

  def flush(self, state) -> None:
    for name, host in self.stacks.items():
      host.flush(state.stacks[name], self.in_flight)


def _replace_stacks(state, stacks):
  return CollectionState(stacks, state.fingerprint, state.host)


def check_cached(coll, state, batch, what: str) -> None:
  """An eager call's batch reads only cached rows (else InputError)."""
  for name, (rows, *_) in host_batches.batch_rows(coll, batch).items():
    state.host.stacks[name].check_cached(rows, what)
