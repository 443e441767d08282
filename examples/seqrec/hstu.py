"""HSTU (Hierarchical Sequential Transduction Unit) as an `Encoder`.

The encoder of "Actions Speak Louder than Words" (Zhai et al., ICML'24) as
meta-recsys/generative-recommenders writes it in
generative_recommenders/research/modeling/sequential/hstu.py (cited below
as hstu.py:LINE, at db1bf8f). Each block, from x `[B, L, d]`:

    u, v, q, k = split(SiLU(LayerNorm(x) @ W_uvqk))           # no bias
    A = SiLU(q k^T + rab(positions, times)) / n * causal mask  # no softmax
    x = Linear(dropout(u * LayerNorm(A v))) + x

LayerNorms without scale or bias, eps 1e-6; n a constant (not the number
of valid items); the relative attention bias rab is a learned weight per
distance i - j plus one per log-bucket of the time from key j to the
*next* item after query i (the time the prediction is made for). No final
norm: the user vector is only L2-normalised (the repository's
L2NormEmbeddingPostprocessor; SeqRec does it). The input is `Encoder`'s
(scaled items + learned positions, dropout, 0 on padding).

Differences (all from our right-aligned, bucketed rows): n is the
position table's rows, max_len (theirs is their padded width 200 + 11
output slots = 211, which `from_oldest` takes too; the LayerNorm right
after cancels the constant up to its eps); padding keys are masked out
explicitly (their rows are left-aligned, so a causal query never sees
padding). With `dtype` bfloat16 the projections and the attention run in
bf16; the norms, the bias tables and the residual stream stay float32.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from examples.seqrec import model as model_lib

# hstu.py:610-613: 128 buckets of log(max(|dt|, 1)) / 0.301 (dt seconds).
NUM_TIME_BUCKETS = 128
_LOG_BUCKET_WIDTH = 0.301
_EPS = 1e-6  # the blocks' LayerNorms (hstu.py:239)


def time_buckets(dt: jax.Array) -> jax.Array:
  """int32 bucket in [0, NUM_TIME_BUCKETS] of integer time gaps `dt`
  (hstu.py:611-613 and the clamp of 132-138; float32 like torch's log of an
  int64 tensor, truncated toward 0 like `.long()`)."""
  gap = jnp.maximum(jnp.abs(dt), 1).astype(jnp.float32)
  return jnp.clip((jnp.log(gap) / _LOG_BUCKET_WIDTH).astype(jnp.int32), 0,
                  NUM_TIME_BUCKETS)


def small_table_lookup(table: jax.Array, idx: jax.Array,
                       one_hot: bool | None = None) -> jax.Array:
  """`table[idx]` of a tiny table `[K]`, or `[n, ...]` of n tiny tables
  `[n, K]` read at the same ids; `one_hot` (default: on TPUs) as a one-hot
  product on the MXU, exact (f32 at HIGHEST precision) for finite entries
  but the sign of a zero (a -0.0 entry reads +0.0). Measured on a v5e at
  8df6ccf: ts_w's 129 entries at [128, 200, 200] bucket ids took 42 ms
  gathered and 1.07 ms as a one-hot product; on a CPU the one-hot operand
  would be materialized (2.6 GB there), so CPUs gather. Reading the n
  tables in one product builds the one-hot operand once, not n times; the
  tables' axis leads the result so that each table's `[..., L, L]` keeps
  the ids' last axis in the chip's 128 lanes (n trailing would pad n to
  128 lanes). Tried and dropped: the same product in bf16 over the
  table's three exact bf16 parts (one-hot `[..., 3 K]` times `[3 K, n]`),
  fewer MXU passes on paper, took 4.5 ms for the forward against 1.3 on a
  v5e (`jax.grad` of it 1.5 ms against 1.7), and HSTU-large ran at 7,940
  users/s with it, against 9,740 without (the tables' axis then last)."""
  if one_hot is None:
    one_hot = jax.devices()[0].platform == "tpu"
  if not one_hot:
    return jnp.take(table, idx, axis=-1)
  return jnp.tensordot(table,
                       jax.nn.one_hot(idx, table.shape[-1], dtype=table.dtype),
                       axes=([table.ndim - 1], [idx.ndim]),
                       precision=jax.lax.Precision.HIGHEST)


def time_bucket_ids(times: jax.Array) -> jax.Array:
  """int32 `[B, L, L]`: the time bucket of query i, key j from times
  `[B, L + 1]`, the reference's `ext_timestamps` (hstu.py:128-130):
  column t + 1 is the time of the item query t predicts, so the gap is
  times[i + 1] - times[j]."""
  return time_buckets(times[:, 1:, None] - times[:, None, :-1])


def position_bias(pos_w: jax.Array, length: int) -> jax.Array:
  """`[L, L]` (`[n, L, L]` for n stacked tables `[n, 2 M - 1]`): pos_w
  holds the weight of distance i - j at M - 1 + j - i (the
  pad/repeat/reshape of hstu.py:123-125,139 for any L <= M). Read by
  `small_table_lookup`: on TPUs a one-hot product, whose gradient is a
  product too, not a scatter-add of L * L entries into the table."""
  middle = (pos_w.shape[-1] - 1) // 2
  i = jnp.arange(length)
  return small_table_lookup(pos_w, middle + i[None, :] - i[:, None])


def relative_bias(pos_w: jax.Array, ts_w: jax.Array,
                  times: jax.Array) -> jax.Array:
  """`[B, L, L]` bias of query i, key j (RelativeBucketedTimeAndPosition-
  BasedBias.forward, hstu.py:111-143): `position_bias` of pos_w plus
  ts_w `[NUM_TIME_BUCKETS + 1]` at `time_bucket_ids(times)`. HSTU reads
  every block's ts_w in one lookup instead (the same values)."""
  return (position_bias(pos_w, times.shape[1] - 1)[None]
          + small_table_lookup(ts_w, time_bucket_ids(times)))


def _symmetric_uniform(bound: float):
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init


class HSTU(model_lib.Encoder):
  """`Encoder` with HSTU blocks; the same call contract, and `times`.

  Attributes (besides Encoder's): num_heads divides dim, and each head
  has dqk = dv = dim / num_heads (both ml-1m configs of the reference);
  dropout is the input and the linear dropout (attention has none:
  hstu.py:203-211 never applies attn_dropout_ratio).
  """

  def setup(self):
    # HSTU.reset_params (hstu.py:643-657) re-initialises every parameter
    # outside its blocks and the item table, i.e. the positions, with
    # xavier_normal.
    self.setup_inputs(nn.initializers.variance_scaling(1.0, "fan_avg",
                                                       "normal"))
    width = self.dim  # num_heads * dv = num_heads * dqk
    normal = nn.initializers.normal(0.02)
    self.uvqk = [self.param(f"uvqk_{i}", normal, (self.dim, 4 * width))
                 for i in range(self.num_blocks)]
    # torch.nn.Linear with xavier_uniform weights (hstu.py:268-272) and
    # its default bias init.
    self.out = [nn.Dense(self.dim, name=f"out_{i}", dtype=self.dtype,
                         kernel_init=nn.initializers.xavier_uniform(),
                         bias_init=_symmetric_uniform(1 / math.sqrt(width)))
                for i in range(self.num_blocks)]
    self.pos_w = [self.param(f"pos_w_{i}", normal,
                             (2 * self.num_positions - 1,))
                  for i in range(self.num_blocks)]
    self.ts_w = [self.param(f"ts_w_{i}", normal, (NUM_TIME_BUCKETS + 1,))
                 for i in range(self.num_blocks)]
    self.norm = nn.LayerNorm(epsilon=_EPS, use_bias=False, use_scale=False)

  def __call__(self, items: jax.Array, valid: jax.Array,
               key: jax.Array | None = None,
               times: jax.Array | None = None) -> jax.Array:
    """`[B, L, dim]` outputs (not normalised), 0 on padding.

    items, valid, key: as `Encoder`; times: int `[B, L + 1]` timestamps
    (seconds), right-aligned with the history plus one column: column t
    is item t's time for t < L and column L the time of the item the last
    position predicts (the reference feeds its target's timestamp too,
    features.py:79-83). Padding columns may hold anything.
    """
    if times is None or times.shape[1] != items.shape[1] + 1:
      raise ValueError(
          f"HSTU needs times [B, L + 1] = [B, {items.shape[1] + 1}] with the "
          f"items [B, L, d]; got {None if times is None else times.shape}.")
    keys = model_lib.split_keys(key, 1 + self.num_blocks)
    x = self.embed(items, valid, next(keys))
    length, heads = items.shape[1], self.num_heads
    causal = jnp.tril(jnp.ones((length, length), bool))
    # [B, 1, L, L]: the heads share the mask and the bias (hstu.py:209-211).
    keep = (causal[None] & valid[:, None, :])[:, None].astype(jnp.float32)

    def split(a):  # [B, L, heads * w] -> [B, L, heads, w]
      return a.reshape(a.shape[:2] + (heads, -1))

    dtype = self.dtype
    keep = keep.astype(dtype)
    # Every block's biases in one lookup each: [blocks, L, L] of the
    # positions, [blocks, B, L, L] of the time gaps.
    position = position_bias(jnp.stack(self.pos_w), length)
    time_bias = small_table_lookup(jnp.stack(self.ts_w),
                                   time_bucket_ids(times))
    for i in range(self.num_blocks):
      uvqk = self.norm(x).astype(dtype) @ self.uvqk[i].astype(dtype)
      u, v, q, k = jnp.split(nn.silu(uvqk), 4, axis=-1)
      scores = jnp.einsum("bnhd,bmhd->bhnm", split(q), split(k))
      bias = (position[i][None] + time_bias[i]).astype(dtype)
      attn = nn.silu(scores + bias[:, None]) / self.num_positions * keep
      out = jnp.einsum("bhnm,bmhd->bnhd", attn, split(v)).reshape(x.shape)
      out = self.norm(out.astype(jnp.float32)).astype(dtype)
      x = self.out[i](model_lib.dropout(u * out, self.dropout,
                                        next(keys))) + x
    return x * valid[..., None].astype(jnp.float32)
