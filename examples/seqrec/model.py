"""SASRec over one sparse-trained item table, and its sampled softmax loss.

`Encoder` holds every dense param: the item tower (the plain table's first
`dim` columns, or with hashed ids the two rows concatenated and projected
to `dim`), learned positions and the causal self-attention blocks of
SASRec as the HSTU repository writes them (pre-LN queries, residual from
the normalised queries, a point-wise FFN, a last LayerNorm); hstu.py's
`HSTU` subclasses it with HSTU's blocks instead. `SeqRec` is
what `FlaxTrainer` trains: one `pallas_emb.flax.EmbeddingCollection` looks
the history, the positive targets and the negatives up in the same table,
so all their gradients reach the sparse update; the encoder does the rest.
Evaluation (evaluate.py) calls the encoder alone on rows it gathers from
the table.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_emb import flax as pe_flax

# Batch keys: the table's features, the raw item ids, the dropout seed,
# the timestamps (`[B, L + 1]`: the history's and the next item's).
HISTORY, POSITIVES, NEGATIVES = "history", "positives", "negatives"
FEATURES = (HISTORY, POSITIVES, NEGATIVES)
POS_ITEMS, NEG_ITEMS, STEP, TIMES = "pos_items", "neg_items", "step", "times"
# A negative equal to the position's positive gets this logit (as HSTU).
_SAME_ITEM_LOGIT = -5e4


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  # Not x / max(norm(x), eps): the norm's gradient at a zero vector (a
  # padding position) is NaN, and 0 * NaN would poison the loss.
  squared = jnp.sum(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(squared, eps * eps))


def split_keys(key: jax.Array | None, count: int):
  """An iterator of `count` dropout keys (Nones for a deterministic pass)."""
  return iter(jax.random.split(key, count) if key is not None
              else [None] * count)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  if key is None or not rate:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


class Encoder(nn.Module):
  """Item tower + SASRec encoder; all of the model's dense params.

  Attributes:
    dim: model width d.
    max_len: positions (the history length).
    num_blocks, num_heads: the attention stack.
    dropout: rate of the input, attention and FFN dropouts.
    hashed: rows come as `[..., 2, W]` (two hashed ids per item).
  """
  dim: int
  max_len: int
  num_blocks: int = 2
  num_heads: int = 1
  dropout: float = 0.2
  hashed: bool = False

  def setup(self):
    self.setup_inputs(
        nn.initializers.truncated_normal(math.sqrt(1.0 / self.dim)))
    self.attn_norms = [nn.LayerNorm(epsilon=1e-8) for _ in
                       range(self.num_blocks)]
    self.attns = [nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dropout_rate=self.dropout)
                  for _ in range(self.num_blocks)]
    self.ffn_norms = [nn.LayerNorm(epsilon=1e-8) for _ in
                      range(self.num_blocks)]
    self.ffn_in = [nn.Dense(self.dim) for _ in range(self.num_blocks)]
    self.ffn_out = [nn.Dense(self.dim) for _ in range(self.num_blocks)]
    self.last_norm = nn.LayerNorm(epsilon=1e-8)

  def setup_inputs(self, position_init) -> None:
    """The item tower's projection and the learned positions (for setup)."""
    if self.hashed:
      self.item_proj = nn.Dense(self.dim, name="item_proj")
    self.positions = self.param("positions", position_init,
                                (self.max_len, self.dim))

  def embed(self, items: jax.Array, valid: jax.Array,
            key: jax.Array | None) -> jax.Array:
    """The encoder's input: scaled items + positions, dropout, 0 on padding
    (the HSTU repository's LearnablePositionalEmbeddingInputFeatures-
    Preprocessor; positions count back from the newest item)."""
    x = items * math.sqrt(self.dim) + self.positions[-items.shape[1]:]
    return dropout(x, self.dropout, key) * valid[..., None].astype(jnp.float32)

  def items(self, rows: jax.Array) -> jax.Array:
    """Item vectors `[..., dim]` from table rows (`[..., (2,) W]`)."""
    rows = rows.astype(jnp.float32)[..., :self.dim]
    if not self.hashed:
      return rows
    return self.item_proj(rows.reshape(rows.shape[:-2] + (2 * self.dim,)))

  def __call__(self, items: jax.Array, valid: jax.Array,
               key: jax.Array | None = None,
               times: jax.Array | None = None) -> jax.Array:
    """`[B, L, dim]` outputs (not normalised) at every position.

    items: `[B, L, dim]` history vectors, right-aligned (the newest at
    L - 1); valid: bool `[B, L]`, False on padding; key: dropout key, None
    for a deterministic pass (evaluation); times: `[B, L + 1]` timestamps
    (see hstu.HSTU), unused by SASRec.
    """
    del times
    keys = split_keys(key, 2 + 3 * self.num_blocks)

    def drop(x):
      return dropout(x, self.dropout, next(keys))

    mask = valid[..., None].astype(jnp.float32)
    x = self.embed(items, valid, next(keys))
    length = items.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    attn_mask = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, L, L]
    for i in range(self.num_blocks):
      q = self.attn_norms[i](x)
      k = next(keys)
      x = q + self.attns[i](q, x, x, mask=attn_mask,
                            deterministic=k is None, dropout_rng=k)
      x = self.ffn_norms[i](x)
      x = x + drop(self.ffn_out[i](drop(nn.relu(self.ffn_in[i](x)))))
      x = x * mask
    return self.last_norm(x)


class SeqRec(nn.Module):
  """The trained model: the collection's lookups through the encoder.

  Returns {"user": `[B, L, d]`, "pos": `[B, L, d]`, "neg": `[B, N, d]`},
  all L2-normalised.
  """
  collection: Any  # pallas_emb.EmbeddingCollection with FEATURES
  encoder: Encoder  # or hstu.HSTU
  seed: int = 0

  @nn.compact
  def __call__(self, batch):
    emb = pe_flax.EmbeddingCollection(self.collection, name="embed")(batch)
    enc = self.encoder  # an attribute module: params under "encoder"
    history = batch[HISTORY]
    valid = (history[..., 0] if enc.hashed else history) != 0
    # A fresh dropout key per step: FlaxTrainer passes no rngs.
    key = jax.random.fold_in(jax.random.key(self.seed), batch[STEP][0])
    user = enc(enc.items(emb[HISTORY]), valid, key, batch[TIMES])
    return {"user": l2_normalize(user),
            "pos": l2_normalize(enc.items(emb[POSITIVES])),
            "neg": l2_normalize(enc.items(emb[NEGATIVES]))}


def make_loss(temperature: float, positions_per_batch: float):
  """Sampled softmax over the non-padding positions; aux {"loss"}.

  Position t of example b scores its positive against the example's N
  negatives (shared by its positions); a negative equal to the positive is
  masked out. The sum over the batch's positions is divided by
  `positions_per_batch`, the expected count of a batch of random users
  (not the batch's own count): batches of users with short histories
  (length buckets) then do not weigh each position more.
  """
  def loss(outputs, batch):
    user, pos, neg = outputs["user"], outputs["pos"], outputs["neg"]
    pos_items, neg_items = batch[POS_ITEMS], batch[NEG_ITEMS]
    pos_logit = jnp.sum(user * pos, axis=-1) / temperature
    neg_logit = jnp.einsum("bld,bnd->bln", user, neg) / temperature
    same = neg_items[:, None, :] == pos_items[:, :, None]
    neg_logit = jnp.where(same, _SAME_ITEM_LOGIT, neg_logit)
    logits = jnp.concatenate([pos_logit[..., None], neg_logit], axis=-1)
    per_position = jax.nn.logsumexp(logits, axis=-1) - pos_logit
    weight = (pos_items != 0).astype(jnp.float32)
    value = jnp.sum(per_position * weight) / positions_per_batch
    return value, {"loss": value}
  return loss
