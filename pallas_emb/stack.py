"""The per-rank dataflow of one stack of a collection (DESIGN §10, §11).

Everything here runs on one rank inside the collection's `shard_map`. A
`StackCall` (static, built per batch shape by the collection) says where
each feature's ids sit in this rank's part of the stack:

    entries = [sequence ids ... | pooled entries ...]     (this rank, `[E]`)
    rows    = [sequence ids ... | pooled bags ...]        (exchanged, `[T]`)

A sequence feature exchanges one row per id; a pooled feature (a bag of
`bag_len` ids per example, with per-entry weights) is pooled on the rank
that serves the columns, before the all-to-all, so it exchanges one row per
example. Each entry travels as one int32 *key*: `k >= 0` is the stacked row
it looks up and trains, `k < 0` encodes the row `~k` that it looks up but
never trains (padding, ids outside their table after one wrap, weight 0).
The keys and the pooled entries' weights share ONE all-gather per stack.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import optim
from pallas_emb.dedup import FILL_VALUE
from pallas_emb.kernels import common
from pallas_emb.dedup import on_cpu
from pallas_emb.dedup import unique_and_segments
from pallas_emb.lookup import dense_table_grad
from pallas_emb.validation import EmbeddingContext


@dataclasses.dataclass(frozen=True)
class FeatureCall:
  """A feature's part of a stack in one call (static)."""
  name: str
  row_offset: int
  vocab_rows: int
  padding_id: int | None
  shape: tuple[int, ...]      # the global ids shape
  combiner: str | None        # None: a sequence feature
  local_examples: int         # examples (leading dim) per rank
  # Its bags' weights are ones or a lengths mask (no per-id weights).
  implicit_weights: bool = False

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
class StackCall:
  """A stack in one call (static): its features, sequence ones first.

  `ctx.tokens_per_rank` is the rows exchanged per rank (sequence ids +
  pooled examples), `ctx.num_unique` the unique buffer of the stack.
  """
  name: str
  optimizer: object
  ctx: EmbeddingContext
  features: tuple[FeatureCall, ...]

  @property
  def sequence(self) -> tuple[FeatureCall, ...]:
    return tuple(f for f in self.features if not f.pooled)

  @property
  def pooled(self) -> tuple[FeatureCall, ...]:
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


class StackRouting(NamedTuple):
  """How one batch's ids of a stack map onto unique rows.

  unique_tokens: int32 `[U]` sorted unique stacked rows, FILL_VALUE padded;
    replicated.
  segments: int32, per rank `[W * E]`: the unique slot of every entry of the
    communicator (the all-gathered order), -1 for none.
  weights: f32, per rank `[W * pooled entries]`: the combiner weight of
    every pooled entry of the communicator (empty without pooled features).
  num_distinct, num_overflow: int32 scalars (see `dedup`).
  """
  unique_tokens: jax.Array
  segments: jax.Array
  weights: jax.Array
  num_distinct: jax.Array
  num_overflow: jax.Array


# --- keys and weights ------------------------------------------------------------


def entry_keys(feature: FeatureCall, ids: jax.Array,
               weights: jax.Array | None):
  """A feature's entries as keys (see the module docstring); `weights`: the
  pooled entries' weights (0: the entry does not train)."""
  x = ids.reshape(-1)
  wrapped = jnp.where(x < 0, x + feature.vocab_rows, x)
  row = feature.row_offset + jnp.clip(wrapped, 0, feature.vocab_rows - 1)
  trains = (wrapped >= 0) & (wrapped < feature.vocab_rows)
  if feature.padding_id is not None:
    trains &= x != feature.padding_id
  if weights is not None:
    trains &= weights.reshape(-1) != 0
  return jnp.where(trains, row, ~row)


def combiner_weights(feature: FeatureCall, ids: jax.Array,
                     weights: jax.Array) -> jax.Array:
  """Per entry of `[B, L]` bags: the weight its row enters the pool with.

  `sum`: w; `mean`: w / sum(w); `sqrtn`: w / sqrt(sum(w^2)) (TF's
  embedding_lookup_sparse). The padding id weighs 0; an empty bag pools
  to zeros.
  """
  w = weights.astype(jnp.float32)
  if feature.padding_id is not None:
    w = jnp.where(ids == feature.padding_id, 0.0, w)
  if feature.combiner == "sum":
    return w
  total = (jnp.sum(w, axis=1, keepdims=True) if feature.combiner == "mean"
           else jnp.sqrt(jnp.sum(w * w, axis=1, keepdims=True)))
  # XLA rewrites a division by a broadcast (or by a sqrt) into a product
  # with a reciprocal (or rsqrt), whose last bit differs from TF's and from
  # platform to platform; behind the barrier the division is IEEE-exact.
  total = lax.optimization_barrier(
      jnp.broadcast_to(jnp.where(total != 0, total, 1.0), w.shape))
  return jnp.where(w != 0, w / total, 0.0)


def gather_entries(call: StackCall, ids: Sequence[jax.Array],
                   weights: Sequence[jax.Array]):
  """One all-gather of the stack's keys (and pooled weights).

  `ids`: this rank's ids per feature (the call's order); `weights`: the
  combiner weights of its pooled features. Returns `(keys_all [W, E],
  weights_all [W, pooled entries])`.
  """
  w_by_name = dict(zip((f.name for f in call.pooled), weights))
  parts = [entry_keys(f, x, w_by_name.get(f.name))
           for f, x in zip(call.features, ids)]
  wbits = [lax.bitcast_convert_type(w_by_name[f.name].reshape(-1),
                                    jnp.int32) for f in call.pooled]
  local = jnp.concatenate(parts + wbits) if len(parts + wbits) > 1 else (
      parts[0])
  gathered = exchange.all_gather_ids(call.ctx, local).reshape(
      call.ctx.group_size, -1)
  keys_all = gathered[:, :call.entries]
  weights_all = lax.bitcast_convert_type(gathered[:, call.entries:],
                                         jnp.float32)
  return keys_all, weights_all


def rows_of(keys: jax.Array) -> jax.Array:
  """The row each key looks up."""
  return jnp.where(keys < 0, ~keys, keys)


# --- lookup ----------------------------------------------------------------------


def serve(call: StackCall, backend: str, table, keys_all, weights_all,
          kernel_config=None) -> list[jax.Array]:
  """This rank's embeddings of every feature (the call's order).

  Gathers this rank's columns of every sequence id and pools them for every
  bag of the communicator, then ONE all-to-all brings each rank the full
  rows of its own examples.
  """
  return exchange_served(call, gather_served(call, backend, table, keys_all,
                                             weights_all, kernel_config))


def serve_and_route(call: StackCall, backend: str, table, keys_all,
                    weights_all, kernel_config=None
                    ) -> tuple[list[jax.Array], StackRouting]:
  """`serve` and `route` of one batch, the routing ordered after the gather.

  The update that reads this routing writes the table in place. When the
  gradients do not depend on the embeddings (a loss linear in them),
  nothing else orders the lookup's reads of the table before that write,
  and XLA copies the whole table (twice) to keep both. An
  optimization_barrier does not order anything once XLA expands it; a data
  dependence does: the unique rows get `int(first served value * 0)` of
  each part (sequence rows, pooled rows: XLA slices through the
  concatenation to the part's own producer), always 0 (a float times 0 is
  never folded; NaN, from an infinite or NaN value, is replaced by 0
  before the conversion).
  """
  served = gather_served(call, backend, table, keys_all, weights_all,
                         kernel_config)
  routing = route(call, keys_all, weights_all)
  starts = (([0] if call.sequence else []) +
            ([call.sequence_entries] if call.pooled else []))
  product = sum(served[0, start, 0].astype(jnp.float32)
                for start in starts) * 0
  zero = jnp.where(jnp.isnan(product), 0.0, product).astype(jnp.int32)
  return (exchange_served(call, served),
          routing._replace(unique_tokens=routing.unique_tokens + zero))


def gather_served(call: StackCall, backend: str, table, keys_all,
                  weights_all, kernel_config=None) -> jax.Array:
  """`[W, rows per rank, S]`: this rank's columns of every row it serves."""
  ctx = call.ctx
  w = ctx.group_size
  rows = rows_of(keys_all)
  served = []
  if call.sequence:
    seq = rows[:, :call.sequence_entries].reshape(-1)
    served.append(kernels.gather_rows(
        table, seq, backend=backend,
        config=kernel_config.gather if kernel_config else None).reshape(
            w, call.sequence_entries, -1))
  if call.pooled:
    pooled = kernels.pool_rows(
        table, rows[:, call.sequence_entries:].reshape(-1),
        weights_all.reshape(-1), jnp.asarray(call.bag_starts()),
        max_len=call.max_bag_len, backend=backend,
        config=kernel_config.pool if kernel_config else None)
    served.append(pooled.reshape(w, call.pooled_bags, -1))
  return jnp.concatenate(served, axis=1) if len(served) > 1 else served[0]


def exchange_served(call: StackCall, served: jax.Array) -> list[jax.Array]:
  """ONE all-to-all of the served rows -> this rank's rows per feature."""
  mine = exchange.exchange_rows(call.ctx,
                                served.reshape(-1, served.shape[-1]))
  return split_rows(call, mine)


def split_rows(call: StackCall, rows: jax.Array) -> list[jax.Array]:
  """This rank's exchanged rows `[T, D]` -> one array per feature."""
  out, start = [], 0
  for f in call.features:
    shape = (f.local_examples,) + (() if f.pooled else f.shape[1:])
    out.append(rows[start:start + f.local_rows].reshape(
        shape + rows.shape[-1:]))
    start += f.local_rows
  return out


# --- gradients -------------------------------------------------------------------


def _routed_rows(call: StackCall, grads: Sequence[jax.Array]) -> jax.Array:
  """`[W, rows per rank, S]`: this rank's columns of the gradient of every
  row the communicator exchanged (ONE all-to-all; pooled ones in f32)."""
  flat = [g.reshape(-1, g.shape[-1]) for g in grads]
  if call.pooled:
    flat = [g.astype(jnp.float32) for g in flat]
  local = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
  return exchange.route_gradients(call.ctx, local).reshape(
      call.ctx.group_size, call.sequence_entries + call.pooled_bags, -1)


def _per_pooled_feature(call: StackCall, bags: jax.Array,
                        weights_all: jax.Array):
  """Per pooled feature: `(feature, its bags [W, n, S], its entries'
  weights [W, n, L])`, from all pooled bags and entry weights."""
  w = call.ctx.group_size
  bag = entry = 0
  for f in call.pooled:
    n, length = f.local_examples, f.bag_len
    yield (f, bags[:, bag:bag + n],
           weights_all[:, entry:entry + n * length].reshape(w, n, length))
    bag += n
    entry += n * length


def routed_entry_grads(call: StackCall, grads: Sequence[jax.Array],
                       weights_all: jax.Array) -> jax.Array:
  """`[W * E, S]`: this rank's columns of the gradient of every entry of the
  communicator, in the all-gathered order (what the segment sum reads).

  The features' gradients travel back through ONE all-to-all (a pooled
  feature's one row per example); a pooled example's gradient then reaches
  each of its entries scaled by the entry's combiner weight.
  """
  routed = _routed_rows(call, grads)
  if not call.pooled:
    return routed.reshape(-1, routed.shape[-1])
  bags = routed[:, call.sequence_entries:]
  per_entry = jnp.take(bags, jnp.asarray(call.entry_bags()), axis=1)
  # Rounded on its own: never contracted into the segment sum's adds.
  per_entry = common.unfused_product(per_entry, weights_all[:, :, None])
  return jnp.concatenate([routed[:, :call.sequence_entries], per_entry],
                         axis=1).reshape(-1, routed.shape[-1])


def grad_sums_by_position(call: StackCall, grads: Sequence[jax.Array],
                          weights_all: jax.Array, segments: jax.Array,
                          round_dtype) -> tuple[jax.Array, jax.Array]:
  """The xla backend's segment sums of a stack with pooled features.

  What `segment_sum_rows(routed_entry_grads(...), segments)` computes,
  without the `[W * E, S]` per-entry gradient: each bag position k of a
  pooled feature scatter-adds `bag gradient * weight[:, k]` (`[W * n, S]`)
  straight into the sums, so a bag of L ids costs L scatters of one row per
  bag instead of a buffer L times the bags' size. The adds meet each slot
  in another order than the entry order (f32 rounding of the sums).
  """
  ctx = call.ctx
  w, num_unique = ctx.group_size, ctx.num_unique
  routed = _routed_rows(call, grads)
  width = routed.shape[-1]
  segments = segments.reshape(w, call.entries)
  slots = lambda s: kernels.reference.kept_segments(s, num_unique)
  accum = jnp.zeros((num_unique, width), jnp.float32)
  if call.sequence:
    accum = accum.at[slots(segments[:, :call.sequence_entries]).reshape(
        -1)].add(routed[:, :call.sequence_entries].reshape(-1, width),
                 mode="drop")
  entry = call.sequence_entries
  for f, bags, weights in _per_pooled_feature(
      call, routed[:, call.sequence_entries:], weights_all):
    n, length = f.local_examples, f.bag_len
    seg = segments[:, entry:entry + n * length].reshape(w, n, length)
    entry += n * length

    def add(k, acc, f=f, bags=bags, seg=seg, weights=weights):
      rows = bags if f.unit_weights else common.unfused_product(
          bags, lax.dynamic_index_in_dim(weights, k, 2, keepdims=False)[
              ..., None])
      keys = slots(lax.dynamic_index_in_dim(seg, k, 2, keepdims=False))
      return acc.at[keys.reshape(-1)].add(rows.reshape(-1, width),
                                          mode="drop")

    accum = lax.fori_loop(0, length, add, accum, unroll=min(length, 4))
  return accum, common.row_square_sums(accum, round_dtype)


def route(call: StackCall, keys_all, weights_all) -> StackRouting:
  """Dedup of the communicator's keys (global over replicas)."""
  ctx = call.ctx
  keys = jnp.where(keys_all < 0, FILL_VALUE, keys_all).reshape(-1)
  n = keys.shape[0]
  if ctx.replica_axis:
    keys = lax.all_gather(keys, exchange.axis_name(ctx.replica_axis),
                          axis=0, tiled=True)
  unique, segments, distinct, overflow = unique_and_segments(
      keys, ctx.num_unique, on_cpu=on_cpu(ctx))
  if ctx.replica_axis:
    replica = lax.axis_index(exchange.axis_name(ctx.replica_axis))
    segments = lax.dynamic_slice_in_dim(segments, replica * n, n)
  return StackRouting(unique, segments, weights_all.reshape(-1), distinct,
                      overflow)


def update(call: StackCall, backend: str, table, opt_state,
           routing: StackRouting, grads, pending, kernel_config=None):
  """The stack's fused sparse update from its features' gradients."""
  weights_all = routing.weights.reshape(call.ctx.group_size, -1)
  if call.pooled and backend == "xla":
    grad_accum, row_sq = grad_sums_by_position(
        call, grads, weights_all, routing.segments, table.dtype)
    return optim.update_from_sums(
        call.ctx, call.optimizer, backend, table, opt_state, grad_accum,
        row_sq, routing.unique_tokens, pending, routing.num_overflow,
        kernel_config)
  routed = routed_entry_grads(call, grads, weights_all)
  return optim.update_from_routed(
      call.ctx, call.optimizer, backend, table, opt_state, routed,
      routing.segments, routing.unique_tokens, pending, routing.num_overflow,
      kernel_config)


def dense_grad(call: StackCall, table, keys_all, weights_all, cotangents):
  """The dense scatter-add cotangent of the stack's table (plain jax.grad).

  Entries that never train (padding, ids outside their table) add nothing,
  as in the sparse update: the dense and the sparse path train the same rows.
  """
  routed = routed_entry_grads(call, cotangents, weights_all)
  routed = jnp.where((keys_all.reshape(-1) >= 0)[:, None], routed, 0)
  return dense_table_grad(call.ctx, table, rows_of(keys_all).reshape(-1),
                          routed)
