"""An independent numpy model of DESIGN §4-§5 (dedup and row-wise Adagrad).

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


def dedup(ids, num_unique, vocab_rows, padding_id=0, padding_slot=True):
  """Sorted unique rows padded with FILL, and segment ids.

  Every id is wrapped exactly once (negative: += vocab_rows); ids still
  outside the table take no slot and get segment -1, as does the padding
  id, which keeps its slot when `padding_slot` (the single-table dedup, as
  the reference) and takes none otherwise (the collection: padding changes
  nothing, not even the decay of its row's state).
  """
  raw = np.asarray(ids).reshape(-1).astype(np.int64)
  flat = np.where(raw < 0, raw + vocab_rows, raw)
  valid = (flat >= 0) & (flat < vocab_rows)
  if padding_id is not None and not padding_slot:
    valid &= raw != padding_id
  uniq = np.unique(flat[valid])
  table = np.full(num_unique, FILL, np.int64)
  table[:min(num_unique, uniq.size)] = uniq[:num_unique]
  where = {int(t): i for i, t in enumerate(uniq[:num_unique])}
  segs = np.array([
      -1 if (not ok or (padding_id is not None and r == padding_id))
      else where.get(int(t), -1) for r, t, ok in zip(raw, flat, valid)])
  return table.astype(np.int32), segs.reshape(np.shape(ids)), uniq.size


class Adagrad:
  """The optimizer state and one `step` of DESIGN §4."""

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

  def step(self, ids, grads, num_unique, pending=True, padding_id=0,
           padding_slot=True):
    """Returns (norm, valid). grads: [num_tokens, width] (any float)."""
    vocab, width = self.table.shape
    uniq, segs, _ = dedup(ids, num_unique, vocab, padding_id, padding_slot)
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
