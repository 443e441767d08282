"""Which table is stored where: stacking tables into physical arrays.

Tables with the same (emb_width, dtype, optimizer) are *stacked*: stored as
one `[total_rows, emb_width]` column-sharded array, each table at a row
offset, so all features of a stack share one exchange per step. The plan is
fixed when a collection is built and printable (`coll.plan`).
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

  @property
  def total_rows(self) -> int:
    return sum(self.vocab_rows)


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
                 for s in self.stacks])
    return hashlib.sha256(text.encode()).hexdigest()[:16]

  def __str__(self) -> str:
    lines = []
    for s in self.stacks:
      lines.append(
          f"{s.name}: [{s.total_rows}, {s.emb_width}] {s.dtype.name}, "
          f"{type(s.optimizer).__name__}, features {list(s.features)}")
      for table, offset, rows in zip(s.tables, s.row_offsets, s.vocab_rows):
        lines.append(f"  {table}: rows [{offset}, {offset + rows})")
    return "\n".join(lines)


def stack_tables(tables: Sequence[TableSpec],
                 features: Sequence[FeatureSpec]) -> CollectionPlan:
  """Groups `tables` by (emb_width, dtype, optimizer) into stacks, in the
  order the tables are given; each stack lists the features that read it."""
  groups: dict[Any, list[TableSpec]] = {}
  for table in tables:
    groups.setdefault(table.stack_key, []).append(table)
  stacks = []
  for i, members in enumerate(groups.values()):
    names = tuple(t.name for t in members)
    rows = tuple(t.vocab_rows for t in members)
    if sum(rows) > MAX_INT32:
      raise InputError(
          f"pallas_emb tables {list(names)} stack into {sum(rows)} rows, "
          "more than int32 row ids address; give one of them another "
          "width, dtype or optimizer so it is stored apart.")
    offsets = tuple(int(o) for o in np.cumsum((0,) + rows[:-1]))
    stacks.append(StackPlan(
        name=f"stack{i}", tables=names, row_offsets=offsets, vocab_rows=rows,
        emb_width=members[0].emb_width, dtype=members[0].dtype,
        optimizer=members[0].optimizer,
        features=tuple(f.name for f in features if f.table in names)))
  return CollectionPlan(tuple(stacks))


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
