"""Static hyper-parameters of the row-wise Adagrad kernels."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AdagradHParams:
  """The derived constants of row-wise Adagrad (Python floats, static).

  eager: `factor = decay_factor`, `wd = weight_decay_factor` on rows with a
  gradient. lazy: `factor = exp(-accum_decay_rate * delta)`,
  `wd = exp(-weight_decay_rate * delta)` with `delta = max(0, step -
  last_step[t])`, each exp by `common.decay_exp` (the same bits on every
  platform). The learning rate is a traced argument (schedules).
  """
  eps: float
  inv_width: float  # 1 / emb_width (the full width, not the shard's)
  lazy: bool = False
  decay_factor: float = 1.0
  weight_decay_factor: float = 1.0
  accum_decay_rate: float = 0.0
  weight_decay_rate: float = 0.0

  @property
  def decays_weights(self) -> bool:
    """Whether any row's values are multiplied by a weight decay."""
    if self.lazy:
      return self.weight_decay_rate != 0
    return self.weight_decay_factor != 1
