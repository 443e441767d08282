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


# --- the feature model (configs/movielens_features.py) -----------------------

ID_TABLES = {"user": "users", "item": "items"}
# The implicit bag's table: shared with the item ids, or its own (SVD++ y_j).
IMPLICIT_TABLES = {"items": "items", "implicit": "implicit_items"}
# Combiners of the side bags (the implicit bag is sqrtn, as SVD++).
SIDE_COMBINERS = {"genres": "mean", "title": "sqrtn"}


def feature_collection(mesh: jax.sharding.Mesh, *, vocab_sizes: dict[str, int],
                       entity_features, side_vocab_sizes: dict[str, int],
                       emb_width: int, side_width: int, id_optimizer,
                       side_optimizer, implicit_optimizer, init_scale: float,
                       dtype=jnp.float32,
                       backend: str | None = None) -> pe.EmbeddingCollection:
  """The feature model's tables and features.

  The id tables "users" and "items" (width `emb_width`, the last column the
  bias) read by "user" and "item"; the implicit bag's table ("items"
  itself, or "implicit_items" with `implicit_optimizer`, width
  `emb_width`); one table per side feature (width `side_width`, rows
  `side_vocab_sizes`). `entity_features` (features.EntityFeature) say which
  batch keys read which table; the buckets of a bag all read its table.
  Id 0 is padding everywhere. Tables of one width and optimizer share a
  stack (one exchange per step).
  """
  init = _factor_init(init_scale)

  def id_table(name, vocab, optimizer):
    return pe.TableSpec(name, vocab, emb_width, optimizer=optimizer,
                        dtype=dtype, initializer=init, padding_id=0)

  tables = [id_table(ID_TABLES[f], vocab_sizes[f], id_optimizer)
            for f in FEATURES]
  features = [pe.FeatureSpec(f, ID_TABLES[f]) for f in FEATURES]
  for feature in entity_features:
    if feature.table == IMPLICIT_TABLES["implicit"]:
      tables.append(id_table(feature.table, vocab_sizes["item"],
                             implicit_optimizer))
    elif feature.table in side_vocab_sizes:
      tables.append(pe.TableSpec(
          feature.table, side_vocab_sizes[feature.table], side_width,
          optimizer=side_optimizer, dtype=dtype, padding_id=0))
    features += [pe.FeatureSpec(part, feature.table,
                                combiner=feature.combiner)
                 for part in feature.parts]
  return pe.EmbeddingCollection(tables, features, mesh, "x", backend=backend)


def _per_example(emb, batch, feature, sharding) -> jax.Array:
  """An entity feature's embeddings for each example of the batch.

  The rows of its (bucketed) entity features, indexed by the examples'
  user or item ids (through the bag's row index). The rows are pinned to
  the collection's token `sharding`, so their gradients (which the
  pipelined Trainer stages in its state) keep the lookup's layout and the
  second step does not compile again.
  """
  rows = batch[feature.side]
  parts = [jax.lax.with_sharding_constraint(emb[part], sharding)
           for part in feature.parts]
  if feature.index is None:
    return jnp.take(parts[0], rows, axis=0)
  return jnp.take(jnp.concatenate(parts),
                  jnp.take(batch[feature.index], rows), axis=0)


class FeatureMF(nn.Module):
  """Biased MF whose user and item vectors also sum their features.

    user = p_u + |N(u)|^-1/2 sum_{j in N(u)} y_j + W_u s_u
    item = q_i + W_i s_i
    pred = mu + b_u + b_i + w_u . s_u + w_i . s_i + <user, item>

  p, q, b (the last column) from the id tables; y_j the implicit bag's rows
  (the items table itself when shared); s_u, s_i the concatenated side
  embeddings, mapped by dense layers (zero-initialised) to the factors and
  a bias. The side features and the bag are pooled per user / item
  (examples/features.py) and indexed by the examples' ids; the bag's y_j
  are regularised by their optimizer's weight decay. Returns
  {"pred": [B], "l2": [B]}, where "l2" is the weighted penalty:
  l2 * (|u row|^2 + |i row|^2) + side_l2 * (|W_u s_u, w_u . s_u|^2 +
  |W_i s_i, w_i . s_i|^2).
  """
  collection: pe.EmbeddingCollection
  side_features: dict  # {"user": EntityFeatures, "item": EntityFeatures}
  implicit: Any = None  # the implicit bag's EntityFeature, or None
  l2: float = 0.0
  side_l2: float = 0.0
  mean: float = 0.0

  @nn.compact
  def __call__(self, batch):
    emb = pe_flax.EmbeddingCollection(self.collection, name="embed")(batch)
    emb = {k: v.astype(jnp.float32) for k, v in emb.items()}
    sharding = self.collection.token_sharding()
    rows = {side: emb[side] for side in FEATURES}
    vecs = {side: row[:, :-1] for side, row in rows.items()}
    mu = self.param("mu", nn.initializers.constant(self.mean), (),
                    jnp.float32)
    bias = mu + rows["user"][:, -1] + rows["item"][:, -1]
    penalty = self.l2 * sum(jnp.sum(r * r, axis=-1) for r in rows.values())
    if self.implicit is not None:
      pooled = _per_example(emb, batch, self.implicit, sharding)
      vecs["user"] = vecs["user"] + pooled[:, :-1]
    for side, features in self.side_features.items():
      if not features:
        continue
      s = jnp.concatenate(
          [_per_example(emb, batch, f, sharding) for f in features], axis=-1)
      out = nn.Dense(vecs[side].shape[-1] + 1, use_bias=False,
                     kernel_init=nn.initializers.zeros,
                     name=f"{side}_side")(s)
      vecs[side] = vecs[side] + out[:, :-1]
      bias = bias + out[:, -1]
      penalty += self.side_l2 * jnp.sum(out * out, axis=-1)
    pred = bias + jnp.sum(vecs["user"] * vecs["item"], axis=-1)
    return {"pred": pred, "l2": penalty}
