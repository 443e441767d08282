"""The pipelined (one-step-stale) train step (DESIGN §6).

In step t the dense model runs forward and backward on embeddings that were
looked up in step t-1, while the embedding update staged in step t-1 is
applied; the lookup of batch t+1 is issued after that update, so it overlaps
the dense backward, and batch t's embedding gradients are staged for step
t+1. The result equals, bit for bit, a synchronous loop that applies each
step's embedding gradients one step late (`late_step` below is that loop).

Everything the step carries is one explicit pytree, `PipelineState`, donated
from step to step; `Trainer(pipelined=False)` is the plain synchronous step
with the same interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from pallas_emb.dedup import dedup
from pallas_emb.dedup import DedupResult
from pallas_emb.exchange import replicated_sharding
from pallas_emb.lookup import lookup
from pallas_emb import optim
from pallas_emb.errors import PipelineMisuse
from pallas_emb.validation import EmbeddingContext

LossFn = Callable[[Any, Mapping[str, jax.Array], Mapping[str, jax.Array]],
                  tuple[jax.Array, Any]]


def _replicated_false(ctx: EmbeddingContext) -> jax.Array:
  return jax.device_put(jnp.asarray(False), replicated_sharding(ctx))


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One sharded table: its layout, optimizer and the batch key of its ids."""
  ctx: EmbeddingContext
  optimizer: optim.RowwiseAdagrad
  feature: str


class Prefetched(NamedTuple):
  """Embeddings of the next batch, looked up a step early, and its dedup."""
  embeddings: jax.Array
  dedup: DedupResult


class Staged(NamedTuple):
  """A batch's embedding gradients waiting to be applied next step."""
  emb_grads: jax.Array
  dedup: DedupResult
  pending: jax.Array  # bool scalar; False for the no-op first update


class TableState(NamedTuple):
  table: jax.Array
  opt_state: optim.RowwiseAdagradState


class PipelineState(NamedTuple):
  """Everything a step carries; donate it to the next step.

  prefetched and staged are None in synchronous mode.
  """
  tables: dict[str, TableState]
  dense_params: Any
  dense_opt_state: Any
  prefetched: dict[str, Prefetched] | None
  staged: dict[str, Staged] | None


class StepMetrics(NamedTuple):
  loss: jax.Array
  aux: Any
  updates: dict[str, optim.UpdateStats]


@dataclasses.dataclass(frozen=True, eq=False)
class Trainer:
  """Trains sharded tables with the fused sparse update, dense params with optax.

  Args:
    tables: name -> TableSpec; `loss_fn` receives `{name: embeddings}`.
    loss_fn: `(dense_params, embeddings, batch) -> (loss, aux)`.
    dense_optimizer: any optax GradientTransformation for dense_params.
    pipelined: one-step-stale pipelined step (True) or synchronous (False).
    backend: kernel backend (None: the platform default).
  """
  tables: Mapping[str, TableSpec]
  loss_fn: LossFn
  dense_optimizer: Any
  pipelined: bool = True
  backend: str | None = None

  # --- pieces ---------------------------------------------------------------

  def _prefetch(self, tables, batch) -> dict[str, Prefetched]:
    out = {}
    for name, spec in self.tables.items():
      table = tables[name].table
      ids = batch[spec.feature]
      out[name] = Prefetched(
          lookup(spec.ctx, table, ids, backend=self.backend),
          dedup(spec.ctx, ids, vocab_rows=table.shape[0]))
    return out

  def _apply(self, tables, staged: Mapping[str, Staged]):
    new_tables, stats = {}, {}
    for name, spec in self.tables.items():
      entry = staged[name]
      table, opt_state, stats[name] = optim.apply_gradients(
          spec.ctx, spec.optimizer, tables[name].table,
          tables[name].opt_state, entry.emb_grads, entry.dedup,
          pending=entry.pending, backend=self.backend)
      new_tables[name] = TableState(table, opt_state)
    return new_tables, stats

  def _dense(self, params, opt_state, embeddings, batch):
    grad_fn = jax.value_and_grad(self.loss_fn, argnums=(0, 1), has_aux=True)
    (loss, aux), (dense_grads, emb_grads) = grad_fn(params, embeddings, batch)
    updates, opt_state = self.dense_optimizer.update(dense_grads, opt_state,
                                                     params)
    params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)
    return loss, aux, params, opt_state, emb_grads

  # --- public ---------------------------------------------------------------

  def init(self, tables: Mapping[str, jax.Array], dense_params,
           first_batch=None) -> PipelineState:
    """The initial state; pipelined mode issues the first batch's lookup."""
    self._check_names(tables, "tables")
    table_states = {
        name: TableState(tables[name], spec.optimizer.init(spec.ctx,
                                                           tables[name]))
        for name, spec in self.tables.items()}
    dense_opt_state = self.dense_optimizer.init(dense_params)
    if not self.pipelined:
      return PipelineState(table_states, dense_params, dense_opt_state, None,
                           None)
    if first_batch is None:
      raise PipelineMisuse(
          "pallas_emb pipelined Trainer.init needs first_batch: the first "
          "lookup is issued at init so step 0 has embeddings to consume.")
    prefetched = self._prefetch(table_states, first_batch)
    # The first update is a no-op: zero gradients, pending False. Its dedup
    # is a copy: a donated pytree must not hold one buffer twice.
    # Placed like the step's outputs, so step 1 does not compile again.
    staged = {name: Staged(jnp.zeros_like(p.embeddings),
                           jax.tree.map(jnp.copy, p.dedup),
                           _replicated_false(self.tables[name].ctx))
              for name, p in prefetched.items()}
    return PipelineState(table_states, dense_params, dense_opt_state,
                         prefetched, staged)

  def step(self, state: PipelineState, batch, next_batch=None):
    """One step on `batch`; pipelined mode also prefetches `next_batch`.

    Returns `(state, StepMetrics)`. Jit it with `donate_argnums=0`.
    """
    self._check_state(state, next_batch)
    if not self.pipelined:
      looked_up = self._prefetch(state.tables, batch)
      embeddings = {n: p.embeddings for n, p in looked_up.items()}
      loss, aux, params, dense_opt, emb_grads = self._dense(
          state.dense_params, state.dense_opt_state, embeddings, batch)
      tables, stats = self._apply(state.tables, {
          n: Staged(emb_grads[n], looked_up[n].dedup, jnp.asarray(True))
          for n in self.tables})
      return (PipelineState(tables, params, dense_opt, None, None),
              StepMetrics(loss, aux, stats))

    # (a) apply the update staged in step t-1 while the dense model runs on
    # the embeddings prefetched in step t-1: independent, so XLA overlaps them.
    tables, stats = self._apply(state.tables, state.staged)
    embeddings = {n: p.embeddings for n, p in state.prefetched.items()}
    loss, aux, params, dense_opt, emb_grads = self._dense(
        state.dense_params, state.dense_opt_state, embeddings, batch)
    # (b) the lookup of batch t+1 reads the updated tables; it depends on
    # nothing of the backward, so it overlaps it.
    prefetched = self._prefetch(tables, next_batch)
    # (c) stage batch t's gradients for step t+1.
    staged = {n: Staged(emb_grads[n], state.prefetched[n].dedup,
                        jnp.asarray(True)) for n in self.tables}
    return (PipelineState(tables, params, dense_opt, prefetched, staged),
            StepMetrics(loss, aux, stats))

  def flush(self, state: PipelineState) -> tuple[PipelineState, dict]:
    """Applies the last staged update (end of training, before eval/saving)."""
    if not self.pipelined:
      return state, {}
    self._check_state(state, None, need_next=False)
    tables, stats = self._apply(state.tables, state.staged)
    staged = {n: s._replace(pending=_replicated_false(self.tables[n].ctx))
              for n, s in state.staged.items()}
    return state._replace(tables=tables, staged=staged), stats

  # --- checks ---------------------------------------------------------------

  def _check_names(self, mapping, what):
    if set(mapping) != set(self.tables):
      raise PipelineMisuse(
          f"pallas_emb Trainer got {what} for {sorted(mapping)}; expected "
          f"exactly the tables {sorted(self.tables)}.")

  def _check_state(self, state, next_batch, need_next=True):
    if not isinstance(state, PipelineState):
      raise PipelineMisuse(
          f"pallas_emb Trainer.step got a {type(state).__name__}; expected "
          "the PipelineState that Trainer.init returns.")
    self._check_names(state.tables, "state.tables")
    if self.pipelined:
      if state.prefetched is None or state.staged is None:
        raise PipelineMisuse(
            "pallas_emb pipelined step was given a state with nothing "
            "prefetched or staged (a synchronous Trainer's state?); create it "
            "with Trainer(pipelined=True).init(tables, params, first_batch).")
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
