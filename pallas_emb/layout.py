"""The static layout of one batch in each stack (built per batch shape).

A `StackLayout` says, for one stack and one set of id shapes, where each
feature's ids sit in this rank's part of the stack:

    entries = [sequence ids ... | pooled entries ...]     (this rank, `[E]`)
    rows    = [sequence ids ... | pooled bags ...]        (exchanged, `[T]`)

A sequence feature exchanges one row per id; a pooled feature exchanges one
(pooled) row per example. Everything here is plain Python on shapes, built
before tracing and hashable (a static argument of the per-rank code).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from pallas_emb.errors import InputError
from pallas_emb.specs import MAX_INT32
from pallas_emb.validation import EmbeddingContext


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
  """Where a feature's ids sit in its stack, for one batch shape (static)."""
  name: str
  row_offset: int
  vocab_rows: int
  padding_id: int | None
  shape: tuple[int, ...]      # the global ids shape
  combiner: str | None        # None: a sequence feature
  local_examples: int         # examples (leading dim) per rank
  # Its bags' weights are ones or a lengths mask (no per-id weights).
  implicit_weights: bool = False
  # A host-tier stack's feature: the per-rank code gets its entries as
  # keys of cache rows already (`per_rank` translates them), not as ids.
  cached: bool = False

  @property
  def pooled(self) -> bool:
    return self.combiner is not None

  @property
  def unit_weights(self) -> bool:
    """Every entry that trains enters its bag with combiner weight exactly
    1 (`combiner_weights`: implicit weights under `sum`, or bags of one),
    so its gradient needs no product with the weight."""
    return self.implicit_weights and (self.combiner == "sum"
                                      or self.bag_len == 1)

  @property
  def bag_len(self) -> int:
    """Ids per example: the bag length, or the sequence's other dims."""
    return int(np.prod(self.shape[1:], dtype=np.int64))

  @property
  def local_entries(self) -> int:
    return self.local_examples * self.bag_len

  @property
  def local_rows(self) -> int:
    """Rows it exchanges per rank: one per example if pooled, else per id."""
    return self.local_examples if self.pooled else self.local_entries


@dataclasses.dataclass(frozen=True)
class StackLayout:
  """A stack for one batch shape (static): its features, sequence ones first.

  `ctx.tokens_per_rank` is the rows exchanged per rank (sequence ids +
  pooled examples), `ctx.num_unique` the unique buffer of the stack.
  """
  name: str
  optimizer: object
  ctx: EmbeddingContext
  features: tuple[FeatureLayout, ...]
  # Per table of the stack, in row order: (its first stacked row, the most
  # slots of the unique buffer it may take). A batch's kept rows are
  # numbered in this order, each table's after the ones before (`dedup`).
  regions: tuple[tuple[int, int], ...] = ()
  # The stack's placement; row and table placements send each owner at
  # most `capacity` distinct rows per rank (the per-pair bucket), and a
  # table-placed stack's rank r holds stacked rows [r, r + 1) * block_rows.
  placement: str = "column"
  capacity: int = 0
  block_rows: int = 0
  # A row or table stack of pooled features only may pool each bag
  # partially on the owners (`row.py`) when that moves fewer bytes
  # (`pools_on_owner`); decided here, per batch shape, never by the user.
  pool_on_owner: bool = False

  @property
  def sequence(self) -> tuple[FeatureLayout, ...]:
    return tuple(f for f in self.features if not f.pooled)

  @property
  def pooled(self) -> tuple[FeatureLayout, ...]:
    return tuple(f for f in self.features if f.pooled)

  @property
  def sequence_entries(self) -> int:
    return sum(f.local_entries for f in self.sequence)

  @property
  def pooled_entries(self) -> int:
    return sum(f.local_entries for f in self.pooled)

  @property
  def pooled_bags(self) -> int:
    return sum(f.local_examples for f in self.pooled)

  @property
  def entries(self) -> int:
    return self.sequence_entries + self.pooled_entries

  @property
  def max_bag_len(self) -> int:
    return max((f.bag_len for f in self.pooled), default=0)

  def bag_starts(self) -> np.ndarray:
    """CSR starts of the communicator's pooled bags in the gathered pooled
    entries `[W, pooled_entries]`: source rank, then feature, then example
    (which is the destination-major order the all-to-all wants)."""
    lengths = np.concatenate([np.full(f.local_examples, f.bag_len)
                              for f in self.pooled] * self.ctx.group_size)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

  def entry_bags(self) -> np.ndarray:
    """This rank's pooled bag (0..pooled_bags-1) of each pooled entry."""
    return np.repeat(np.arange(self.pooled_bags, dtype=np.int32),
                     np.concatenate([np.full(f.local_examples, f.bag_len)
                                     for f in self.pooled]))


def stack_layouts(coll, shapes, implicit_weights=(), plan=None
                  ) -> tuple[StackLayout, ...]:
  """The layout of every stack of `coll` (of `plan`, default `coll.plan`)
  for a batch with these ids shapes (`{feature: shape}`) and these
  features' weights implicit (ones or a lengths mask). Checks int32
  offsets before tracing."""
  shards = coll.group_size * coll.num_replicas
  layouts = []
  for stack in (plan or coll.plan).stacks:
    feats, ids_per_table = [], {}
    for name in stack.features:
      spec = coll.features[name]
      i = stack.tables.index(spec.table)
      table = coll.tables[spec.table]
      feats.append(FeatureLayout(
          name=name, row_offset=stack.row_offsets[i],
          vocab_rows=table.vocab_rows, padding_id=table.padding_id,
          shape=tuple(shapes[name]), combiner=spec.combiner,
          local_examples=shapes[name][0] // shards,
          implicit_weights=name in implicit_weights, cached=stack.host))
      ids_per_table[table.name] = ids_per_table.get(table.name, 0) + (
          math.prod(shapes[name]))
    # Sequence features first: their ids are gathered, pooled ones pooled.
    feats = ([f for f in feats if not f.pooled] +
             [f for f in feats if f.pooled])
    # Each table may take so many slots of the stack's unique buffer: its
    # distinct rows in one batch are at most its ids and its rows (padding
    # takes no slot), so it never overflows unless max_unique caps it, and
    # a table over its cap never takes another table's slots.
    regions = tuple(
        (stack.row_offsets[i], _region_slots(coll.tables[t],
                                             ids_per_table.get(t, 0)))
        for i, t in enumerate(stack.tables))
    rows = sum(f.local_rows for f in feats)
    column = stack.placement == "column"
    capacity = _capacity(coll, stack, feats)
    num_unique = (coll.group_size * capacity if capacity else
                  sum(slots for _, slots in regions))
    ctx = EmbeddingContext(
        mesh=coll.mesh, table_axis=coll.table_axis,
        data_axis=coll.data_axis, group_size=coll.group_size,
        tokens_per_batch=rows * shards, tokens_per_rank=rows,
        emb_width=stack.emb_width,
        shard_width=stack.emb_width // (coll.group_size if column else 1),
        num_unique=max(1, num_unique),
        num_devices_per_node=jax.local_device_count(),
        replica_axis=coll.replica_axis, padding_id=None)
    layout = StackLayout(stack.name, stack.optimizer, ctx, tuple(feats),
                         regions, stack.placement, capacity,
                         stack.block_rows)
    layout = dataclasses.replace(layout, pool_on_owner=pools_on_owner(
        layout, stack.dtype.itemsize))
    _check_offsets(layout, stack)
    layouts.append(layout)
  return tuple(layouts)


def pooling_bytes(layout: StackLayout, itemsize: int) -> tuple[int, int]:
  """The all-to-all bytes one rank sends per step (forward and backward)
  of a row or table stack of pooled features only, `(pooling on the
  example's rank, pooling on the owners)`.

  W ranks, C the per-pair bucket, P pooled entries and B bags per rank,
  D columns of `itemsize` bytes. On the example's rank: the ids `W C 4`,
  the rows `W C D itemsize` back, the f32 gradient sums `W C D 4`. On the
  owners: every entry's local row and weight to every owner `W P 8`
  (another owner's entries travel as padding), the f32 partial sums
  `W B D 4` back, the bags' gradients `W B D itemsize` out again.
  """
  w, c, d = layout.ctx.group_size, layout.capacity, layout.ctx.emb_width
  p, b = layout.pooled_entries, layout.pooled_bags
  return (w * c * (4 + d * itemsize + d * 4),
          w * (p * 8 + b * d * 4 + b * d * itemsize))


def pools_on_owner(layout: StackLayout, itemsize: int) -> bool:
  """Whether a stack pools its bags partially on the owners: a row or
  table stack of pooled features only (sequence entries need their rows
  back anyway) with some entries (empty bags have nothing to pool), when
  that moves fewer bytes (a tie pools on the example's rank)."""
  if (layout.placement not in ("row", "table") or layout.sequence
      or not layout.pooled_entries):
    return False
  on_example, on_owner = pooling_bytes(layout, itemsize)
  return on_owner < on_example


def _region_slots(table, num_ids: int) -> int:
  """Unique slots of one table in one batch: never fewer than it can use,
  unless its `max_unique` caps it."""
  slots = min(num_ids, table.vocab_rows)
  if table.max_unique is not None:
    slots = min(slots, table.max_unique)
  return slots


def _capacity(coll, stack, feats) -> int:
  """Row and table placements: the distinct rows one rank sends one owner
  (per table: its ids on the rank, its rows, its `max_ids_per_partition`,
  whichever is least; a table-placed stack's busiest owner). 0 otherwise."""
  if stack.placement not in ("row", "table"):
    return 0
  ids = {}
  for f in feats:
    table = coll.features[f.name].table
    ids[table] = ids.get(table, 0) + f.local_entries
  per_owner = [0] * coll.group_size
  for name, offset in zip(stack.tables, stack.row_offsets):
    spec = coll.tables[name]
    cap = min(ids.get(name, 0), spec.vocab_rows)
    if spec.max_ids_per_partition is not None:
      cap = min(cap, spec.max_ids_per_partition)
    owner = offset // stack.block_rows if stack.placement == "table" else 0
    per_owner[owner] += cap
  return max(1, max(per_owner))


def _check_offsets(layout: StackLayout, stack) -> None:
  """Flat offsets of the stack's per-rank arrays fit int32 (before tracing)."""
  ctx = layout.ctx
  for what, size in (
      ("table shard", stack.local_rows * ctx.shard_width),
      ("owner buckets", ctx.group_size * layout.capacity * ctx.shard_width),
      ("gathered rows", ctx.group_size * layout.entries * ctx.shard_width),
      ("exchanged rows", ctx.group_size * ctx.tokens_per_rank
       * ctx.shard_width)):
    if size > MAX_INT32:
      raise InputError(
          f"pallas_emb {stack.name} {what} has {size} elements per rank, "
          "more than int32 offsets address; shard over more ranks or use "
          "smaller batches.")
