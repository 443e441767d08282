"""Full-ranking evaluation: every item scored for every user.

The item vectors come from the table as the collection holds it
(`collection.table_arrays`) through the encoder's item tower; a user's
vector is the encoder's last position over the history it is given. Scores
are normalised dot products; the history fed to the model is filtered from
the ranking (the HSTU code's `filter_invalid_ids`), and the metrics are
`pallas_emb.datasets.ranking_metrics` of the targets' ranks. The ranks are
counted on the device (`device_ranks`, the rule of
`pallas_emb.datasets.target_ranks`): only `[B]` ranks come back to the
host, not `[B, V]` scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from examples.seqrec import model as model_lib
from pallas_emb import datasets

KS = (10, 50, 200)


def device_ranks(scores: jax.Array, targets: jax.Array,
                 exclude: jax.Array) -> jax.Array:
  """int32 `[B]`: `datasets.target_ranks(scores, targets, exclude)` in jnp.

  1 + the count of items other than the target, the padding id 0 and the
  ids in `exclude` `[B, L]` scoring at least the target's score. The
  inputs are not checked (the caller checks the targets on the host).
  """
  batch, vocab = scores.shape
  rows = jnp.arange(batch)[:, None]
  valid = jnp.ones((batch, vocab), bool).at[rows, exclude].set(False)
  column = jnp.arange(vocab)[None, :]
  valid &= (column != 0) & (column != targets[:, None])
  own = jnp.take_along_axis(scores, targets[:, None], axis=1)
  return 1 + jnp.sum((scores >= own) & valid, axis=1, dtype=jnp.int32)


class RankingEvaluator:
  """`(state, history, targets, times) -> metrics` of a trainer's state."""

  def __init__(self, trainer, encoder: model_lib.Encoder,  # or hstu.HSTU
               item_rows: np.ndarray, batch_size: int):
    self.trainer = trainer
    # Users shard over the devices like the training batches.
    self._sharding = trainer.collection.token_sharding()
    multiple = trainer.collection.mesh.size
    self.batch_size = -(-batch_size // multiple) * multiple
    item_rows = np.asarray(item_rows)
    (table_name,) = trainer.collection.tables

    def scores(state, history, times):
      table = trainer.collection.table_arrays(state.embedding)[table_name]
      variables = {"params": state.dense_params["encoder"]}
      vecs = encoder.apply(variables, table[item_rows], method="items")
      user = encoder.apply(variables, vecs[history], history != 0,
                           times=times)
      user = model_lib.l2_normalize(user[:, -1].astype(jnp.float32))
      return user @ model_lib.l2_normalize(vecs).T

    self.scores = jax.jit(scores)
    self._ranks = jax.jit(lambda state, history, times, targets: device_ranks(
        scores(state, history, times), targets, history))

  def _padded(self, rows: np.ndarray) -> jax.Array:
    full = np.zeros((self.batch_size,) + rows.shape[1:], rows.dtype)
    full[:rows.shape[0]] = rows
    return jax.device_put(full, self._sharding)

  def ranks(self, state, history: np.ndarray, targets: np.ndarray,
            times: np.ndarray) -> np.ndarray:
    """int64 `[U]` 1-based ranks of the targets (history filtered);
    times: `[U, L + 1]`, the history's and the targets' timestamps.

    Raises datasets.DataError for a target that is padding or is in its
    own history (it could not be ranked).
    """
    history, targets = np.asarray(history), np.asarray(targets)
    bad = (targets < 1) | (history == targets[:, None]).any(axis=1)
    if bad.any():
      user = int(np.flatnonzero(bad)[0])
      raise datasets.DataError(
          f"seqrec evaluation: target {int(targets[user])} of row {user} is "
          "padding or in the history that is filtered from the ranking; "
          "expected a rankable item; drop it from the filter or the rows.")
    out = []
    size = self.batch_size
    for start in range(0, history.shape[0], size):
      part = slice(start, start + size)
      real = history[part].shape[0]
      out.append(self._ranks(state, self._padded(history[part]),
                             self._padded(times[part]),
                             self._padded(targets[part]))[:real])
    return np.concatenate(jax.device_get(out)).astype(np.int64)

  def __call__(self, state, history: np.ndarray, targets: np.ndarray,
               times: np.ndarray, subset: np.ndarray | None = None
               ) -> dict[str, float] | tuple[dict[str, float], ...]:
    """Metrics of the state with its staged update applied; with `subset`
    (bool `[U]`) also those of the subset's users: (all, subset)."""
    if self.trainer.pipelined:
      state, _ = self.trainer.flush(state)
    ranks = self.ranks(state, history, targets, times)
    metrics = datasets.ranking_metrics(ranks, ks=KS)
    if subset is None:
      return metrics
    return metrics, datasets.ranking_metrics(ranks[subset], ks=KS)
