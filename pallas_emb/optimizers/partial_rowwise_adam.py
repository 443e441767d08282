"""Sparse partial row-wise Adam, as FBGEMM's PARTIAL_ROWWISE_ADAM.

The first moment is element-wise, the second one row-wise (one f32 per
row, the mean of the row's squared gradient), which saves almost half of
Adam's state. Per touched row, with t = the stack's step counter + 1:

    v = b2 * v + (1 - b2) * sum_c(g_c**2) / emb_width           (per row)
    m = b1 * m + (1 - b1) * g                                  (per element)
    w -= lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from pallas_emb.optimizers import adam
from pallas_emb.optimizers import base


class PartialRowwiseAdamState(NamedTuple):
  """m: f32 [vocab_rows, emb_width], column-sharded like the table.

  v: f32 [vocab_rows] row-wise second moments (replicated).
  step: int32 scalar, the number of updates applied.
  """
  m: jax.Array
  v: jax.Array
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class PartialRowwiseAdam(adam.AdamFamily):
  """Adam with an element-wise first and a row-wise second moment
  (arguments: `adam.AdamFamily`)."""

  state_type: ClassVar[type] = PartialRowwiseAdamState

  def slots(self):
    return (base.Slot("m", base.ELEMENT), base.Slot("v", base.ROW))

  def scalars(self, step):
    return (self.learning_rate_at(step), adam.bias_correction(self.b1, step),
            adam.bias_correction(self.b2, step))

  def row_update(self, row, row_sq, step, scalars, emb_width):
    _, _, correction2 = scalars
    v = adam.moment(self.b2, row["v"], row_sq / jnp.float32(emb_width))
    return {"v": v}, (jnp.sqrt(v / correction2) + jnp.float32(self.eps),)

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    (denominator,) = coeffs
    lr, correction1, _ = scalars
    g = base.round_to(grad, dtype)
    m = adam.moment(self.b1, element["m"], g)
    delta = base.unfused_product(-lr, m / correction1 / denominator)
    return base.add_rounded(values, delta, dtype), {"m": m}
