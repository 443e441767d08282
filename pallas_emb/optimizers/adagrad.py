"""Sparse element-wise Adagrad, as `optax.adagrad` (Duchi et al., 2011).

Per element of a touched row: `acc += g**2`; `w -= lr * g / sqrt(acc +
eps)` (0 where acc is 0), the formula and order of operations of optax's
`scale_by_rss` + `scale_by_learning_rate`, so that on an f32 table it equals
`optax.adagrad` on the dense gradient, bit for bit (rows without a gradient
do not move in either, nor do their accumulators).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from pallas_emb.optimizers import base


class AdagradState(NamedTuple):
  """accumulator: f32 [vocab_rows, emb_width], column-sharded like the table.

  step: int32 scalar, the number of updates applied.
  """
  accumulator: jax.Array
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class Adagrad(base.SparseOptimizer):
  """Element-wise Adagrad; defaults as optax.adagrad.

  Args:
    learning_rate: a float, or a schedule `step -> lr`.
    eps: added to the accumulator under the square root; finite, >= 0.
    initial_accumulator_value: every accumulator's start; finite, >= 0.
  """
  learning_rate: base.LearningRate
  eps: float = 1e-7
  initial_accumulator_value: float = 0.1

  state_type: ClassVar[type] = AdagradState
  # Not "pallas_emb_adagrad": that is RowwiseAdagrad's kernel since §4.
  kernel_name: ClassVar[str] = "pallas_emb_elementwise_adagrad"

  def __post_init__(self):
    base.check_learning_rate(self)
    base.check_at_least(self, "eps", 0)
    base.check_at_least(self, "initial_accumulator_value", 0)

  def slots(self):
    return (base.Slot("accumulator", base.ELEMENT,
                      self.initial_accumulator_value),)

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    (lr,) = scalars
    g = base.round_to(grad, dtype)
    acc = element["accumulator"] + base.unfused_product(g, g)
    scale = jnp.where(acc > 0, lax.rsqrt(acc + jnp.float32(self.eps)),
                      jnp.float32(0))
    delta = base.unfused_product(-lr, scale * g)
    return base.add_rounded(values, delta, dtype), {"accumulator": acc}
