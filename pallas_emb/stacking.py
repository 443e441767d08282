"""Which table is stored where: stacking tables into physical arrays.

Tables with the same (placement, emb_width, dtype, optimizer) are
*stacked*: stored as one physical array, each table at a row offset, so all
features of a stack share one exchange per step. The plan is fixed when a
collection is built and printable (`coll.plan`, `coll.plan.describe()`).

The physical array of a stack, per placement (W ranks, R stacked rows):

  column      `[R, D]`, columns over the ranks (`[R, D / W]` per rank)
  replicated  `[R, D]` on every rank
  row         `[W * ceil(R / W), D]`, rows over the ranks: rank r's block
              holds the stacked rows g = r, r + W, r + 2W, ... (g // W is
              the local row), so Zipf-hot low ids spread over every rank
  table       `[W * block_rows, D]`, rows over the ranks: each table lies
              whole inside one rank's block, at its row offset

A host-tier table (`TableSpec(storage="host")`) is a stack of its own whose
physical array is its device cache of C rows, laid out as above as if the
stack had C rows (a row cache: `ceil(C / W)` slots on every rank); its
logical rows live in host memory (`host_tier.py`, docs/host_tier.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Sequence

import numpy as np

from pallas_emb.errors import InputError
from pallas_emb.specs import FeatureSpec
from pallas_emb.specs import MAX_INT32
from pallas_emb.specs import TableSpec


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """Tables stored together as one `[total_rows, emb_width]` array."""
  name: str
  tables: tuple[str, ...]
  row_offsets: tuple[int, ...]
  vocab_rows: tuple[int, ...]
  emb_width: int
  dtype: np.dtype
  optimizer: Any
  features: tuple[str, ...]
  placement: str = "column"
  ranks: int = 1              # W, the communicator the layout is for
  block_rows: int = 0         # "table": rows of each rank's block
  slot_map: bool = False      # dedups through an int32 [total_rows] map
  cache_rows: int = 0         # a host-tier table's device cache (0: none)
  cache_policy: str = "lru"

  @property
  def host(self) -> bool:
    """A host-tier stack: its rows in host memory, a row cache on device."""
    return self.cache_rows > 0

  @property
  def logical_rows(self) -> int:
    """Rows of the stack's tables (a host-tier stack's map has one each)."""
    return sum(self.vocab_rows)

  @property
  def total_rows(self) -> int:
    """Rows of the stack's global physical array `[total_rows, emb_width]`;
    row and table placements pad them to W equal blocks. A host-tier
    stack's physical array is its cache of `cache_rows` rows."""
    rows = self.cache_rows or sum(self.vocab_rows)
    if self.placement == "table":
      return self.ranks * self.block_rows
    if self.placement == "row":
      return self.ranks * -(-rows // self.ranks)
    return rows

  @property
  def local_rows(self) -> int:
    """Rows of the physical array each rank holds."""
    if self.placement in ("row", "table"):
      return self.total_rows // self.ranks
    return self.total_rows

  def rank_bytes(self) -> tuple[int, int]:
    """`(table, optimizer state)` bytes each rank stores: its shard of the
    physical array and of every optimizer state array (the step too); the
    state counts the slot map (`map_bytes`) too, which every rank holds,
    and a host-tier stack's cache map (`cache_map_bytes`). A host-tier
    stack's table and state are those of its cache (`host_bytes`: what
    host memory holds)."""
    width = self.emb_width // (self.ranks if self.placement == "column"
                               else 1)
    rows = self.local_rows
    table = rows * width * self.dtype.itemsize
    maps = self.map_bytes + self.cache_map_bytes
    if self.optimizer is None:
      return table, maps
    state = 4 + maps  # the step counter
    for slot in self.optimizer.slots():
      item = np.dtype(slot.dtype).itemsize
      if slot.kind == "row":
        state += (self.total_rows if self.placement == "column" else
                  rows) * item
      else:
        state += rows * width * item
    return table, state

  @property
  def map_bytes(self) -> int:
    """Bytes of the stack's slot map on each rank (0 without one)."""
    return 4 * self.total_rows if self.slot_map else 0

  @property
  def cache_map_bytes(self) -> int:
    """Bytes of a host-tier stack's cache map (int32 per logical row, on
    every rank; 0 for a device stack)."""
    return 4 * self.logical_rows if self.host else 0

  def row_bytes(self) -> int:
    """Bytes of one full-width logical row with its optimizer state."""
    total = self.emb_width * self.dtype.itemsize
    for slot in (self.optimizer.slots() if self.optimizer else ()):
      total += np.dtype(slot.dtype).itemsize * (
          self.emb_width if slot.kind == "element" else 1)
    return total

  def host_bytes(self) -> int:
    """Bytes of host memory a host-tier stack's store holds (rows and
    optimizer state; 0 for a device stack)."""
    return self.logical_rows * self.row_bytes() if self.host else 0


@dataclasses.dataclass(frozen=True)
class CollectionPlan:
  """Which table is stored in which stack, at which row offset."""
  stacks: tuple[StackPlan, ...]

  def stack_of(self, table: str) -> tuple[StackPlan, int]:
    """The stack holding `table` and the table's index in it."""
    for stack in self.stacks:
      if table in stack.tables:
        return stack, stack.tables.index(table)
    raise KeyError(table)

  @functools.cached_property
  def fingerprint(self) -> str:
    """A short name of everything a state's layout depends on: the stacks,
    their tables in order with their rows and offsets, widths, dtypes and
    optimizers. States and routings carry it (see `state.py`)."""
    text = repr([(s.name, s.tables, s.row_offsets, s.vocab_rows, s.emb_width,
                  s.dtype.name, repr(s.optimizer), s.features)
                 + ((s.placement, s.ranks, s.block_rows)
                    if s.placement != "column" else ())
                 + ((s.cache_rows, s.cache_policy) if s.host else ())
                 for s in self.stacks])
    return hashlib.sha256(text.encode()).hexdigest()[:16]

  def __str__(self) -> str:
    return self._text(detailed=False)

  def describe(self) -> str:
    """The plan with every table's placement and the bytes of tables and
    optimizer state each rank stores (its shards of the state's arrays)."""
    table = sum(s.rank_bytes()[0] for s in self.stacks)
    state = sum(s.rank_bytes()[1] for s in self.stacks)
    maps = [f"{n} {what} map bytes" for n, what in (
        (sum(s.map_bytes for s in self.stacks), "slot"),
        (sum(s.cache_map_bytes for s in self.stacks), "cache")) if n]
    host = sum(s.host_bytes() for s in self.stacks)
    return (f"{self._text(detailed=True)}\nper rank (each of "
            f"{self.stacks[0].ranks}): {table} table bytes + {state} "
            "optimizer state bytes"
            + (f" (of which {' and '.join(maps)})" if maps else "")
            + (f"; host memory: {host} bytes" if host else ""))

  def _text(self, detailed: bool) -> str:
    lines = []
    for s in self.stacks:
      # A column stack prints as it always has unless details are asked.
      where = f"{s.placement} " if detailed or s.placement != "column" else ""
      shape = (f"host [{s.logical_rows}, {s.emb_width}], a device cache of "
               f"{s.cache_rows} rows ({s.cache_policy})" if s.host else
               f"[{s.total_rows}, {s.emb_width}]")
      line = (f"{s.name}: {where}{shape} "
              f"{s.dtype.name}, {type(s.optimizer).__name__}, features "
              f"{list(s.features)}")
      if detailed:
        line += ("; per rank {} table bytes + {} optimizer state bytes"
                 .format(*s.rank_bytes()))
      lines.append(line)
      for table, offset, rows in zip(s.tables, s.row_offsets, s.vocab_rows):
        rank = (f" on rank {offset // s.block_rows}"
                if s.placement == "table" else "")
        lines.append(f"  {table}: {where}rows [{offset}, {offset + rows})"
                     f"{rank}")
    return "\n".join(lines)


def stack_tables(tables: Sequence[TableSpec],
                 features: Sequence[FeatureSpec], ranks: int = 1, *,
                 max_rows: int | None = MAX_INT32,
                 dedup: str = "sort") -> CollectionPlan:
  """Groups `tables` by (placement, emb_width, dtype, optimizer) into
  stacks, in the order the tables are given; each stack lists the features
  that read it. `ranks`: the communicator's size W (row and table
  placements lay their rows out over it). A stack of more than `max_rows`
  physical rows raises (None: no check, for the planner's costing).
  `dedup="slot_map"`: each trained column or replicated stack holds a slot
  map (`uses_slot_map`); row and table stacks keep the sort."""
  groups: dict[Any, list[TableSpec]] = {}
  for table in tables:
    if table.rank is not None and table.rank >= ranks:
      raise InputError(
          f"pallas_emb TableSpec {table.name!r} rank={table.rank} is outside "
          f"the {ranks}-rank communicator; give a rank in [0, {ranks}) or "
          "drop rank= to place it by bytes.")
    groups.setdefault(table.stack_key, []).append(table)
  stacks = []
  for i, members in enumerate(groups.values()):
    placement = members[0].placement
    block_rows = 0
    if placement == "table":
      members, offsets, block_rows = _pack_blocks(members, ranks)
    names = tuple(t.name for t in members)
    rows = tuple(t.vocab_rows for t in members)
    if placement != "table":
      offsets = tuple(int(o) for o in np.cumsum((0,) + rows[:-1]))
    stack = StackPlan(
        name=f"stack{i}", tables=names, row_offsets=offsets, vocab_rows=rows,
        emb_width=members[0].emb_width, dtype=members[0].dtype,
        optimizer=members[0].optimizer,
        features=tuple(f.name for f in features if f.table in names),
        placement=placement, ranks=ranks, block_rows=block_rows,
        slot_map=uses_slot_map(dedup, placement, members[0].optimizer),
        cache_rows=members[0].cache_rows or 0,
        cache_policy=members[0].cache_policy)
    if max_rows is not None and stack.total_rows > max_rows:
      raise InputError(
          f"pallas_emb tables {list(names)} stack into {stack.total_rows} "
          "rows, more than int32 row ids address; give one of them another "
          "width, dtype, optimizer or placement so it is stored apart.")
    stacks.append(stack)
  return CollectionPlan(tuple(stacks))


def uses_slot_map(dedup: str, placement: str, optimizer) -> bool:
  """Whether a stack dedups through a slot map: `dedup="slot_map"`, a
  column or replicated stack (row and table stacks dedup each rank's own
  entries by a sort) that trains (a looked-up-only stack never dedups)."""
  return (dedup == "slot_map" and placement in ("column", "replicated")
          and optimizer is not None)


def _pack_blocks(members: Sequence[TableSpec], ranks: int):
  """Table placement: each table whole on one rank (its `rank`, else the
  least loaded one, largest tables first), every rank's block as long as
  the longest. Returns the tables in row order, their offsets in the stack
  and the block's rows."""
  load = [0] * ranks
  home = {}
  for t in members:
    if t.rank is not None:
      home[t.name] = t.rank
      load[t.rank] += t.vocab_rows
  for t in sorted((t for t in members if t.rank is None),
                  key=lambda t: -t.vocab_rows):
    home[t.name] = int(np.argmin(load))
    load[home[t.name]] += t.vocab_rows
  block_rows = max(load)
  offsets, used = {}, [0] * ranks
  for t in members:  # within a block, in the order given
    r = home[t.name]
    offsets[t.name] = r * block_rows + used[r]
    used[r] += t.vocab_rows
  ordered = sorted(members, key=lambda t: offsets[t.name])
  return (tuple(ordered), tuple(offsets[t.name] for t in ordered),
          block_rows)


def check_specs(tables: Sequence[TableSpec],
                features: Sequence[FeatureSpec]) -> None:
  """Raises InputError unless the specs make a collection: at least one of
  each, unique names, every feature reads a known table, every table is
  read."""
  for kind, specs, cls in (("tables", tables, TableSpec),
                           ("features", features, FeatureSpec)):
    if not specs:
      raise InputError(f"pallas_emb EmbeddingCollection needs at least one "
                       f"of {kind}.")
    for spec in specs:
      if not isinstance(spec, cls):
        raise InputError(
            f"pallas_emb EmbeddingCollection {kind} holds a "
            f"{type(spec).__name__}; expected pallas_emb.{cls.__name__}.")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
      raise InputError(f"pallas_emb EmbeddingCollection {kind} names "
                       f"{dupes} more than once; names must be unique.")
  table_names = {t.name for t in tables}
  for f in features:
    if f.table not in table_names:
      raise InputError(
          f"pallas_emb FeatureSpec {f.name!r} reads table {f.table!r}, which "
          f"is not among the tables {sorted(table_names)}.")
  unread = sorted(table_names - {f.table for f in features})
  if unread:
    raise InputError(
        f"pallas_emb EmbeddingCollection tables {unread} are read by no "
        "feature; add a FeatureSpec for each, or drop them.")
