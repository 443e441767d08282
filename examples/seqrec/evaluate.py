"""Full-ranking evaluation: every item scored for every user.

The item vectors come from the table as the collection holds it
(`collection.table_arrays`) through the encoder's item tower; a user's
vector is the encoder's last position over the history it is given. Scores
are normalised dot products; the history fed to the model is filtered from
the ranking (the HSTU code's `filter_invalid_ids`), and the metrics are
`pallas_emb.datasets.ranking_metrics` of the targets' ranks.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from examples.seqrec import model as model_lib
from pallas_emb import datasets

KS = (10, 50, 200)


class RankingEvaluator:
  """`(state, history, targets, times) -> metrics` of a trainer's state."""

  def __init__(self, trainer, encoder: model_lib.Encoder,  # or hstu.HSTU
               item_rows: np.ndarray, batch_size: int):
    self.trainer = trainer
    # Users shard over the devices like the training batches.
    self._sharding = trainer.collection.token_sharding()
    multiple = trainer.collection.mesh.size
    self.seconds = 0.0  # spent evaluating, left out of the training time
    self.batch_size = -(-batch_size // multiple) * multiple
    item_rows = np.asarray(item_rows)
    (table_name,) = trainer.collection.tables

    @jax.jit
    def scores(state, history, times):
      table = trainer.collection.table_arrays(state.embedding)[table_name]
      variables = {"params": state.dense_params["encoder"]}
      vecs = encoder.apply(variables, table[item_rows], method="items")
      user = encoder.apply(variables, vecs[history], history != 0,
                           times=times)
      user = model_lib.l2_normalize(user[:, -1])
      return user @ model_lib.l2_normalize(vecs).T

    self._scores = scores

  def ranks(self, state, history: np.ndarray, targets: np.ndarray,
            times: np.ndarray) -> np.ndarray:
    """int64 `[U]` 1-based ranks of the targets (history filtered);
    times: `[U, L + 1]`, the history's and the targets' timestamps."""
    out = []
    size = self.batch_size

    def padded(rows):
      full = np.zeros((size,) + rows.shape[1:], rows.dtype)
      full[:rows.shape[0]] = rows
      return jax.device_put(full, self._sharding)

    for start in range(0, history.shape[0], size):
      part = history[start:start + size]
      real = part.shape[0]
      scores = np.asarray(self._scores(
          state, padded(part), padded(times[start:start + size])))[:real]
      out.append(datasets.target_ranks(scores, targets[start:start + real],
                                       exclude=part))
    return np.concatenate(out)

  def __call__(self, state, history: np.ndarray, targets: np.ndarray,
               times: np.ndarray) -> dict[str, float]:
    """Metrics of the state with its staged update applied."""
    t0 = time.perf_counter()
    if self.trainer.pipelined:
      state, _ = self.trainer.flush(state)
    metrics = datasets.ranking_metrics(
        self.ranks(state, history, targets, times), ks=KS)
    self.seconds += time.perf_counter() - t0
    return metrics
