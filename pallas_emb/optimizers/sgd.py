"""Sparse SGD: `w -= lr * g` on the rows a batch touched.

On an f32 table this is `optax.sgd` (no momentum) applied to the dense
gradient, bit for bit: rows without a gradient do not move in either.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax

from pallas_emb.optimizers import base


class SgdState(NamedTuple):
  """step: int32 scalar, the number of updates applied."""
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class Sgd(base.SparseOptimizer):
  """Plain stochastic gradient descent, no state but the step counter.

  Args:
    learning_rate: a float, or a schedule `step -> lr` (e.g. an optax one).
  """
  learning_rate: base.LearningRate

  state_type: ClassVar[type] = SgdState

  def __post_init__(self):
    base.check_learning_rate(self)

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    (lr,) = scalars
    g = base.round_to(grad, dtype)  # the gradient a `dtype` table gets
    return base.add_rounded(values, base.unfused_product(-lr, g), dtype), {}
