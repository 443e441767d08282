"""Sparse (lazy) Adam, as TensorFlow Addons' LazyAdam (Kingma & Ba, 2015).

Per element of a touched row, with t = the stack's step counter + 1 (the
updates applied, this one included; skipped updates do not count):

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2
    w -= lr_t * m / (sqrt(v) + eps),  lr_t = lr * sqrt(1 - b2**t) / (1 - b1**t)

Rows the batch did not touch keep their w, m and v (their moments do not
decay): the lazy semantics of LazyAdam, FBGEMM and TPU embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.optimizers import base


class AdamState(NamedTuple):
  """m, v: f32 [vocab_rows, emb_width] moments, column-sharded like the table.

  step: int32 scalar, the number of updates applied.
  """
  m: jax.Array
  v: jax.Array
  step: jax.Array


def bias_correction(beta: float, step: jax.Array) -> jax.Array:
  """`1 - beta**t` in f32, t = step + 1 (the update being applied)."""
  t = (step + 1).astype(jnp.float32)
  return jnp.float32(1) - jnp.power(jnp.float32(beta), t)


def moment(beta: float, old: jax.Array, new: jax.Array) -> jax.Array:
  """`beta * old + (1 - beta) * new`, `1 - beta` rounded to f32 as TF does."""
  one_minus = np.float32(1) - np.float32(beta)
  return (base.unfused_product(jnp.float32(beta), old)
          + base.unfused_product(jnp.float32(one_minus), new))


@dataclasses.dataclass(frozen=True)
class AdamFamily(base.SparseOptimizer):
  """Adam's hyper-parameters and their checks (Adam, PartialRowwiseAdam).

  Args:
    learning_rate: a float, or a schedule `step -> lr`.
    b1, b2: the moments' decay rates, in [0, 1).
    eps: added to the second moment's square root; finite and > 0.
  """
  learning_rate: base.LearningRate
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    base.check_learning_rate(self)
    for name in ("b1", "b2"):
      base.check_at_least(self, name, 0, high=1)
    base.check_at_least(self, "eps", 0, strict=True)


@dataclasses.dataclass(frozen=True)
class Adam(AdamFamily):
  """Lazy Adam with element-wise moments (arguments: `AdamFamily`)."""

  state_type: ClassVar[type] = AdamState

  def slots(self):
    return (base.Slot("m", base.ELEMENT), base.Slot("v", base.ELEMENT))

  def scalars(self, step):
    lr = self.learning_rate_at(step)
    return (lr * jnp.sqrt(bias_correction(self.b2, step))
            / bias_correction(self.b1, step),)

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    (lr_t,) = scalars
    g = base.round_to(grad, dtype)
    m = moment(self.b1, element["m"], g)
    v = moment(self.b2, element["v"], g * g)
    delta = base.unfused_product(-lr_t, m) / (jnp.sqrt(v)
                                              + jnp.float32(self.eps))
    return base.add_rounded(values, delta, dtype), {"m": m, "v": v}
