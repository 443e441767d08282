"""The fused sparse row-wise Adagrad (DESIGN §4).

`RowwiseAdagrad` holds the hyper-parameters (checked on construction);
`apply_gradients` routes one batch's embedding gradients to the ranks that
own their columns, sums them per unique row, and updates only those rows of
the table and of the row state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from pallas_emb.dedup import DedupResult
from pallas_emb import exchange
from pallas_emb import kernels
from pallas_emb import validation
from pallas_emb.kernels import common
from pallas_emb.errors import HyperParameterError
from pallas_emb.errors import InputError
from pallas_emb.kernels.hparams import AdagradHParams
from pallas_emb.validation import EmbeddingContext

Schedule = Callable[[jax.Array], jax.Array]


class RowwiseAdagradState(NamedTuple):
  """row_state: f32 [vocab_rows] accumulators (replicated).

  last_step: int32 [vocab_rows], the step each row was last updated (lazy
    mode only, else None).
  step: int32 scalar, the number of updates applied (skipped ones excluded).
  """
  row_state: jax.Array
  last_step: jax.Array | None
  step: jax.Array


class UpdateStats(NamedTuple):
  """norm: f32 full-width gradient norm of the batch.

  valid: int32, 1 if the update was applied (finite norm and pending).
  pending: int32, the pending flag that came in.
  num_overflow: int32, distinct ids that did not fit in num_unique (their
    gradients were not applied; `raise_if_overflow` turns it into an error).
  """
  norm: jax.Array
  valid: jax.Array
  pending: jax.Array
  num_overflow: jax.Array


UPDATE_STATS_SPEC = UpdateStats(P(), P(), P(), P())


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and \
      math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad:
  """Row-wise Adagrad: one f32 accumulator per row, shared by its columns.

  Args:
    learning_rate: a float, or a schedule `step -> lr` (e.g. an optax one).
    eps: added to sqrt(accumulator); finite and > 0.
    initial_accumulator_value: the accumulators' starting value, >= 0.
    half_life_steps: optional accumulator half-life in steps.
    weight_decay: decoupled decay rate per step on rows with a gradient:
      the row is multiplied by exp(-weight_decay).
    lazy: decay a row by the steps since it was last touched (needs a
      half-life or a weight decay) instead of once per touch.
  """
  learning_rate: Union[float, Schedule]
  eps: float = 1e-10
  initial_accumulator_value: float = 0.0
  half_life_steps: float | None = None
  weight_decay: float = 0.0
  lazy: bool = False

  def __post_init__(self):
    lr = self.learning_rate
    if not callable(lr) and not _finite(lr):
      raise HyperParameterError(
          f"pallas_emb RowwiseAdagrad learning_rate={lr!r} must be a finite "
          "number or a schedule step -> learning rate.")
    if not _finite(self.eps) or self.eps <= 0:
      raise HyperParameterError(
          f"pallas_emb RowwiseAdagrad eps={self.eps!r} must be finite and "
          "> 0 (1e-10 is usual).")
    if (not _finite(self.initial_accumulator_value) or
        self.initial_accumulator_value < 0):
      raise HyperParameterError(
          "pallas_emb RowwiseAdagrad initial_accumulator_value="
          f"{self.initial_accumulator_value!r} must be finite and >= 0.")
    if self.half_life_steps is not None and (
        not _finite(self.half_life_steps) or self.half_life_steps <= 0):
      raise HyperParameterError(
          f"pallas_emb RowwiseAdagrad half_life_steps={self.half_life_steps!r}"
          " must be a positive number of steps (the accumulator decays by "
          "exp(-ln2 / half_life_steps) per step), or None for no decay.")
    if not _finite(self.weight_decay) or self.weight_decay < 0:
      raise HyperParameterError(
          f"pallas_emb RowwiseAdagrad weight_decay={self.weight_decay!r} must "
          "be finite and >= 0: rows are multiplied by exp(-weight_decay), "
          "which must lie in (0, 1].")
    if math.exp(-self.weight_decay) <= 0:
      raise HyperParameterError(
          f"pallas_emb RowwiseAdagrad weight_decay={self.weight_decay!r} "
          "makes the row factor exp(-weight_decay) underflow to 0; use a "
          "smaller weight decay.")
    if self.lazy and self.half_life_steps is None and not self.weight_decay:
      raise HyperParameterError(
          "pallas_emb RowwiseAdagrad lazy=True needs half_life_steps or "
          "weight_decay: without a decay there is nothing to apply lazily; "
          "use lazy=False.")

  def hparams(self, emb_width: int) -> AdagradHParams:
    """The static constants the kernels use (DESIGN §4.5)."""
    half_life = self.half_life_steps
    return AdagradHParams(
        eps=float(self.eps),
        inv_width=1.0 / emb_width,
        lazy=bool(self.lazy),
        decay_factor=(1.0 if half_life is None else
                      math.exp(-math.log(2.0) / half_life)),
        weight_decay_factor=math.exp(-self.weight_decay),
        accum_decay_rate=(0.0 if half_life is None else
                          math.log(2.0) / half_life),
        weight_decay_rate=float(self.weight_decay))

  def learning_rate_at(self, step: jax.Array) -> jax.Array:
    lr = self.learning_rate
    return jnp.asarray(lr(step) if callable(lr) else lr, jnp.float32)

  def init(self, ctx: EmbeddingContext, table: jax.Array
           ) -> RowwiseAdagradState:
    """Replicated row state for a `[vocab_rows, emb_width]` table."""
    validation.check_table(ctx, table)
    return self.init_state(table.shape[0], exchange.replicated_sharding(ctx))

  def init_state(self, vocab_rows: int, replicated, table_sharding=None
                 ) -> RowwiseAdagradState:
    """The state of `vocab_rows` rows: row-wise, so all of it replicated."""
    del table_sharding  # No element-wise state.
    row_state = jnp.full((vocab_rows,), self.initial_accumulator_value,
                         jnp.float32, device=replicated)
    last_step = (jnp.zeros((vocab_rows,), jnp.int32, device=replicated)
                 if self.lazy else None)
    step = jnp.zeros((), jnp.int32, device=replicated)
    return RowwiseAdagradState(row_state, last_step, step)

  def state_specs(self, table_spec: P) -> RowwiseAdagradState:
    """The PartitionSpec of each state leaf (row-wise: replicated)."""
    del table_spec
    return RowwiseAdagradState(P(), P() if self.lazy else None, P())

  def update_rows(self, table, opt_state: RowwiseAdagradState, unique_tokens,
                  grad_accum, row_sq, apply, *, emb_width: int, backend: str,
                  config=None):
    """The fused update of the rows of `unique_tokens` (per rank).

    `grad_accum` f32 `[U, S]` holds this rank's columns of each unique
    row's summed gradient, `row_sq` f32 `[U]` the full-width squared norms;
    nothing changes where `apply` is false.
    """
    del config  # Adagrad kernel tile sizes: the kernel's own heuristic.
    step = opt_state.step
    table, row_state, last_step = kernels.adagrad_apply(
        table, opt_state.row_state, opt_state.last_step, unique_tokens,
        grad_accum, row_sq, apply, step, self.learning_rate_at(step),
        hparams=self.hparams(emb_width), backend=backend)
    return table, RowwiseAdagradState(row_state, last_step,
                                      step + apply.astype(jnp.int32))

  def slice_rows(self, opt_state: RowwiseAdagradState, start: int,
                 stop: int) -> RowwiseAdagradState:
    """The state of rows `[start, stop)` (one table of a stack)."""
    return RowwiseAdagradState(
        opt_state.row_state[start:stop],
        None if opt_state.last_step is None
        else opt_state.last_step[start:stop], opt_state.step)

  def concat_rows(self, states) -> RowwiseAdagradState:
    """The state of tables stacked in order (inverse of `slice_rows`)."""
    states = list(states)
    return RowwiseAdagradState(
        jnp.concatenate([s.row_state for s in states]),
        None if not self.lazy else jnp.concatenate(
            [s.last_step for s in states]),
        jnp.max(jnp.stack([jnp.asarray(s.step) for s in states])))


def _ordered_sum(x: jax.Array, axes) -> jax.Array:
  """A psum whose f32 summation order is fixed (rank order).

  An all-reduce's order depends on the collective implementation (in-process,
  gloo, NCCL), so a psum can differ by an ulp between a 1-process and a
  multi-process run; gathering and summing locally gives the same bits
  everywhere, for a payload of only `[ranks, num_unique (+1)]` floats.
  """
  return jnp.sum(lax.all_gather(x, exchange.axis_name(axes), axis=0), axis=0)


def update_from_routed(ctx: EmbeddingContext, opt, backend: str, table,
                       opt_state, routed, segments, unique_tokens, pending,
                       num_overflow):
  """DESIGN §4.2-§4.6 on one rank, once the gradients are routed.

  `routed` `[N, S]` holds this rank's columns of the gradient of every token
  of the communicator, `segments` `[N]` each token's unique slot (-1: none).
  """
  grad_accum, row_sq = kernels.segment_sum_rows(
      routed, segments, ctx.num_unique, round_dtype=table.dtype,
      backend=backend)
  if ctx.replica_axis:
    # Every replica applies the same update: sum all replicas' rows first.
    grad_accum = _ordered_sum(grad_accum, ctx.replica_axis)
    row_sq = common.row_square_sums(grad_accum, table.dtype)
  if ctx.group_size > 1:
    row_sq = _ordered_sum(row_sq, ctx.table_axis)
  norm = jnp.sqrt(row_sq[ctx.num_unique])
  apply = jnp.isfinite(norm) & pending
  table, opt_state = opt.update_rows(
      table, opt_state, unique_tokens, grad_accum, row_sq[:ctx.num_unique],
      apply, emb_width=ctx.emb_width, backend=backend)
  stats = UpdateStats(norm, apply.astype(jnp.int32),
                      pending.astype(jnp.int32), num_overflow)
  return table, opt_state, stats


def _apply_per_rank(ctx, opt, backend, table, opt_state, grads, segment_ids,
                    unique_tokens, pending, num_overflow):
  segments = exchange.all_gather_ids(ctx, segment_ids.reshape(-1))
  routed = exchange.route_gradients(
      ctx, grads.reshape(ctx.tokens_per_rank, ctx.emb_width))
  return update_from_routed(ctx, opt, backend, table, opt_state, routed,
                            segments, unique_tokens, pending, num_overflow)


def apply_gradients(ctx: EmbeddingContext, opt: RowwiseAdagrad,
                    table: jax.Array, opt_state: RowwiseAdagradState,
                    emb_grads: jax.Array,
                    dedup_result: DedupResult, *,
                    pending: bool | jax.Array = True,
                    backend: str | None = None):
  """One fused sparse row-wise Adagrad step (DESIGN §4).

  Args:
    ctx: the layout.
    opt: the optimizer.
    table: `[vocab_rows, emb_width]`, column-sharded.
    opt_state: from `opt.init`.
    emb_grads: gradients w.r.t. lookup's output, shaped and sharded like it.
    dedup_result: `dedup` of the token ids that were looked up.
    pending: apply (True) or skip (False) this update; may be traced.
    backend: "pallas", "interpret", "xla" or None for the platform default.

  Returns:
    `(table, opt_state, stats)`. Donate table and opt_state to the jitted
    caller so the rows are updated in place.
  """
  validation.check_table(ctx, table)
  validation.check_grads(ctx, emb_grads, dedup_result.segment_ids.shape)
  _check_state(ctx, opt, table, opt_state)
  backend = validation.resolve_backend(ctx, backend)
  table = exchange.place_table(ctx, table)
  emb_grads = exchange.place_tokens(ctx, emb_grads)
  tokens = exchange.token_spec(ctx)
  state_spec = opt.state_specs(exchange.table_spec(ctx))
  fn = functools.partial(_apply_per_rank, ctx, opt, backend)
  return exchange.shard(
      ctx, fn,
      in_specs=(exchange.table_spec(ctx), state_spec, tokens, tokens, P(),
                P(), P()),
      out_specs=(exchange.table_spec(ctx), state_spec, UPDATE_STATS_SPEC),
  )(table, opt_state, emb_grads, dedup_result.segment_ids,
    dedup_result.unique_tokens, jnp.asarray(pending, bool),
    dedup_result.num_overflow)


def _check_state(ctx, opt, table, opt_state) -> None:
  vocab_rows = table.shape[0]
  if not isinstance(opt_state, RowwiseAdagradState):
    raise InputError(
        f"pallas_emb opt_state is a {type(opt_state).__name__}; expected the "
        "RowwiseAdagradState that opt.init(ctx, table) returns.")
  if tuple(opt_state.row_state.shape) != (vocab_rows,):
    raise InputError(
        f"pallas_emb opt_state.row_state has shape "
        f"{tuple(opt_state.row_state.shape)}; expected ({vocab_rows},), one "
        "accumulator per table row. Re-create it with opt.init(ctx, table).")
  if opt.lazy != (opt_state.last_step is not None):
    raise InputError(
        f"pallas_emb RowwiseAdagrad(lazy={opt.lazy}) was given the state of "
        f"a lazy={not opt.lazy} optimizer; re-create it with "
        "opt.init(ctx, table).")
