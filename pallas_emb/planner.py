"""The planner: every table's placement under a memory budget per device.

    stats = pe.batch_stats(sample_batches, features)
    tables, report = pe.plan(tables, features, mesh, table_axis="x",
                             batch_size=1024, stats=stats)
    print(report)
    coll = pe.EmbeddingCollection(tables, features, mesh, "x")

The cost model is in docs/planner.md: the memory per rank is exact (the
stacks the collection builds, `StackPlan.rank_bytes`); the bytes a rank
sends per step follow docs/placements.md. The plan is the smallest bytes
sent per rank and step with every rank under `device_memory - reserve`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np

from pallas_emb import validation
from pallas_emb.errors import Error
from pallas_emb.errors import InputError
from pallas_emb.stacking import check_specs
from pallas_emb.stacking import stack_tables
from pallas_emb.specs import Bag
from pallas_emb.specs import FeatureSpec
from pallas_emb.specs import MAX_INT32
from pallas_emb.specs import TableSpec

# Tie-break order among plans of equal bytes sent and memory: the default
# first, then sharded state before whole tables on one rank or every rank.
ORDER = ("column", "row", "table", "replicated")
DEFAULT_RESERVE_FRACTION = 0.2
DEFAULT_IDS_PER_EXAMPLE = 1.0
ID_BYTES = 4
# The report says what replication would cost for tables of at most this
# many bytes per rank (table and optimizer state) that are not replicated.
SMALL_TABLE_BYTES = 1 << 20
# A table the planner puts on the host tier gets a device cache of this
# many batches' distinct rows: the three the pipelined Trainer keeps in
# flight and five more of rows to reuse (docs/planner.md).
HOST_CACHE_BATCHES = 8


class PlanInfeasibleError(Error):
  """No placement of the tables fits the memory budget per device."""


@dataclasses.dataclass(frozen=True)
class FeatureStats:
  """What the cost model reads of one feature.

  ids_per_example: mean ids (entries, padding included: the exchange
    buffers are sized by the batch's shape) of one example.
  distinct_per_batch: mean distinct ids of one batch as given to
    `batch_stats` (None: not measured); the cost model does not read it
    yet (the default row and table buckets do not depend on it).
  """
  ids_per_example: float = DEFAULT_IDS_PER_EXAMPLE
  distinct_per_batch: float | None = None


def _ids_of(value) -> np.ndarray:
  return np.asarray(value.ids if isinstance(value, Bag) else value)


def batch_stats(batches: Iterable[Mapping[str, Any]],
                features: Sequence[FeatureSpec]
                ) -> dict[str, FeatureStats]:
  """Host side: `{feature: FeatureStats}` averaged over sample batches.

  Args:
    batches: dicts of `{feature name: ids [B, ...]}` (numpy arrays or
      `pe.Bag`s), as a collection's `lookup` takes them.
    features: the features to measure (each must be in every batch).
  """
  counts = {f.name: [] for f in features}
  distinct = {f.name: [] for f in features}
  for batch in batches:
    for f in features:
      if f.name not in batch:
        raise InputError(
            f"pallas_emb batch_stats got a batch without feature {f.name!r} "
            f"(keys {sorted(batch)}); give every feature's ids in every "
            "batch.")
      ids = _ids_of(batch[f.name])
      if ids.ndim < 1 or ids.shape[0] == 0:
        raise InputError(
            f"pallas_emb batch_stats feature {f.name!r} has ids of shape "
            f"{ids.shape}; expected [B, ...] with B > 0.")
      counts[f.name].append(ids.size / ids.shape[0])
      distinct[f.name].append(np.unique(ids).size)
  if not any(counts.values()):
    raise InputError("pallas_emb batch_stats got no batches; give at least "
                     "one sample batch.")
  return {name: FeatureStats(float(np.mean(counts[name])),
                             float(np.mean(distinct[name])))
          for name in counts}


@dataclasses.dataclass(frozen=True)
class TablePlan:
  """One table's placement: `rank` for "table"; `bytes_per_rank` the
  table and optimizer state it alone stores on a rank holding it (stacks
  pad once per stack, so the rank total is what `PlanReport` says);
  `sent_per_step` the bytes a rank sends for it alone per step;
  `alternatives` the same two figures of every placement the table may
  take, so a report shows what decided it."""
  name: str
  placement: str
  rank: int | None
  bytes_per_rank: int
  sent_per_step: int
  alternatives: dict[str, tuple[int, int]] = dataclasses.field(
      default_factory=dict)
  # The host tier (docs/host_tier.md): a table moved there keeps its rows
  # in `host_bytes` of host memory and a cache of `cache_rows` rows on the
  # devices (its `bytes_per_rank`); `link_bytes_per_step` bounds what
  # crosses the host link per step (every distinct row a miss, fetched
  # and copied back); `why` says what made the planner move it.
  storage: str = "device"
  cache_rows: int | None = None
  host_bytes: int = 0
  link_bytes_per_step: int = 0
  why: str = ""


@dataclasses.dataclass(frozen=True)
class PlanReport:
  """What `plan` chose and what it costs per rank (see docs/planner.md).

  Every rank stores the same bytes (each stack's physical array shards
  evenly) and sends as many per step as it receives, so `memory_per_rank`
  and `sent_per_rank` hold one value per rank, all equal under the model.
  `column_only_*` are None when some width does not divide over the ranks.
  """
  ranks: int
  budget: int
  device_memory: int
  reserve: int
  tables: tuple[TablePlan, ...]
  memory_per_rank: tuple[int, ...]
  sent_per_rank: tuple[int, ...]
  column_only_memory: int | None
  column_only_sent: int | None
  host_memory: int | None = None

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def __str__(self) -> str:
    lines = [f"plan over {self.ranks} ranks, budget {self.budget} bytes per "
             f"rank ({self.device_memory} - reserve {self.reserve})"]
    for t in self.tables:
      where = t.placement + (f" on rank {t.rank}" if t.rank is not None
                             else "")
      lines.append(f"  {t.name}: {where}, {t.bytes_per_rank} bytes per "
                   f"rank, sends {t.sent_per_step} bytes per step")
      if t.storage == "host":
        lines.append(
            f"    host tier: {t.host_bytes} bytes in host memory, a device "
            f"cache of {t.cache_rows} rows, up to "
            f"{t.link_bytes_per_step} bytes per step over the host link; "
            f"{t.why}")
      # Why a small table is not replicated (docs/planner.md).
      if (t.placement != "replicated" and "replicated" in t.alternatives
          and t.bytes_per_rank <= SMALL_TABLE_BYTES):
        mem, sent = t.alternatives["replicated"]
        lines.append(f"    replicated it would store {mem} bytes per rank "
                     f"and send {sent} bytes per step")
    for r, (mem, sent) in enumerate(zip(self.memory_per_rank,
                                        self.sent_per_rank)):
      lines.append(f"  rank {r}: {mem} bytes of tables + optimizer state, "
                   f"sends and receives {sent} bytes per step")
    if self.column_only_memory is None:
      lines.append("  column-only: impossible (a width does not divide over "
                   "the ranks)")
    else:
      lines.append(f"  column-only: {self.column_only_memory} bytes per rank,"
                   f" {self.column_only_sent} bytes sent per step; this plan:"
                   f" {max(self.memory_per_rank)} and "
                   f"{max(self.sent_per_rank)}")
    return "\n".join(lines)


class _Model:
  """The cost of placements of the tables, per rank and step."""

  def __init__(self, tables, features, ranks, batch_size, stats,
               dedup="sort"):
    self.tables, self.features, self.ranks = tables, features, ranks
    self.batch_size, self.stats = batch_size, stats
    self.dedup = dedup
    self._alone = {}
    self.entries, self.rows_out, self.grad_rows = {}, {}, {}
    for t in tables:
      self.entries[t.name] = self.rows_out[t.name] = self.grad_rows[t.name] = 0
    for f in features:
      s = stats.get(f.name, FeatureStats())
      entries = batch_size * s.ids_per_example
      # Rows exchanged: one per sequence id, one per pooled bag, their
      # gradients in the table's dtype.
      rows = entries if f.combiner is None else batch_size
      table = next(t for t in tables if t.name == f.table)
      self.entries[f.table] += entries
      self.rows_out[f.table] += rows
      self.grad_rows[f.table] += rows * table.dtype.itemsize

  def placed(self, placements, pin_ranks=False):
    """The tables with these placements (a table-placed one pinned to the
    rank `stack_tables` balances it to when `pin_ranks`)."""
    out = [self._replace(t, p) for t, p in zip(self.tables, placements)]
    if not pin_ranks:
      return out
    homes = self.homes(out)
    return [dataclasses.replace(t, rank=homes[t.name]) if t.name in homes
            else t for t in out]

  def homes(self, tables) -> dict[str, int]:
    """The rank of every table-placed table, as `stack_tables` packs it."""
    homes = {}
    for s in self.stacks(tables):
      if s.placement == "table":
        for name, offset in zip(s.tables, s.row_offsets):
          homes[name] = offset // s.block_rows
    return homes

  @staticmethod
  def _replace(table, placement):
    if table.host:  # a host-tier table keeps its (row) placement
      return table
    changes = dict(placement=placement, rank=None)
    if placement in ("row", "table"):
      changes["max_unique"] = None  # owners size buffers by caps instead
    else:
      changes["max_ids_per_partition"] = None
    return dataclasses.replace(table, **changes)

  def stacks(self, tables):
    """The stacks the collection would build (int32 row ids unchecked:
    `fits` says whether they address every stack)."""
    return stack_tables(tables, self.features, self.ranks,
                        max_rows=None, dedup=self.dedup).stacks

  def memory(self, tables) -> int:
    """Exact bytes of tables and optimizer state on every rank."""
    return sum(sum(s.rank_bytes()) for s in self.stacks(tables))

  def fits(self, tables, budget) -> bool:
    """Every rank within `budget` and every stack addressable by int32
    row ids (a table stack is W blocks of its busiest rank's rows)."""
    return (self.memory(tables) <= budget
            and all(s.total_rows <= MAX_INT32 for s in self.stacks(tables)))

  def sent(self, tables) -> float:
    """Bytes a rank sends per step (forward and backward)."""
    w = self.ranks
    total = 0.0
    specs = {t.name: t for t in tables}
    for s in self.stacks(tables):
      d, b = s.emb_width, s.dtype.itemsize
      ids = sum(self.entries[n] for n in s.tables)
      rows = sum(self.rows_out[n] for n in s.tables)
      grads = sum(self.grad_rows[n] for n in s.tables) * d
      if s.placement == "column":
        total += (w - 1) * (ids * ID_BYTES + rows * d * b / w + grads / w)
      elif s.placement == "replicated":
        total += (w - 1) * (ids * ID_BYTES + grads)
      else:
        cap = self._capacity(s, specs)
        total += (w - 1) * cap * (ID_BYTES + d * b + d * 4)
    return total

  def _capacity(self, s, specs) -> float:
    """A row or table stack's per-pair bucket, as the collection sizes it:
    per table its ids on a rank, its rows, its cap, whichever is least;
    a table stack's busiest owner."""
    per_owner = [0.0] * self.ranks
    for name, offset in zip(s.tables, s.row_offsets):
      cap = min(self.entries[name], specs[name].vocab_rows)
      if specs[name].max_ids_per_partition is not None:
        cap = min(cap, specs[name].max_ids_per_partition)
      owner = offset // s.block_rows if s.placement == "table" else 0
      per_owner[owner] += cap
    return max(per_owner)

  def alone(self, table, placement) -> tuple[int, int]:
    """(bytes per rank, bytes sent per step) of one table by itself; a
    table-placed one counts its rank's bytes only."""
    if (table.name, placement) in self._alone:
      return self._alone[table.name, placement]
    t = self._replace(table, placement)
    feats = [f for f in self.features if f.table == table.name]
    ranks = 1 if placement == "table" else self.ranks
    mem = sum(sum(s.rank_bytes()) for s in
              stack_tables([t], feats, ranks, max_rows=None,
                           dedup=self.dedup).stacks)
    self._alone[table.name, placement] = mem, int(round(self.sent([t])))
    return self._alone[table.name, placement]

  def key(self, placements):
    """The objective and its tie-breaks (smaller is better)."""
    tables = self.placed(placements)
    return (int(round(self.sent(tables))), self.memory(tables),
            sum(ORDER.index(p) for p in placements))


def _check_stats(stats, features) -> None:
  names = {f.name for f in features}
  for name, s in stats.items():
    if name not in names:
      raise InputError(
          f"pallas_emb plan stats name feature {name!r}, which is not among "
          f"the features {sorted(names)}; drop it or add its FeatureSpec.")
    if (not isinstance(s, FeatureStats) or not s.ids_per_example > 0
        or (s.distinct_per_batch is not None and s.distinct_per_batch < 0)):
      raise InputError(
          f"pallas_emb plan stats[{name!r}]={s!r}; expected a "
          "pallas_emb.FeatureStats with ids_per_example > 0 (e.g. from "
          "pallas_emb.batch_stats).")


def _improve(model, current, allowed, budget):
  """The first improving move of one or two tables (None: none)."""
  tables = model.tables
  singles = []
  for i, t in enumerate(tables):
    mem, sent = model.alone(t, current[i])
    for p in allowed[i]:
      if p != current[i]:
        new_mem, new_sent = model.alone(t, p)
        singles.append((new_sent - sent, new_mem - mem, i, p))
  moves = [(ds, ((i, p),)) for ds, _, i, p in singles if ds <= 0]
  moves += [(a[0] + b[0], ((a[2], a[3]), (b[2], b[3])))
            for a in singles for b in singles
            if a[2] < b[2] and a[0] + b[0] <= 0 and (a[1] < 0 or b[1] < 0)]
  moves.sort(key=lambda m: m[0])
  best = model.key(current)
  for _, changes in moves[:64]:
    trial = list(current)
    for i, p in changes:
      trial[i] = p
    if model.key(trial) < best and model.fits(model.placed(trial), budget):
      return trial
  return None


def _device_memory() -> int:
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  limit = (stats or {}).get("bytes_limit")
  if not limit:
    raise InputError(
        "pallas_emb plan got device_memory=None and the device "
        f"({jax.devices()[0].platform}) reports no memory limit; give "
        "device_memory= in bytes per device.")
  return int(limit)


def plan(tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
         mesh: jax.sharding.Mesh, *, table_axis, batch_size: int,
         device_memory: int | None = None,
         stats: Mapping[str, FeatureStats] | None = None,
         reserve: int | None = None, dedup: str | None = None,
         host_memory: int | None = None
         ) -> tuple[list[TableSpec], PlanReport]:
  """Chooses every table's placement (and rank) under a memory budget.

  Args:
    tables, features: the collection's specs (their placements and ranks
      are replaced; `max_unique` is dropped off row and table placements,
      `max_ids_per_partition` off column and replicated ones).
    mesh, table_axis: the communicator the collection will use (W ranks).
    batch_size: examples per rank and step.
    device_memory: bytes per device (None: what the device reports).
    stats: `{feature: FeatureStats}` (`batch_stats`); a feature left out
      reads one id per example.
    reserve: bytes per device kept for the dense model and step buffers
      (None: a fifth of device_memory).
    dedup: the collection's `dedup` ("slot_map": column and replicated
      tables count their stack's slot map, 4 bytes a row on every rank;
      None: the default a collection on `mesh` with the default backend
      takes, `validation.default_dedup`).
    host_memory: bytes of host memory the host tier may hold (all ranks
      together; None: no host tier). When no placement fits the device
      budget, the tables with the most bytes per rank move to the host
      tier (row-placed, with a device cache of `HOST_CACHE_BATCHES`
      batches' distinct rows) until every rank fits; the report says
      which and why.

  Returns:
    `(tables with placements, PlanReport)`.

  Raises:
    PlanInfeasibleError: no plan fits `device_memory - reserve` per rank.
  """
  tables, features = tuple(tables), tuple(features)
  check_specs(tables, features)
  validation.check_positive("plan batch_size", batch_size)
  axis = (table_axis,) if isinstance(table_axis, str) else tuple(table_axis)
  if not axis or any(a not in mesh.shape for a in axis):
    raise InputError(
        f"pallas_emb plan table_axis={table_axis!r} is not among the mesh "
        f"axes {tuple(mesh.shape)}; give the communicator's axis name(s).")
  ranks = validation.axes_size(mesh, axis)
  if device_memory is None:
    device_memory = _device_memory()
  validation.check_positive("plan device_memory", device_memory)
  if reserve is None:
    reserve = int(device_memory * DEFAULT_RESERVE_FRACTION)
  if not 0 <= reserve < device_memory:
    raise InputError(
        f"pallas_emb plan reserve={reserve} is outside [0, device_memory="
        f"{device_memory}); give the bytes the dense model and step buffers "
        "need, less than the device's memory.")
  budget = device_memory - reserve
  _check_stats(stats or {}, features)
  model = _Model(tables, features, ranks, batch_size, dict(stats or {}),
                 validation.check_dedup(
                     dedup, validation.resolve_backend(mesh, None), "plan",
                     platform=mesh.devices.flat[0].platform))

  # Column needs the width to divide; a table whose W blocks of its rows
  # (table placement pads every rank to it) exceed int32 ids is not placed
  # whole on a rank.
  allowed = [[t.placement] if t.host else
             [p for p in ORDER
              if (p != "column" or t.emb_width % ranks == 0)
              and (p != "table" or ranks * t.vocab_rows <= MAX_INT32)]
             for t in tables]
  # 1. Each table where it alone sends least (then stores least).
  current = [min(ps, key=lambda p, t=t: model.alone(t, p)[::-1] +
                 (ORDER.index(p),))
             for t, ps in zip(tables, allowed)]
  # 2. Over budget: the move of one table that adds the fewest bytes sent
  #    per byte of memory per rank it saves (then saves most), until every
  #    rank fits or no move saves memory.
  while model.memory(model.placed(current)) > budget:
    moves = []
    for i, t in enumerate(tables):
      mem, sent = model.alone(t, current[i])
      for p in allowed[i]:
        new_mem, new_sent = model.alone(t, p)
        if new_mem < mem:
          moves.append(((new_sent - sent) / (mem - new_mem), new_mem - mem,
                        ORDER.index(p), i, p))
    if not moves:
      break
    *_, i, p = min(moves)
    current[i] = p
  # 3. Local search: moves of one table, or of two at once (one frees the
  #    memory the other needs), tried in order of the bytes sent they save
  #    by the tables' costs alone; the first that keeps every rank under
  #    budget and lowers (bytes sent, memory, tie-break) exactly is taken.
  for _ in range(4 * len(tables)):
    better = _improve(model, current, allowed, budget)
    if better is None:
      break
    current = better
  # 4. Never worse than a single placement for every table.
  candidates = [current] + [[p] * len(tables) for p in ORDER
                            if all(p in ps for ps in allowed)]
  feasible = [c for c in candidates if model.fits(model.placed(c), budget)]
  why, device_model, device_allowed = {}, model, allowed
  if not feasible and host_memory is not None:
    # 5. The host tier, for the tables that store most per rank.
    short = min(model.memory(model.placed(c)) for c in candidates) - budget
    model, current, allowed, why = _to_host_tier(
        model, current, allowed, budget, host_memory, short)
    feasible = [current] if model.fits(model.placed(current), budget) else []
    candidates = [current]
  if not feasible:
    _raise_infeasible(model, candidates, model.tables, ranks, budget,
                      device_memory, reserve, host_memory)
  best = min(feasible, key=model.key)
  placed = model.placed(best, pin_ranks=True)
  memory, sent = model.memory(placed), int(round(model.sent(placed)))
  column = ["column"] * len(tables)
  column_ok = all("column" in ps for ps in device_allowed)
  report = PlanReport(
      ranks=ranks, budget=budget, device_memory=int(device_memory),
      reserve=int(reserve),
      tables=tuple(TablePlan(t.name, p, t.rank, *model.alone(t, p),
                             alternatives={q: model.alone(t, q)
                                           for q in ps},
                             **_host_fields(model, t, why))
                   for t, p, ps in zip(placed, best, allowed)),
      memory_per_rank=(memory,) * ranks, sent_per_rank=(sent,) * ranks,
      column_only_memory=(device_model.memory(device_model.placed(column))
                          if column_ok else None),
      column_only_sent=(int(round(device_model.sent(device_model.placed(
          column)))) if column_ok else None),
      host_memory=host_memory)
  return placed, report


def _distinct_per_step(model, table) -> float:
  """A table's distinct rows in one step's batch: measured per feature
  (`batch_stats`), else every id of the step distinct; at most its rows."""
  distinct = 0.0
  for f in model.features:
    if f.table == table.name:
      s = model.stats.get(f.name, FeatureStats())
      distinct += (s.distinct_per_batch if s.distinct_per_batch is not None
                   else model.ranks * model.batch_size * s.ids_per_example)
  return min(distinct, table.vocab_rows)


def _host_cache_rows(model, table) -> int:
  """The device cache the planner gives a host-tier table: the distinct
  rows of `HOST_CACHE_BATCHES` steps, a multiple of 8 per rank, fewer
  than its rows."""
  step = 8 * model.ranks
  rows = step * math.ceil(
      HOST_CACHE_BATCHES * max(_distinct_per_step(model, table), 1) / step)
  return int(min(rows, table.vocab_rows - 1))


def _to_host_tier(model, current, allowed, budget, host_memory, short):
  """Moves the tables of most bytes per rank to the host tier, one at a
  time, until every rank fits the budget (or none is left to move, or
  host memory is full). Returns the new model, placements, allowed
  placements and `{table: why}`."""
  tables, current, allowed = list(model.tables), list(current), list(allowed)
  why, host_used = {}, 0
  while not model.fits(model.placed(current), budget):
    movable = [i for i, t in enumerate(tables)
               if not t.host and t.vocab_rows > 1]
    if not movable:
      break
    i = max(movable, key=lambda i: model.alone(tables[i], current[i])[0])
    t = tables[i]
    host = dataclasses.replace(
        t, placement="row", rank=None, max_unique=None, storage="host",
        cache_rows=_host_cache_rows(model, t))
    host_bytes = next(s for s in model.stacks([host])
                      if s.host).host_bytes()
    if host_used + host_bytes > host_memory:
      break
    host_used += host_bytes
    why[t.name] = (
        f"no placement fits the device budget ({short} bytes per rank "
        f"short), and it stored the most per rank "
        f"({model.alone(t, current[i])[0]} bytes as {current[i]})")
    tables[i], current[i], allowed[i] = host, "row", ["row"]
    model = _Model(tables, model.features, model.ranks, model.batch_size,
                   model.stats, model.dedup)
  return model, current, allowed, why


def _host_fields(model, table, why) -> dict[str, Any]:
  """The host-tier fields of a table's `TablePlan` (none for a device
  table)."""
  if not table.host:
    return {}
  (stack,) = [s for s in model.stacks([table]) if s.host]
  return dict(storage="host", cache_rows=table.cache_rows,
              host_bytes=stack.host_bytes(),
              link_bytes_per_step=int(2 * _distinct_per_step(model, table)
                                      * stack.row_bytes()),
              why=why.get(table.name, "given as host-tier"))


@dataclasses.dataclass(frozen=True)
class PlanCost:
  """What placements cost under `plan`'s model (docs/planner.md).

  memory_per_rank: bytes of tables and optimizer state every rank stores
    as the collection stacks them (padding included; equal on every rank).
  shard_bytes_per_rank: per rank, the bytes of the tables (or shards) it
    holds, each table counted alone: without the padding a table stack
    adds to reach its busiest rank.
  sent_per_rank: bytes a rank sends (and receives) per step.
  addressable: every stack within int32 row ids (else no collection holds
    these placements as given).
  """
  memory_per_rank: int
  shard_bytes_per_rank: tuple[int, ...]
  sent_per_rank: int
  addressable: bool


def plan_cost(tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
              ranks: int, *, batch_size: int,
              stats: Mapping[str, FeatureStats] | None = None,
              dedup: str = "sort") -> PlanCost:
  """Scores the tables' placements (and ranks) as given, e.g. a plan made
  by hand or by another planner, with the model `plan` minimizes (`dedup`:
  the collection's, as `plan`'s)."""
  tables, features = tuple(tables), tuple(features)
  check_specs(tables, features)
  validation.check_positive("plan_cost ranks", ranks)
  validation.check_positive("plan_cost batch_size", batch_size)
  _check_stats(stats or {}, features)
  model = _Model(tables, features, ranks, batch_size, dict(stats or {}),
                 validation.check_dedup(dedup, "xla", "plan_cost"))
  homes = model.homes(tables)
  shards = [0] * ranks
  for t in tables:
    mem = model.alone(t, t.placement)[0]
    for r in [homes[t.name]] if t.name in homes else range(ranks):
      shards[r] += mem
  return PlanCost(
      memory_per_rank=model.memory(tables),
      shard_bytes_per_rank=tuple(shards),
      sent_per_rank=int(round(model.sent(tables))),
      addressable=all(s.total_rows <= MAX_INT32
                      for s in model.stacks(tables)))


def _raise_infeasible(model, candidates, tables, ranks, budget,
                      device_memory, reserve, host_memory=None):
  least = min(model.memory(model.placed(c)) for c in candidates)
  row = [(model.alone(t, "row")[0], t.name) for t in tables]
  largest = ", ".join(f"{name!r} ({need} bytes per rank as row)"
                      for need, name in sorted(row, reverse=True)[:3])
  more = math.ceil(ranks * least / budget)
  raise PlanInfeasibleError(
      f"pallas_emb plan cannot fit the tables in {budget} bytes per rank "
      f"(device_memory {device_memory} - reserve {reserve}) on {ranks} "
      f"ranks: the least memory of any plan tried is {least} bytes per "
      f"rank, the largest tables being {largest}; give about {more} ranks "
      "or more, a larger device_memory or smaller reserve, or store the "
      "largest tables in bfloat16 or with an optimizer of less state"
      + (f", or give the host tier more than host_memory={host_memory} "
         "bytes." if host_memory is not None else
         ", or let them move to the host tier (host_memory=...)."))
