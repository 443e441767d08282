"""The example's model: biased matrix factorisation over two sharded tables.

`pred = mu + <p_u, q_i> + b_u + b_i`, where the bias of each row is its last
column (so no width-1 table is needed). The tables are
`pallas_emb.flax.Embed` layers, column-sharded like their contexts say.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_emb as pe
from pallas_emb import datasets
from pallas_emb import flax as pe_flax

FEATURES = ("user", "item")
TABLE_KEYS = {"user": "user_embed", "item": "item_embed"}


def _factor_init(scale: float):
  """Normal(0, scale) factor columns; the last (bias) column starts at 0."""
  def init(key, shape, dtype=jnp.float32):
    x = jax.random.normal(key, shape, jnp.float32) * scale
    return x.at[:, -1].set(0.0).astype(dtype)
  return init


class BiasedMF(nn.Module):
  """pred = mu + <p_u, q_i> + b_u + b_i; b_* is the last column of each row.

  Returns {"pred": [B], "l2": [B] squared norm of the two looked-up rows}.
  """
  vocab_sizes: dict[str, int]
  contexts: dict[str, pe.EmbeddingContext]
  emb_width: int
  param_dtype: Any = jnp.float32
  init_scale: float = 0.1
  mean: float = 0.0

  @nn.compact
  def __call__(self, batch):
    rows = {}
    for feature in FEATURES:
      rows[feature] = pe_flax.Embed(
          self.vocab_sizes[feature], self.emb_width, self.contexts[feature],
          param_dtype=self.param_dtype,
          embedding_init=_factor_init(self.init_scale), padding_id=0,
          name=TABLE_KEYS[feature])(batch[feature]).astype(jnp.float32)
    mu = self.param("mu", nn.initializers.constant(self.mean), (),
                    jnp.float32)
    u, v = rows["user"], rows["item"]
    pred = (mu + jnp.sum(u[:, :-1] * v[:, :-1], axis=-1) + u[:, -1] +
            v[:, -1])
    l2 = jnp.sum(u * u, axis=-1) + jnp.sum(v * v, axis=-1)
    return {"pred": pred, "l2": l2}


def make_loss(l2: float) -> Callable:
  """MSE (+ l2 * mean squared norm of the looked-up rows); aux {"mse"}."""
  def loss(outputs, batch):
    mse = jnp.mean((outputs["pred"] - batch[datasets.LABEL_KEY]) ** 2)
    total = mse + l2 * jnp.mean(outputs["l2"]) if l2 else mse
    return total, {"mse": mse}
  return loss
