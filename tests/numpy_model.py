"""An independent numpy model of dedup and row-wise Adagrad.

Written from the design text alone, over the *global* batch: no sharding,
no routing. bf16 rounding points use ml_dtypes.
"""

import math

import ml_dtypes
import numpy as np

FILL = np.iinfo(np.int32).max


def rnd(x, dtype):
  """Round f32 values to the table dtype and back to f32."""
  return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def resolve(ids, vocab_rows, padding_id):
  """The documented rule, per id: `(row, trains, padding)`. The row it
  reads: wrapped once if negative, then clamped into the table. Padding:
  it reaches the padding row (padding_id's row) after that wrap and clamp.
  Trains: inside the table after the wrap, and not padding: the padding row
  never trains, whatever id reaches it."""
  raw = np.asarray(ids).astype(np.int64)
  wrapped = np.where(raw < 0, raw + vocab_rows, raw)
  row = np.clip(wrapped, 0, vocab_rows - 1)
  inside = (wrapped >= 0) & (wrapped < vocab_rows)
  if padding_id is None:
    return row, inside, np.zeros(row.shape, bool)
  pad_row = padding_id + vocab_rows if padding_id < 0 else padding_id
  padding = row == pad_row
  return row, inside & ~padding, padding


def dedup(ids, num_unique, vocab_rows, padding_id=0):
  """Sorted unique rows padded with FILL, and segment ids.

  Only the ids that train (`resolve`) take a slot; the others (outside the
  table after one wrap, padding) get segment -1 (padding changes nothing,
  not even the decay of its row's state).
  """
  flat, valid, _ = resolve(np.asarray(ids).reshape(-1), vocab_rows,
                           padding_id)
  uniq = np.unique(flat[valid])
  table = np.full(num_unique, FILL, np.int64)
  table[:min(num_unique, uniq.size)] = uniq[:num_unique]
  where = {int(t): i for i, t in enumerate(uniq[:num_unique])}
  segs = np.array([where.get(int(t), -1) if ok else -1
                   for t, ok in zip(flat, valid)])
  return table.astype(np.int32), segs.reshape(np.shape(ids)), uniq.size


class Adagrad:
  """The optimizer state and one `step` of row-wise Adagrad."""

  def __init__(self, table, lr, eps=1e-10, init_acc=0.0, half_life=None,
               weight_decay=0.0, lazy=False):
    self.table = np.array(table)
    self.dtype = self.table.dtype
    vocab = self.table.shape[0]
    self.row_state = np.full(vocab, init_acc, np.float32)
    self.last_step = np.zeros(vocab, np.int32) if lazy else None
    self.step_count = 0
    self.lr, self.eps, self.lazy = np.float32(lr), np.float32(eps), lazy
    ln2 = math.log(2.0)
    self.decay = 1.0 if half_life is None else math.exp(-ln2 / half_life)
    self.accum_rate = 0.0 if half_life is None else ln2 / half_life
    self.wd_factor = math.exp(-weight_decay)
    self.wd_rate = weight_decay

  def step(self, ids, grads, num_unique, pending=True, padding_id=0):
    """Returns (norm, valid). grads: [num_tokens, width] (any float)."""
    vocab, width = self.table.shape
    uniq, segs, _ = dedup(ids, num_unique, vocab, padding_id)
    segs = segs.reshape(-1)
    grads = np.asarray(grads, np.float32).reshape(segs.size, width)
    accum = np.zeros((num_unique, width), np.float32)
    for tok, seg in enumerate(segs):
      if 0 <= seg < num_unique:
        accum[seg] += grads[tok]
    row_sq = np.sum(rnd(accum, self.dtype) ** 2, axis=1, dtype=np.float32)
    norm = np.sqrt(np.sum(row_sq, dtype=np.float32))
    if not (np.isfinite(norm) and pending):
      return norm, 0
    table = self.table.astype(np.float32)
    for u, tok in enumerate(uniq.astype(np.int64)):
      if tok == FILL:
        continue
      if self.lazy:
        delta = np.float32(max(0, self.step_count - self.last_step[tok]))
        factor = np.exp(np.float32(-self.accum_rate) * delta)
        wd = np.exp(np.float32(-self.wd_rate) * delta) if row_sq[u] > 0 \
            else np.float32(1)
        self.last_step[tok] = self.step_count
      else:
        factor = np.float32(self.decay)
        wd = np.float32(self.wd_factor) if row_sq[u] > 0 else np.float32(1)
      acc = self.row_state[tok] * np.float32(factor) + row_sq[u] * np.float32(
          1.0 / width)
      self.row_state[tok] = acc
      lr_scale = -self.lr / (np.sqrt(acc) + self.eps)
      decayed = rnd(table[tok] * np.float32(wd), self.dtype)
      delta_v = rnd(lr_scale * rnd(accum[u], self.dtype), self.dtype)
      table[tok] = rnd(decayed + delta_v, self.dtype)
    self.table = table.astype(self.dtype)
    self.step_count += 1
    return norm, 1


BF16 = ml_dtypes.bfloat16


# ---------------------------------------------------------------------------
# The sparse optimizer family, from the published update rules.
#
# Each model keeps the table and its state in numpy over the *global* batch
# (no sharding) and updates, per step, the rows the batch gave a gradient
# (lazy sparse semantics: a row whose summed gradient is all zero, e.g. the
# padding id's, is left as it is). All arithmetic is float32, one operation
# at a time. bf16 tables: the gradient is rounded to the table dtype (what
# a bf16 table's gradient is), the state stays float32, an additive update
# is rounded to the table dtype before it is added and the sum once more
# (the rounding points of the row-wise Adagrad update); FTRL recomputes the weight, rounded
# once.
# ---------------------------------------------------------------------------

F32 = np.float32


class SparseModel:
  """dedup + f32 segment sums + a per-row rule; subclasses give the rule."""

  def __init__(self, table):
    self.table = np.array(table)
    self.dtype = self.table.dtype
    self.step_count = 0

  def new_state(self, value=0.0, rowwise=False):
    shape = self.table.shape[:1] if rowwise else self.table.shape
    return np.full(shape, value, F32)

  def step(self, ids, grads, num_unique, pending=True, padding_id=0):
    """Returns (norm, valid). grads: [num_tokens, width] (any float)."""
    vocab, width = self.table.shape
    uniq, segs, _ = dedup(ids, num_unique, vocab, padding_id)
    segs = segs.reshape(-1)
    grads = np.asarray(grads, F32).reshape(segs.size, width)
    accum = np.zeros((num_unique, width), F32)
    for tok, seg in enumerate(segs):
      if 0 <= seg < num_unique:
        accum[seg] += grads[tok]
    row_sq = np.sum(rnd(accum, self.dtype) ** 2, axis=1, dtype=F32)
    norm = np.sqrt(np.sum(row_sq, dtype=F32))
    if not (np.isfinite(norm) and pending):
      return norm, 0
    table = self.table.astype(F32)
    t = self.step_count + 1  # this update's number, 1-based
    for u, tok in enumerate(uniq.astype(np.int64)):
      if tok == FILL or row_sq[u] == 0:
        continue
      g = rnd(accum[u], self.dtype)
      table[tok] = self.update_row(tok, table[tok], g, row_sq[u], width, t)
    self.table = table.astype(self.dtype)
    self.step_count += 1
    return norm, 1

  def add(self, w, delta):
    """w + delta with the bf16 rounding points (identity for f32)."""
    return rnd(w + rnd(delta, self.dtype), self.dtype)

  def update_row(self, tok, w, g, row_sq, width, t):
    raise NotImplementedError


class Sgd(SparseModel):
  """w -= lr * g."""

  def __init__(self, table, lr):
    super().__init__(table)
    self.lr = F32(lr)

  def update_row(self, tok, w, g, row_sq, width, t):
    return self.add(w, -self.lr * g)


class ElementAdagrad(SparseModel):
  """Duchi et al. 2011, as optax.adagrad: acc += g^2; w -= lr g / sqrt(acc + eps)."""

  def __init__(self, table, lr, eps=1e-7, init_acc=0.1):
    super().__init__(table)
    self.lr, self.eps = F32(lr), F32(eps)
    self.accumulator = self.new_state(init_acc)

  def update_row(self, tok, w, g, row_sq, width, t):
    acc = self.accumulator[tok] + g * g
    self.accumulator[tok] = acc
    scale = np.where(acc > 0, F32(1) / np.sqrt(acc + self.eps), F32(0))
    return self.add(w, -self.lr * (scale * g))


class LazyAdam(SparseModel):
  """Kingma & Ba 2015 with TF LazyAdam's step size, on touched rows only.

  lr_t = lr sqrt(1 - b2^t) / (1 - b1^t); m = b1 m + (1 - b1) g;
  v = b2 v + (1 - b2) g^2; w -= lr_t m / (sqrt(v) + eps).
  """

  def __init__(self, table, lr, b1=0.9, b2=0.999, eps=1e-8):
    super().__init__(table)
    self.lr, self.b1, self.b2, self.eps = F32(lr), F32(b1), F32(b2), F32(eps)
    self.m, self.v = self.new_state(), self.new_state()

  def update_row(self, tok, w, g, row_sq, width, t):
    b1, b2 = self.b1, self.b2
    lr_t = (self.lr * np.sqrt(F32(1) - b2 ** F32(t))
            / (F32(1) - b1 ** F32(t)))
    self.m[tok] = b1 * self.m[tok] + (F32(1) - b1) * g
    self.v[tok] = b2 * self.v[tok] + (F32(1) - b2) * (g * g)
    return self.add(w, -(lr_t * self.m[tok]) / (np.sqrt(self.v[tok])
                                                 + self.eps))


class PartialRowwiseAdam(SparseModel):
  """FBGEMM's PARTIAL_ROWWISE_ADAM (no weight decay).

  v (per row) = b2 v + (1 - b2) mean_c(g_c^2); m = b1 m + (1 - b1) g;
  w -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps).
  """

  def __init__(self, table, lr, b1=0.9, b2=0.999, eps=1e-8):
    super().__init__(table)
    self.lr, self.b1, self.b2, self.eps = F32(lr), F32(b1), F32(b2), F32(eps)
    self.m, self.v = self.new_state(), self.new_state(rowwise=True)

  def update_row(self, tok, w, g, row_sq, width, t):
    b1, b2 = self.b1, self.b2
    self.v[tok] = b2 * self.v[tok] + (F32(1) - b2) * (row_sq / F32(width))
    v_hat = self.v[tok] / (F32(1) - b2 ** F32(t))
    self.m[tok] = b1 * self.m[tok] + (F32(1) - b1) * g
    m_hat = self.m[tok] / (F32(1) - b1 ** F32(t))
    return self.add(w, -self.lr * (m_hat / (np.sqrt(v_hat) + self.eps)))


class Ftrl(SparseModel):
  """McMahan et al. 2013, FTRL-Proximal per coordinate, as Keras' Ftrl.

  n' = n + g^2; z += g - (n'^p - n^p) / lr * w;
  w = (clip(z, -l1, l1) - z) / (n'^p / lr + 2 l2); p = -lr_power.
  """

  def __init__(self, table, lr, l1=0.0, l2=0.0, lr_power=-0.5,
               init_acc=0.1):
    super().__init__(table)
    self.lr, self.l1, self.l2 = F32(lr), F32(l1), F32(l2)
    self.power = F32(-lr_power)
    self.accumulator = self.new_state(init_acc)
    self.linear = self.new_state()

  def update_row(self, tok, w, g, row_sq, width, t):
    n = self.accumulator[tok]
    n_new = n + g * g
    p_new, p_old = n_new ** self.power, n ** self.power
    self.linear[tok] = self.linear[tok] + (g - (p_new - p_old) / self.lr * w)
    self.accumulator[tok] = n_new
    z = self.linear[tok]
    quadratic = p_new / self.lr + F32(2) * self.l2
    return rnd((np.clip(z, -self.l1, self.l1) - z) / quadratic, self.dtype)


# ---------------------------------------------------------------------------
# Lookups of a collection's features, from the documented semantics: an id
# is wrapped once (negative: += vocab_rows), then clamped into its table; a
# pooled bag is `sum_k c_k * row_k` in f32, entry by entry, rounded once to
# the table dtype, with combiner weights c (`sum`: w, `mean`: w / sum(w),
# `sqrtn`: w / sqrt(sum(w^2)); padding weighs 0, `resolve`).
# ---------------------------------------------------------------------------


def wrap_clamp(ids, vocab_rows):
  return resolve(ids, vocab_rows, None)[0]


def trains(ids, vocab_rows, padding_id):
  """Which ids train (`resolve`)."""
  return resolve(ids, vocab_rows, padding_id)[1]


def combiner_weights(ids, weights, combiner, padding_id, vocab_rows):
  """f32 `[B, L]` weights each entry enters its bag's pool with."""
  w = np.asarray(weights, F32).copy()
  w[resolve(ids, vocab_rows, padding_id)[2]] = 0
  if combiner == "sum":
    return w
  total = np.zeros(w.shape[0], F32)
  for k in range(w.shape[1]):  # in entry order
    total += w[:, k] if combiner == "mean" else w[:, k] * w[:, k]
  if combiner == "sqrtn":
    total = np.sqrt(total)
  total = np.where(total != 0, total, F32(1))[:, None]
  return np.where(w != 0, w / total, F32(0)).astype(F32)


def pool(table, ids, cw):
  """`[B, D]` pooled rows of `[B, L]` bags with combiner weights `cw`."""
  rows = table[wrap_clamp(ids, table.shape[0])].astype(F32)
  acc = np.zeros((ids.shape[0], table.shape[1]), F32)
  for k in range(ids.shape[1]):
    acc = acc + (cw[:, k:k + 1] * rows[:, k]).astype(F32)
  return acc.astype(table.dtype)
