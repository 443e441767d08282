"""Train a Flax model's `pallas_emb.flax.Embed` tables with the sparse step.

`FlaxTrainer` wraps a linen model whose embedding tables are
`pallas_emb.flax.Embed` modules. Their tables are trained with the fused
sparse `RowwiseAdagrad` through `pallas_emb.Trainer` (pipelined one step
stale, or synchronous), every other param with any optax transformation; no
dense table gradient is ever built::

    trainer = FlaxTrainer(
        model,
        tables={"user_embed": pe.TableSpec(ctx, pe.RowwiseAdagrad(0.1),
                                           "user")},
        loss=lambda outputs, batch: (jnp.mean((outputs - batch["y"]) ** 2), {}),
        dense_optimizer=optax.adam(1e-3))
    state = trainer.init(params, first_batch)        # params from model.init
    step = jax.jit(trainer.step, donate_argnums=0)
    state, metrics = step(state, batch, next_batch)  # next: pipelined only
    state, _ = trainer.flush(state)                  # pipelined: last update
    outputs = jax.jit(trainer.apply)(state, batch)   # eval forward
    params = trainer.params(state)                   # a plain flax params tree

The contract:
  * `tables` maps an Embed's module path (`"/".join(module.path)`, e.g.
    `"user_embed"` or `"tower/user_embed"`) to a `pallas_emb.TableSpec(ctx,
    optimizer, feature)`. The ids that Embed is called with must be exactly
    `batch[feature]` (same values, same shape): the Trainer looks the table
    up from `batch[feature]` -- in pipelined mode one step early -- and the
    Embed call returns that lookup. The shape is checked; the values cannot
    be, so derive ids in the data pipeline, not inside the model.
  * Each listed Embed is called exactly once per forward pass, and every
    Embed the model calls is listed (both checked when tracing).
  * The model is called as `model.apply({"params": params}, batch)`; pass
    `apply_fn(variables, batch)` to call it differently. Only the "params"
    collection is supported (no mutable state, no rngs).
  * `loss(outputs, batch) -> (loss, aux)` (or just `loss`).

On XLA:CPU with several simulated devices, wait for each step (e.g.
`jax.block_until_ready(metrics.loss)`) before dispatching the next: many
queued steps can deadlock the in-process collectives (see pallas_emb/train.py).

How: the params are split into the tables (each listed Embed's `embedding`
leaf) and the dense rest; the model runs on the dense rest under
`flax.linen.intercept_methods`, which skips each listed Embed's `setup` (so
the missing table is never created or read) and answers its `__call__` with
the embeddings the Trainer looked up.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp

from pallas_emb import exchange
from pallas_emb import pipeline
from pallas_emb.layers.flax import Embed
from pallas_emb.lookup import lookup
from pallas_emb.pipeline import PipelineState
from pallas_emb.pipeline import TableSpec

PARAM = "embedding"


def module_key(module: nn.Module) -> str:
  """The key of a module in `tables`: its path joined with "/"."""
  return "/".join(str(p) for p in module.path)


def _flat_params(params) -> dict[tuple[str, ...], Any]:
  if isinstance(params, Mapping) and set(params) == {"params"}:
    params = params["params"]  # accept the whole variables dict too
  return traverse_util.flatten_dict(nn.unbox(dict(params)))


class FlaxTrainer:
  """Sparse-trained Embed tables + optax-trained dense params of a linen model.

  Args:
    model: the linen module.
    tables: Embed module path -> `TableSpec(ctx, optimizer, feature)`; see
      the module docstring for the contract.
    loss: `(outputs, batch) -> (loss, aux)` or `-> loss`.
    dense_optimizer: any optax GradientTransformation for the other params.
    pipelined: the one-step-stale pipelined step (True) or synchronous.
    backend: kernel backend for lookups and updates (None: platform default).
    apply_fn: `(variables, batch) -> outputs`; default
      `model.apply(variables, batch)`.
  """

  def __init__(self, model: nn.Module, tables: Mapping[str, TableSpec],
               loss: Callable[..., Any], dense_optimizer, *,
               pipelined: bool = True, backend: str | None = None,
               apply_fn: Callable[[Any, Any], Any] | None = None):
    if not tables:
      raise ValueError("pallas_emb FlaxTrainer needs at least one table: "
                       "tables={'<Embed module path>': TableSpec(...)}.")
    for key, spec in tables.items():
      if not isinstance(spec, TableSpec):
        raise TypeError(
            f"pallas_emb FlaxTrainer tables[{key!r}] is a "
            f"{type(spec).__name__}; expected pallas_emb.TableSpec(ctx, "
            "optimizer, feature).")
    self.model = model
    self.tables = dict(tables)
    self.loss = loss
    self.apply_fn = apply_fn or (lambda variables, batch: model.apply(
        variables, batch))
    self.backend = backend
    self.trainer = pipeline.Trainer(self.tables, self._loss_fn,
                                    dense_optimizer, pipelined=pipelined,
                                    backend=backend)
    # Jitted: eager shard_maps would compile op by op (seconds each).
    self._init = jax.jit(self._init_fn)
    self._flush = jax.jit(self.trainer.flush)

  @property
  def pipelined(self) -> bool:
    return self.trainer.pipelined

  # --- params ---------------------------------------------------------------

  def split(self, params) -> tuple[dict[str, jax.Array], Any]:
    """`(tables, dense_params)` of a model's params (boxed or not).

    Tables are placed column-sharded (a no-op for Embed-initialized ones).
    """
    flat = _flat_params(params)
    tables = {}
    for key, spec in self.tables.items():
      path = tuple(key.split("/")) + (PARAM,)
      if path not in flat:
        have = sorted("/".join(p[:-1]) for p in flat if p[-1] == PARAM)
        raise KeyError(
            f"pallas_emb FlaxTrainer table {key!r}: params have no "
            f"{'/'.join(path)!r}. Embed params found at {have}; key tables "
            "by the Embed's module path ('/'-joined).")
      table = flat.pop(path)
      if table.ndim != 2 or table.shape[1] != spec.ctx.emb_width:
        raise ValueError(
            f"pallas_emb FlaxTrainer table {key!r} has shape {table.shape}; "
            f"its TableSpec's context has emb_width={spec.ctx.emb_width}.")
      tables[key] = jax.device_put(table, exchange.table_sharding(spec.ctx))
    return tables, traverse_util.unflatten_dict(flat)

  def params(self, state: PipelineState):
    """The flax params tree (unboxed) of a state: dense params + tables.

    In pipelined mode, `flush` first so the last update is in the tables.
    """
    flat = traverse_util.flatten_dict(dict(state.dense_params))
    for key, table_state in state.tables.items():
      flat[tuple(key.split("/")) + (PARAM,)] = table_state.table
    return traverse_util.unflatten_dict(flat)

  # --- the model with looked-up embeddings ------------------------------------

  def _run(self, dense_params, embeddings, batch):
    seen = set()

    def interceptor(next_fun, args, kwargs, context):
      module = context.module
      if not isinstance(module, Embed):
        return next_fun(*args, **kwargs)
      key = module_key(module)
      if key not in self.tables:
        raise KeyError(
            f"pallas_emb FlaxTrainer: the model calls a pallas_emb.flax.Embed "
            f"at {key!r}, which is not in tables {sorted(self.tables)}; add "
            "it (tables={path: TableSpec(ctx, optimizer, feature)}).")
      if context.method_name == "setup":
        return None  # Would create/read the table param, which is not here.
      if context.method_name != "__call__":
        raise NotImplementedError(
            f"pallas_emb FlaxTrainer: Embed {key!r}.{context.method_name} "
            "reads the whole table; only __call__ is supported in training.")
      if key in seen:
        raise ValueError(
            f"pallas_emb FlaxTrainer: Embed {key!r} is called more than once "
            "in one forward pass; each sparse-trained table must be looked up "
            "once, from batch[feature]. Use one Embed per feature.")
      seen.add(key)
      spec = self.tables[key]
      ids = args[0] if args else kwargs["inputs"]
      expected = jnp.shape(batch[spec.feature])
      if jnp.shape(ids) != expected:
        raise ValueError(
            f"pallas_emb FlaxTrainer: Embed {key!r} was called with ids of "
            f"shape {jnp.shape(ids)}, but its table is looked up from "
            f"batch[{spec.feature!r}] of shape {expected}; the Embed must be "
            f"called with batch[{spec.feature!r}] itself.")
      out = embeddings[key]
      if module.dtype is not None:
        out = out.astype(module.dtype)
      return out

    with nn.intercept_methods(interceptor):
      outputs = self.apply_fn({"params": dense_params}, batch)
    unused = sorted(set(self.tables) - seen)
    if unused:
      raise ValueError(
          f"pallas_emb FlaxTrainer: tables {unused} were never called by the "
          "model; remove them from tables or call their Embed.")
    return outputs

  def _loss_fn(self, dense_params, embeddings, batch):
    result = self.loss(self._run(dense_params, embeddings, batch), batch)
    if isinstance(result, tuple):
      return result
    return result, None

  def apply(self, state: PipelineState, batch):
    """The model's outputs on `batch` with the state's tables (no update).

    Looks each table up from `batch[feature]`; jit it for evaluation. A
    pipelined state's tables lack the staged update: evaluate
    `flush(state)[0]` for the latest tables.
    """
    embeddings = {
        key: lookup(spec.ctx, state.tables[key].table, batch[spec.feature],
                    backend=self.backend)
        for key, spec in self.tables.items()}
    return self._run(state.dense_params, embeddings, batch)

  # --- the train step (pallas_emb.Trainer) ------------------------------------

  def _init_fn(self, tables, dense_params, first_batch):
    state = self.trainer.init(tables, dense_params, first_batch)
    if state.staged is None:
      return state
    # Under jit the staged zero gradients would come out replicated; pin
    # them to the token sharding the step returns, so step 2 does not
    # compile again.
    return state._replace(staged={
        key: staged._replace(emb_grads=exchange.place(
            staged.emb_grads, exchange.token_sharding(self.tables[key].ctx)))
        for key, staged in state.staged.items()})

  def init(self, params, first_batch=None) -> PipelineState:
    """The initial state from the model's params (pipelined: + first batch).

    The state may share buffers with `params`, and the step donates it:
    pass copies if you still need `params` afterwards.
    """
    tables, dense = self.split(params)
    return self.init_from(tables, dense, first_batch)

  def init_from(self, tables: Mapping[str, jax.Array], dense_params,
                first_batch=None) -> PipelineState:
    """`pallas_emb.Trainer.init` on tables and dense params already split."""
    return self._init(dict(tables), dense_params, first_batch)

  def step(self, state: PipelineState, batch, next_batch=None):
    """`pallas_emb.Trainer.step`: jit it with `donate_argnums=0`."""
    return self.trainer.step(state, batch, next_batch)

  def flush(self, state: PipelineState):
    """`pallas_emb.Trainer.flush`: apply the last staged update (jitted)."""
    return self._flush(state)
