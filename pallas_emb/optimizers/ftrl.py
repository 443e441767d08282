"""Sparse FTRL-Proximal (McMahan et al., 2013), as TF's / Keras' Ftrl.

Per element of a touched row, with p = -lr_power (1/2 by default):

    n_new  = n + g**2
    linear += g - (n_new**p - n**p) / lr * w
    w      = (clip(linear, -l1, l1) - linear) / (n_new**p / lr + 2 * l2)
    n      = n_new

(Keras' `Ftrl` update without l2 shrinkage and beta; for lr_power = -0.5
the powers are square roots, as in TF's kernel.) The weight is recomputed
from the state, not incremented: on a bf16 table it is rounded once.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.optimizers import base


class FtrlState(NamedTuple):
  """accumulator (n), linear: f32 [vocab_rows, emb_width], sharded as the table.

  step: int32 scalar, the number of updates applied.
  """
  accumulator: jax.Array
  linear: jax.Array
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class Ftrl(base.SparseOptimizer):
  """FTRL-Proximal with L1 and L2 regularization, per element.

  Args:
    learning_rate: a float > 0, or a schedule `step -> lr` (a step where it
      is not > 0 is skipped, as the update divides by it).
    l1: L1 regularization strength, >= 0.
    l2: L2 regularization strength, >= 0.
    lr_power: the accumulator's power, <= 0 (-0.5: Adagrad-like).
    initial_accumulator_value: every accumulator's start, > 0 (Keras'
      default 0.1).
  """
  learning_rate: base.LearningRate
  l1: float = 0.0
  l2: float = 0.0
  lr_power: float = -0.5
  initial_accumulator_value: float = 0.1

  state_type: ClassVar[type] = FtrlState

  def __post_init__(self):
    base.check_learning_rate(self)
    base.check_at_least(self, "l1", 0)
    base.check_at_least(self, "l2", 0)
    base.check(base.is_finite_number(self.lr_power) and self.lr_power <= 0,
               self, f"lr_power={self.lr_power!r} must be finite and <= 0.")
    base.check(base.is_finite_number(self.initial_accumulator_value)
               and np.float32(self.initial_accumulator_value) > 0, self,
               "initial_accumulator_value="
               f"{self.initial_accumulator_value!r} must be finite and > 0: "
               "at 0, an element without gradient would divide 0 by 0.")

  def slots(self):
    return (base.Slot("accumulator", base.ELEMENT,
                      self.initial_accumulator_value),
            base.Slot("linear", base.ELEMENT))

  def scalars_are_valid(self, step):
    # The update divides by the learning rate: a schedule's 0 would write
    # 0 / 0 into the rows.
    (lr,) = self.scalars(step)
    return super().scalars_are_valid(step) & (lr > 0)

  def _power(self, n: jax.Array) -> jax.Array:
    if self.lr_power == -0.5:
      return jnp.sqrt(n)
    return jnp.power(n, jnp.float32(-self.lr_power))

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    (lr,) = scalars
    g = base.round_to(grad, dtype)
    n = element["accumulator"]
    n_new = n + base.unfused_product(g, g)
    p_new = self._power(n_new)
    sigma = (p_new - self._power(n)) / lr
    linear = element["linear"] + (g - base.unfused_product(sigma, values))
    quadratic = p_new / lr + jnp.float32(2 * self.l2)
    # Bounds negated in Python: Triton cannot lower the negation of a
    # constant.
    clipped = jnp.clip(linear, np.float32(-self.l1), np.float32(self.l1))
    w = (clipped - linear) / quadratic
    return w, {"accumulator": n_new, "linear": linear}
