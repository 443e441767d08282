"""The pipelined (one-step-stale) train step over a collection.

In step t the dense model runs forward and backward on embeddings that were
looked up in step t-1, while the embedding update staged in step t-1 is
applied; the lookup of batch t+1 is issued after that update, so it overlaps
the dense backward, and batch t's embedding gradients are staged for step
t+1. The result equals, bit for bit, a synchronous loop that applies each
step's embedding gradients one step late.

Everything the step carries is one explicit pytree, `PipelineState`, donated
from step to step; `Trainer(pipelined=False)` is the plain synchronous step
with the same interface. The lookup of a batch also routes it (one id
all-gather per stack serves the lookup, the dedup and the update).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_emb import exchange
from pallas_emb.state import CollectionState
from pallas_emb.collection import EmbeddingCollection
from pallas_emb.state import Routing
from pallas_emb.state import move_slot_maps
from pallas_emb.errors import InputError
from pallas_emb.errors import PipelineMisuse
from pallas_emb.errors import UniqueOverflowError

LossFn = Callable[[Any, Mapping[str, jax.Array], Mapping[str, Any]],
                  tuple[jax.Array, Any]]


class Prefetched(NamedTuple):
  """The next batch's embeddings, looked up a step early, and its routing."""
  embeddings: dict[str, jax.Array]
  routing: Routing


class Staged(NamedTuple):
  """A batch's embedding gradients waiting to be applied next step."""
  emb_grads: dict[str, jax.Array]
  routing: Routing
  pending: jax.Array  # bool scalar; False for the no-op first update


class PipelineState(NamedTuple):
  """Everything a step carries; donate it to the next step.

  prefetched and staged are None in synchronous mode.
  """
  embedding: CollectionState
  dense_params: Any
  dense_opt_state: Any
  prefetched: Prefetched | None
  staged: Staged | None


class StepMetrics(NamedTuple):
  """`updates`: stack name -> UpdateStats; `cache`: host-tier table name ->
  `host_tier.CacheStats` of the batch prefetched in the step (None
  without host-tier tables)."""
  loss: jax.Array
  aux: Any
  updates: dict[str, Any]
  cache: dict[str, Any] | None = None


class _NotOurOverflow(logging.Filter):
  """Drops JAX's log record of a callback that raised UniqueOverflowError:
  the error reaches the caller in the step's runtime error, and JAX's
  record of it (a traceback on stderr, printed again at interpreter exit)
  would be noise."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, UniqueOverflowError)


_OVERFLOW_FILTER = _NotOurOverflow()


def _traced(tree) -> bool:
  """Whether any leaf of `tree` is a tracer (we are under a jit)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _quiet_overflow_logs() -> None:
  logging.getLogger("jax._src.debugging").addFilter(_OVERFLOW_FILTER)


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
  """A collection's tables with the fused sparse update, dense params with optax.

  With host-tier tables (docs/host_tier.md), `step` is called as it is,
  not under your jit: it prefetches the batch it looks up into the device
  caches on the host, then runs its own jitted step (donating the state),
  while the previous step may still run on the devices.

  Args:
    collection: the `EmbeddingCollection` (its backend runs the kernels).
    loss_fn: `(dense_params, embeddings, batch) -> (loss, aux)`, where
      `embeddings` is `{feature: array}` as `collection.lookup` returns.
    dense_optimizer: any optax GradientTransformation for dense_params.
    pipelined: one-step-stale pipelined step (True) or synchronous (False).
    check_overflow: raise when a table's batch had more distinct rows than
      its `TableSpec.max_unique` (row and table placements: more for one
      owner than its `max_ids_per_partition`), whose gradients were then
      not applied: the step's result fails to materialize with the
      collection's `UniqueOverflowError` message. With host-tier tables
      the step checks on the host instead, a step late: the next `step`
      (or `flush`) raises it. False: read the stats
      yourself with
      `collection.raise_if_overflow(metrics.updates)`.
  """
  collection: EmbeddingCollection
  loss_fn: LossFn
  dense_optimizer: Any
  pipelined: bool = True
  check_overflow: bool = True

  # --- pieces ---------------------------------------------------------------

  def _dense(self, params, opt_state, embeddings, batch):
    grad_fn = jax.value_and_grad(self.loss_fn, argnums=(0, 1), has_aux=True)
    (loss, aux), (dense_grads, emb_grads) = grad_fn(params, embeddings, batch)
    updates, opt_state = self.dense_optimizer.update(dense_grads, opt_state,
                                                     params)
    params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)
    return loss, aux, params, opt_state, emb_grads

  @functools.cached_property
  def _checks_overflow(self) -> bool:
    """Only collections with a capped table (a host-tier one counts the
    rows missing from its cache) can overflow, so only they pay for it."""
    return self.check_overflow and any(
        t.max_unique is not None or t.max_ids_per_partition is not None
        or t.host for t in self.collection.tables.values())

  def _checked(self, stats, in_step: bool = True):
    """Raises (through a host callback) if an update overflowed a cap
    (`in_step=False`: the host-tier step checks on the host instead,
    `_check_on_host`)."""
    if self._checks_overflow and in_step:
      _quiet_overflow_logs()
      jax.debug.callback(self.collection.raise_if_overflow, stats)
    return stats

  @functools.cached_property
  def _unchecked(self) -> list:
    """The host-tier steps' stats not checked yet (the newest)."""
    return []

  def _check_on_host(self, stats=None) -> None:
    """The host-tier step's overflow check, a step late: raises for the
    stats of the step before (ready by now, copied to the host while this
    one was dispatched) and keeps `stats` for the next call. A callback in
    the step would make the devices wait for this thread, which is busy
    with the next prefetch: on a v5e its waits took 2.5 ms of a 3.8 ms
    step (16,384 ids)."""
    if not self._checks_overflow:
      return
    previous = list(self._unchecked)
    self._unchecked.clear()
    if stats is not None:
      for s in stats.values():
        s.num_overflow.copy_to_host_async()
      self._unchecked.append(stats)
    for p in previous:
      self.collection.raise_if_overflow(p)

  def _replicated(self, value) -> jax.Array:
    return jax.device_put(jnp.asarray(value),
                          NamedSharding(self.collection.mesh, P()))

  def _on_mesh(self, tree):
    """Leaves not yet placed on the collection's mesh, replicated over it.

    The step returns the dense parameters and optimizer state so; given
    them otherwise (host arrays, one device's), its second call would
    compile the whole step again. Leaves the user sharded on the mesh stay,
    and so do traced ones (`init` under the user's jit: theirs to place).
    """
    mesh = self.collection.mesh

    def place(x):
      if isinstance(x, jax.core.Tracer) or (
          isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
          and x.sharding.mesh == mesh):
        return x
      return self._replicated(x)

    return jax.tree.map(place, tree)

  # --- public ---------------------------------------------------------------

  def init(self, embedding: CollectionState, dense_params,
           first_batch=None) -> PipelineState:
    """The initial state; pipelined mode issues the first batch's lookup.

    The state may share buffers with its inputs, and the step donates it:
    pass copies if you still need them.
    """
    dense_params = self._on_mesh(dense_params)
    dense_opt_state = self._on_mesh(self.dense_optimizer.init(dense_params))
    if getattr(embedding, "host", None) is not None:
      # The batches whose updates are in flight keep their cache rows.
      embedding.host.in_flight = 2 if self.pipelined else 0
    if not self.pipelined:
      return PipelineState(embedding, dense_params, dense_opt_state, None,
                           None)
    if first_batch is None:
      raise PipelineMisuse(
          "pallas_emb pipelined Trainer.init needs first_batch: the first "
          "lookup is issued at init so step 0 has embeddings to consume.")
    embedding, _ = self.collection.prefetch(embedding, first_batch)
    embeddings, routing = jax.jit(self.collection.lookup_and_route)(
        embedding, first_batch)
    embedding, routing = move_slot_maps(embedding, routing)
    prefetched = Prefetched(embeddings, routing)
    # The first update is a no-op: zero gradients, pending False. Its routing
    # is a copy: a donated pytree must not hold one buffer twice.
    staged = Staged(jax.tree.map(jnp.zeros_like, prefetched.embeddings),
                    jax.tree.map(jnp.copy, prefetched.routing),
                    self._replicated(False))
    return PipelineState(embedding, dense_params, dense_opt_state,
                         prefetched, staged)

  def step(self, state: PipelineState, batch, next_batch=None):
    """One step on `batch`; pipelined mode also prefetches `next_batch`.

    Returns `(state, StepMetrics)`. Jit it with `donate_argnums=0` (with
    host-tier tables it jits itself: call it as it is).
    """
    self._check_state(state, next_batch)
    if self.collection.host_tables:
      return self._host_step(state, batch, next_batch)
    return self._step(state, batch, next_batch)

  def _host_step(self, state, batch, next_batch):
    """Prefetch the batch this step looks up into the host-tier tables'
    caches (on the host: the previous step may still run), then the
    jitted step."""
    if _traced(state):
      raise InputError(
          f"pallas_emb Trainer.step was traced (under jax.jit?), but host-"
          f"tier tables {list(self.collection.host_tables)} move rows "
          "between host memory and their device caches before each step; "
          "call trainer.step(state, batch, next_batch) unjitted: it jits "
          "its device step itself.")
    embedding, cache = self.collection.prefetch(
        state.embedding, next_batch if self.pipelined else batch)
    state, metrics = self._jitted_step(state._replace(embedding=embedding),
                                       batch, next_batch)
    self._check_on_host(metrics.updates)
    return state, metrics._replace(cache=cache)

  @functools.cached_property
  def _jitted_step(self):
    return jax.jit(functools.partial(self._step, in_step_checks=False),
                   donate_argnums=0)

  def _step(self, state: PipelineState, batch, next_batch,
            in_step_checks: bool = True):
    coll = self.collection
    if not self.pipelined:
      embeddings, routing = coll.lookup_and_route(state.embedding, batch)
      loss, aux, params, dense_opt, emb_grads = self._dense(
          state.dense_params, state.dense_opt_state, embeddings, batch)
      embedding, stats = coll.apply_gradients(state.embedding, routing,
                                              emb_grads)
      return (PipelineState(embedding, params, dense_opt, None, None),
              StepMetrics(loss, aux, self._checked(stats, in_step_checks)))

    # (a) apply the update staged in step t-1 while the dense model runs on
    # the embeddings prefetched in step t-1: independent, so XLA overlaps them.
    staged = state.staged
    embedding, stats = coll.apply_gradients(
        state.embedding, staged.routing, staged.emb_grads,
        pending=staged.pending)
    loss, aux, params, dense_opt, emb_grads = self._dense(
        state.dense_params, state.dense_opt_state,
        state.prefetched.embeddings, batch)
    # (b) the lookup of batch t+1 reads the updated tables; it depends on
    # nothing of the backward, so it overlaps it. Its slot maps (if any) go
    # straight back into the state: the routings in flight hold none.
    embeddings, routing = coll.lookup_and_route(embedding, next_batch)
    embedding, routing = move_slot_maps(embedding, routing)
    prefetched = Prefetched(embeddings, routing)
    # (c) stage batch t's gradients for step t+1, laid out like the
    # embeddings (else XLA may pick another layout and step 2 recompiles).
    emb_grads = {k: exchange.place(g, coll.token_sharding())
                 for k, g in emb_grads.items()}
    staged = Staged(emb_grads, state.prefetched.routing, jnp.asarray(True))
    return (PipelineState(embedding, params, dense_opt, prefetched, staged),
            StepMetrics(loss, aux, self._checked(stats, in_step_checks)))

  def flush(self, state: PipelineState) -> tuple[PipelineState, dict]:
    """Applies the last staged update (end of training, before eval/saving).
    With host-tier tables, first raises for the last step's overflow (the
    step checks the one before it)."""
    if self.collection.host_tables:
      self._check_on_host()
    if not self.pipelined:
      return state, {}
    self._check_state(state, None, need_next=False)
    staged = state.staged
    embedding, stats = self.collection.apply_gradients(
        state.embedding, staged.routing, staged.emb_grads,
        pending=staged.pending)
    if (self.collection.host_tables and self._checks_overflow
        and not _traced(stats)):
      self.collection.raise_if_overflow(stats)  # on the host, as the step
    else:
      stats = self._checked(stats)
    return (state._replace(embedding=embedding, staged=staged._replace(
        pending=jnp.zeros_like(staged.pending))), stats)

  # --- checks ---------------------------------------------------------------

  def _check_state(self, state, next_batch, need_next=True):
    if not isinstance(state, PipelineState):
      raise PipelineMisuse(
          f"pallas_emb Trainer.step got a {type(state).__name__}; expected "
          "the PipelineState that Trainer.init returns.")
    if self.pipelined:
      if state.prefetched is None or state.staged is None:
        raise PipelineMisuse(
            "pallas_emb pipelined step was given a state with nothing "
            "prefetched or staged (a synchronous Trainer's state?); create it "
            "with Trainer(pipelined=True).init(embedding, params, "
            "first_batch).")
      if need_next and next_batch is None:
        raise PipelineMisuse(
            "pallas_emb pipelined step needs next_batch: its lookup is issued "
            "during this step. At the end of the data, pass the last batch "
            "again and call flush() instead of another step.")
    elif state.prefetched is not None:
      raise PipelineMisuse(
          "pallas_emb synchronous step was given a pipelined state: its "
          "staged update would be dropped. Use Trainer(pipelined=True), or "
          "flush() the pipelined state and re-init.")
