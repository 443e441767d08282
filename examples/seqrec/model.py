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

# Batch keys: the table's features, the raw item ids, the step and the
# run's seed (the random keys), the timestamps (`[B, L + 1]`: the
# history's and the next item's).
HISTORY, POSITIVES, NEGATIVES = "history", "positives", "negatives"
FEATURES = (HISTORY, POSITIVES, NEGATIVES)
POS_ITEMS, NEG_ITEMS, STEP, TIMES = "pos_items", "neg_items", "step", "times"
SEED = "seed"
# A negative equal to the position's positive gets this logit (as HSTU).
_SAME_ITEM_LOGIT = -5e4
# The reference's position table: its rows are 200 history items + 11
# output slots wide (max_sequence_length + gr_output_length + 1).
REFERENCE_EXTRA_POSITIONS = 11
# --negatives / --loss_norm / --positions: ours first (the defaults).
NEGATIVE_MODES = ("per_user", "per_position")
LOSS_NORMS = ("constant", "batch")
POSITION_MODES = ("newest", "oldest")

# Random streams of a step, folded into the run's seed.
_DROPOUT, _NEGATIVES, _POSITION_NEGATIVES = 0, 2, 3


def step_key(seed: jax.Array, step: jax.Array, stream: int) -> jax.Array:
  """The key of one random stream at one step (seed and step may be
  traced: one compiled step serves every seed)."""
  key = jax.random.key(seed)
  if stream != _DROPOUT:  # the dropout stream keeps key(seed) (as before)
    key = jax.random.fold_in(key, stream)
  return jax.random.fold_in(key, step)


def negatives_key(seed: jax.Array, step: jax.Array) -> jax.Array:
  """The key of a step's per-user negatives (data.device_batch)."""
  return step_key(seed, step, _NEGATIVES)


def position_negatives_key(seed: jax.Array, step: jax.Array) -> jax.Array:
  """The key of a step's per-position negatives (the loss draws them)."""
  return step_key(seed, step, _POSITION_NEGATIVES)


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
    from_oldest: the learned positions count from each row's oldest item
      over max_len + 11 rows, as the reference's left-aligned rows do;
      default: back from the newest over max_len rows.
    dtype: the blocks' compute dtype (params, norms, the residual stream
      and the outputs stay float32).
  """
  dim: int
  max_len: int
  num_blocks: int = 2
  num_heads: int = 1
  dropout: float = 0.2
  hashed: bool = False
  from_oldest: bool = False
  dtype: Any = jnp.float32

  @property
  def num_positions(self) -> int:
    """Rows of the position table."""
    return self.max_len + (REFERENCE_EXTRA_POSITIONS if self.from_oldest
                           else 0)

  def setup(self):
    self.setup_inputs(
        nn.initializers.truncated_normal(math.sqrt(1.0 / self.dim)))
    self.attn_norms = [nn.LayerNorm(epsilon=1e-8) for _ in
                       range(self.num_blocks)]
    self.attns = [nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dropout_rate=self.dropout,
        dtype=self.dtype) for _ in range(self.num_blocks)]
    self.ffn_norms = [nn.LayerNorm(epsilon=1e-8) for _ in
                      range(self.num_blocks)]
    self.ffn_in = [nn.Dense(self.dim, dtype=self.dtype)
                   for _ in range(self.num_blocks)]
    self.ffn_out = [nn.Dense(self.dim, dtype=self.dtype)
                    for _ in range(self.num_blocks)]
    self.last_norm = nn.LayerNorm(epsilon=1e-8)

  def setup_inputs(self, position_init) -> None:
    """The item tower's projection and the learned positions (for setup)."""
    if self.hashed:
      self.item_proj = nn.Dense(self.dim, name="item_proj")
    self.positions = self.param("positions", position_init,
                                (self.num_positions, self.dim))

  def embed(self, items: jax.Array, valid: jax.Array,
            key: jax.Array | None) -> jax.Array:
    """The encoder's input: scaled items + positions, dropout, 0 on padding
    (the HSTU repository's LearnablePositionalEmbeddingInputFeatures-
    Preprocessor). Positions count back from the newest item (the last
    column), or with from_oldest from the row's oldest valid column (the
    rows are right-aligned, so that is L - its count of valid items)."""
    length = items.shape[1]
    if self.from_oldest:
      oldest = length - jnp.sum(valid, axis=1, keepdims=True)
      index = jnp.clip(jnp.arange(length) - oldest, 0,
                       self.num_positions - 1)
      positions = self.positions[index]
    else:
      positions = self.positions[-length:]
    x = items * math.sqrt(self.dim) + positions
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

  @nn.compact
  def __call__(self, batch):
    emb = pe_flax.EmbeddingCollection(self.collection, name="embed")(batch)
    enc = self.encoder  # an attribute module: params under "encoder"
    history = batch[HISTORY]
    valid = (history[..., 0] if enc.hashed else history) != 0
    # A fresh dropout key per step: FlaxTrainer passes no rngs. The seed
    # comes with the batch, so one compiled step serves every seed.
    key = step_key(batch[SEED][0], batch[STEP][0], _DROPOUT)
    user = enc(enc.items(emb[HISTORY]), valid, key, batch[TIMES])
    return {"user": l2_normalize(user),
            "pos": l2_normalize(enc.items(emb[POSITIVES])),
            "neg": l2_normalize(enc.items(emb[NEGATIVES]))}


def position_negatives(key: jax.Array, shape: tuple[int, ...],
                       num_items: int) -> jax.Array:
  """int32 draws in [0, num_items), uniform with replacement: draw j is
  item j + 1 (row j of the catalogue feature, data.catalogue_ids)."""
  return jax.random.randint(key, shape, 0, num_items, jnp.int32)


def draw_counts(draws: jax.Array, size: int) -> jax.Array:
  """float32 `[..., size]`: how often each of 0..size-1 occurs among the
  last axis of int `draws` `[..., N]`.

  As a product of two one-hots (j = hi * w + lo, w = ceil(sqrt(size))),
  so that the matrix unit counts: `[..., N, size]` compares are never
  formed, and no scatter runs. Exact: 0/1 operands, float32 sums of at
  most N ones.
  """
  width = math.isqrt(size - 1) + 1 if size > 1 else 1
  high = -(-size // width)
  hi = jax.nn.one_hot(draws // width, high, dtype=jnp.bfloat16)
  lo = jax.nn.one_hot(draws % width, width, dtype=jnp.bfloat16)
  counts = jnp.einsum("...nh,...nl->...hl", hi, lo,
                      preferred_element_type=jnp.float32)
  return counts.reshape(counts.shape[:-2] + (high * width,))[..., :size]


def make_loss(temperature: float, positions_per_batch: float, *,
              per_position: bool = False, num_negatives: int = 128,
              num_items: int = 0, batch_norm: bool = False):
  """Sampled softmax over the non-padding positions; aux {"loss"}.

  Default (ours): position t of example b scores its positive against the
  example's N negatives (shared by its positions), and the sum over the
  batch's positions is divided by `positions_per_batch`, the expected
  count of a batch of random users (not the batch's own count): batches of
  users with short histories (length buckets) then do not weigh each
  position more. As the reference, each switchable alone:

  * per_position: each position draws its own `num_negatives`, uniform
    over the `num_items` items with replacement (the batch's NEGATIVES are
    the whole catalogue, data.catalogue_ids). Computed from the logits of
    every item and each item's count among the position's draws
    (`draw_counts`), which equals the softmax over the drawn logits;
  * batch_norm: divide by the batch's count of valid positions.

  Either way a negative equal to the positive is masked out.
  """
  def loss(outputs, batch):
    user, pos = outputs["user"], outputs["pos"]
    pos_items, neg_items = batch[POS_ITEMS], batch[NEG_ITEMS]
    pos_logit = jnp.sum(user * pos, axis=-1) / temperature
    if per_position:
      per_pos = _per_position_loss(
          user, pos_logit, outputs["neg"], neg_items, pos_items,
          position_negatives_key(batch[SEED][0], batch[STEP][0]))
    else:
      neg_logit = jnp.einsum("bld,bnd->bln", user,
                             outputs["neg"]) / temperature
      same = neg_items[:, None, :] == pos_items[:, :, None]
      neg_logit = jnp.where(same, _SAME_ITEM_LOGIT, neg_logit)
      logits = jnp.concatenate([pos_logit[..., None], neg_logit], axis=-1)
      per_pos = jax.nn.logsumexp(logits, axis=-1) - pos_logit
    weight = (pos_items != 0).astype(jnp.float32)
    count = (jnp.maximum(jnp.sum(weight), 1.0) if batch_norm
             else positions_per_batch)
    value = jnp.sum(per_pos * weight) / count
    return value, {"loss": value}

  def _per_position_loss(user, pos_logit, catalogue, ids, pos_items, key):
    catalogue = catalogue.reshape(-1, catalogue.shape[-1])  # [C, d]
    ids = ids.reshape(-1)  # [C]: item j + 1 at j, then padding
    logits = jnp.einsum("bld,cd->blc", user, catalogue) / temperature
    draws = position_negatives(key, pos_items.shape + (num_negatives,),
                               num_items)
    counts = draw_counts(draws, ids.shape[0])
    counts = jnp.where(ids == pos_items[..., None], 0.0, counts)
    top = jax.lax.stop_gradient(
        jnp.maximum(pos_logit, jnp.max(logits, axis=-1)))
    total = jnp.exp(pos_logit - top) + jnp.sum(
        counts * jnp.exp(logits - top[..., None]), axis=-1)
    return jnp.log(total) + top - pos_logit

  if per_position and num_items < 1:
    raise ValueError(f"make_loss per_position needs num_items >= 1; got "
                     f"{num_items}.")
  return loss
