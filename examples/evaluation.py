"""Evaluation: the eval-set MSE of a state, batch by batch, and its curve."""

from __future__ import annotations

import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from examples.build import Run
from pallas_emb import datasets


def eval_batches(dataset: datasets.Dataset, batch_size: int, multiple: int
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Every example once, in order, in batches of any size.

  Batches of `batch_size` (rounded up to a multiple of `multiple`, the
  device count, which the collection's batches must divide by) and a
  shorter last one, padded with id 0, label 0 and weight 0 only up to a
  multiple of `multiple` (not to `batch_size`: the collection reads the
  batch size per call). Yields {feature: int32[B], "label", "weight"}.
  """
  size = -(-batch_size // multiple) * multiple
  n = dataset.num_examples
  columns = dict(dataset.features, **{datasets.LABEL_KEY: dataset.labels})
  for start in range(0, n, size):
    real = min(size, n - start)
    padded = -(-real // multiple) * multiple
    out = {}
    for key, values in columns.items():
      out[key] = np.full(padded, datasets.PAD_ID, values.dtype)
      out[key][:real] = values[start:start + real]
    out[datasets.WEIGHT_KEY] = (np.arange(padded) < real).astype(np.float32)
    yield out


class Evaluator:
  """Eval-set MSE of a state (weighted over `eval_batches`); keeps the curve.

  The eval set is the test split, or the validation split when tuning.
  """

  def __init__(self, run: Run):
    self.run = run
    self.seconds = 0.0  # spent evaluating, left out of the training time
    self.curve: list[tuple[int, float]] = []  # (step, eval MSE)
    trainer, rating_range = run.trainer, run.rating_range
    # FlaxTrainer.flush is jitted (not donating): one compilation serves
    # every evaluation and the last update in finish.
    self._flush = trainer.flush

    @jax.jit
    def squared_error(state, batch):
      pred = trainer.apply(state, batch)["pred"]
      if rating_range is not None:
        pred = jnp.clip(pred, *rating_range)
      weight = batch[datasets.WEIGHT_KEY]
      return (jnp.sum(weight * (pred - batch[datasets.LABEL_KEY]) ** 2),
              jnp.sum(weight))
    self._squared_error = squared_error

  def __call__(self, state) -> float:
    t0 = time.perf_counter()
    if self.run.config.pipelined:  # Evaluate with the staged update applied.
      state, _ = self._flush(state)
    sq, count = 0.0, 0.0
    for batch in eval_batches(self.run.data.evaluate,
                              self.run.eval_batch_size, self.run.mesh.size):
      s, c = self._squared_error(state, self.run.batch(batch))
      sq, count = sq + float(s), count + float(c)
    self.seconds += time.perf_counter() - t0
    return sq / count

  def record(self, step: int, state) -> float:
    """Evaluates and appends (step, eval MSE) to the curve."""
    self.curve.append((step, self(state)))
    return self.curve[-1][1]
