"""Start of a run: fresh parameters, or resume from the latest checkpoint."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterator

import jax
import numpy as np

from examples.build import Run
import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import datasets


def checkpoint_extra(state: pe.PipelineState, step: int, embeddings):
  """What a checkpoint stores besides the collection's logical tables.

  `embeddings` are the embeddings the next step consumes (see
  `next_embeddings`): with them a pipelined run resumes exactly.
  """
  return {"dense_params": state.dense_params,
          "dense_opt_state": state.dense_opt_state, "step": step,
          "next_embeddings": embeddings}


def next_embeddings(run: Run, state: pe.PipelineState, next_batch):
  """The embeddings of `next_batch` that the next step would consume.

  Pipelined: the state's prefetched lookup, read from the tables before
  the last staged update (which a checkpoint holds applied); synchronous:
  a lookup from the state's tables.
  """
  if run.config.pipelined:
    return state.prefetched.embeddings
  return jax.jit(run.collection.lookup)(state.embedding, next_batch)


def restore(run: Run, state: pe.PipelineState, saved: int, first_batch):
  """(state, step) of checkpoint `saved` in config.checkpoint_dir.

  Restored onto `state`'s layout. A pipelined state consumes the saved
  next_embeddings first, as the uninterrupted run would have (nothing is
  staged: the checkpoint's tables hold the last update), so resuming gives
  the same result as not stopping.
  """
  template = checkpoint_extra(state, 0,
                              next_embeddings(run, state, first_batch))
  embedding, extra = checkpoint.restore_collection(
      run.config.checkpoint_dir, run.collection, step=saved, extra=template)
  fresh = run.trainer.init_from(
      embedding, extra["dense_params"],
      first_batch if run.config.pipelined else None)
  fresh = fresh._replace(dense_opt_state=extra["dense_opt_state"])
  if run.config.pipelined:
    fresh = fresh._replace(prefetched=fresh.prefetched._replace(
        embeddings=extra["next_embeddings"]))
  return fresh, int(extra["step"])


@dataclasses.dataclass
class Start:
  """Where the loop starts: the state, the batch stream and its next batch."""
  state: pe.PipelineState
  stream: Iterator[dict[str, np.ndarray]]
  current: dict[str, jax.Array]
  step: int


def initial_state(run: Run, log: Callable[[str], None]) -> Start:
  """Fresh parameters, or the latest checkpoint in config.checkpoint_dir.

  On resume the batch stream continues where the checkpointed run stopped.
  """
  config, trainer = run.config, run.trainer
  stream = datasets.batches(run.train, config.batch_size, seed=config.seed)
  saved = (checkpoint.latest_step(config.checkpoint_dir)
           if config.checkpoint_dir else None)
  if saved is not None:
    stream = itertools.islice(stream, saved, None)
  current = run.batch(next(stream))
  params = jax.jit(run.model.init)(jax.random.key(config.seed),
                                   current)["params"]
  state = trainer.init(params, current if config.pipelined else None)
  del params
  start = 0
  if saved is not None:
    state, start = restore(run, state, saved, current)
    log(f"resumed from {config.checkpoint_dir} at step {start}")
  return Start(state, stream, current, start)
