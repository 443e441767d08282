"""Row-wise Adagrad: one f32 accumulator per row.

The math is `kernels.common.AdagradRule` (`adagrad_row_update` /
`adagrad_new_values`), which the generic update kernel and its twin both
call, so both give the same bits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb.errors import InputError
from pallas_emb.kernels import common
from pallas_emb.kernels.hparams import AdagradHParams
from pallas_emb.optimizers import base


class RowwiseAdagradState(NamedTuple):
  """row_state: f32 [vocab_rows] accumulators (replicated).

  last_step: int32 [vocab_rows], the step each row was last updated (lazy
    mode only, else None).
  step: int32 scalar, the number of updates applied (skipped ones excluded).
  """
  row_state: jax.Array
  last_step: jax.Array | None
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad(base.SparseOptimizer):
  """Row-wise Adagrad: one f32 accumulator per row, shared by its columns.

  Args:
    learning_rate: a float, or a schedule `step -> lr` (e.g. an optax one).
    eps: added to sqrt(accumulator); finite and > 0.
    initial_accumulator_value: the accumulators' starting value, >= 0.
    half_life_steps: optional accumulator half-life in steps.
    weight_decay: decoupled decay rate per step on rows with a gradient:
      the row is multiplied by exp(-weight_decay).
    lazy: decay a row by the steps since it was last touched (needs a
      half-life or a weight decay) instead of once per touch.
  """
  learning_rate: base.LearningRate
  eps: float = 1e-10
  initial_accumulator_value: float = 0.0
  half_life_steps: float | None = None
  weight_decay: float = 0.0
  lazy: bool = False

  state_type: ClassVar[type] = RowwiseAdagradState
  # §4: a row in the batch without gradient still decays its accumulator.
  updates_zero_rows: ClassVar[bool] = True
  # The kernel's historical name (profiles and tests look for it).
  kernel_name: ClassVar[str] = "pallas_emb_adagrad"

  def __post_init__(self):
    base.check_learning_rate(self)
    base.check_at_least(self, "eps", 0, strict=True)
    base.check_at_least(self, "initial_accumulator_value", 0)
    half_life = self.half_life_steps
    base.check(half_life is None or (base.is_finite_number(half_life)
                                     and half_life > 0), self,
               f"half_life_steps={half_life!r} must be a positive number of "
               "steps (the accumulator decays by exp(-ln2 / "
               "half_life_steps) per step), or None for no decay.")
    base.check(base.is_finite_number(self.weight_decay)
               and self.weight_decay >= 0, self,
               f"weight_decay={self.weight_decay!r} must be finite and >= "
               "0: rows are multiplied by exp(-weight_decay), which must "
               "lie in (0, 1].")
    base.check(math.exp(-self.weight_decay) > 0, self,
               f"weight_decay={self.weight_decay!r} makes the row factor "
               "exp(-weight_decay) underflow to 0; use a smaller weight "
               "decay.")
    # A string such as "False" is truthy: it would silently select lazy.
    base.check(isinstance(self.lazy, (bool, np.bool_)), self,
               f"lazy={self.lazy!r} must be True or False.")
    base.check(not self.lazy or half_life is not None
               or bool(self.weight_decay), self,
               "lazy=True needs half_life_steps or weight_decay: without a "
               "decay there is nothing to apply lazily; use lazy=False.")

  def hparams(self, emb_width: int) -> AdagradHParams:
    """The static constants the kernels use."""
    half_life = self.half_life_steps
    return AdagradHParams(
        eps=float(self.eps),
        inv_width=1.0 / emb_width,
        lazy=bool(self.lazy),
        decay_factor=(1.0 if half_life is None else
                      math.exp(-math.log(2.0) / half_life)),
        weight_decay_factor=math.exp(-self.weight_decay),
        accum_decay_rate=(0.0 if half_life is None else
                          math.log(2.0) / half_life),
        weight_decay_rate=float(self.weight_decay))

  def slots(self):
    row_state = base.Slot("row_state", base.ROW,
                          self.initial_accumulator_value)
    if not self.lazy:
      return (row_state,)
    return (row_state, base.Slot("last_step", base.ROW, 0, jnp.int32))

  def row_update(self, row, row_sq, step, scalars, emb_width):
    return common.AdagradRule(self.hparams(emb_width)).row_update(
        row, row_sq, step, scalars, emb_width)

  def column_update(self, coeffs, values, grad, element, scalars, dtype):
    # The column math reads no constant of the width (only the row's does).
    return common.AdagradRule(self.hparams(emb_width=1)).column_update(
        coeffs, values, grad, element, scalars, dtype)

  def check_state(self, opt_state, table_shape) -> None:
    if (isinstance(opt_state, RowwiseAdagradState)
        and self.lazy != (opt_state.last_step is not None)):
      raise InputError(
          f"pallas_emb RowwiseAdagrad(lazy={self.lazy}) was given the state "
          f"of a lazy={not self.lazy} optimizer; re-create it with "
          "opt.init(ctx, table).")
    super().check_state(opt_state, table_shape)
