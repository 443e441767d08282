"""The training loop: steps, progress lines, host-side checks of the updates."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import numpy as np

from examples.build import Run
from examples.build import Schedule
from examples.evaluation import Evaluator
from examples.resume import Start
import pallas_emb as pe
from pallas_emb.flax import FlaxTrainer


def fmt_time(seconds: float) -> str:
  """h:mm:ss; "-:--:--" when not known yet (a rate after one step)."""
  if not math.isfinite(seconds):
    return "-:--:--"
  seconds = int(round(max(seconds, 0.0)))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class UpdateMonitor:
  """Host-side checks of the step metrics: overflow guard, skipped updates.

  Steps' metrics collect in a window that is fetched from the devices only
  every few steps (`host_check`), so the loop does not wait on each step.
  """

  def __init__(self, trainer: FlaxTrainer):
    self.window: list = []  # StepMetrics since the last host check
    self.skipped = 0
    self.curve: list[tuple[int, float]] = []  # (step, mean train MSE)
    self._collection = trainer.collection

  def check_updates(self, updates) -> None:
    """Raises on a unique-id overflow; counts skipped (non-finite) updates."""
    self._collection.raise_if_overflow(updates)
    for stats in updates.values():
      self.skipped += int(stats.pending and not stats.valid)

  def host_check(self, step: int) -> float:
    """Checks the window's updates; returns (and records) its mean train MSE."""
    fetched = jax.device_get([(m.aux["mse"], m.updates) for m in self.window])
    for _, updates in fetched:
      self.check_updates(updates)
    self.window.clear()
    mse = float(np.mean([m for m, _ in fetched]))
    self.curve.append((step, mse))
    return mse


@dataclasses.dataclass
class Timing:
  """Wall-clock marks of the loop (perf_counter seconds)."""
  start: float
  end: float = 0.0
  first: float | None = None  # after the first (compiling) step
  first_step: int = 0


def train_loop(run: Run, schedule: Schedule, begin: Start,
               evaluator: Evaluator, monitor: UpdateMonitor,
               log: Callable[[str], None]
               ) -> tuple[pe.PipelineState, int, Timing, dict]:
  """Steps from `begin.step` to `schedule.total_steps`.

  Returns (state, step, timing, the next batch): the stream never ends, so
  the last step prefetches (pipelined) the batch a resumed run starts with.
  Logs progress every `log_every` steps and evaluates every `eval_every`
  steps and after the last one.
  """
  config = run.config
  total_steps, batch_size = schedule.total_steps, config.batch_size
  step_fn = jax.jit(run.trainer.step, donate_argnums=0)
  state, stream, current = begin.state, begin.stream, begin.current
  # XLA:CPU runs each simulated device's part of a program as soon as that
  # device's inputs are ready, so with several steps queued a fast device
  # can enter step t+1's collective while others are still in step t; with
  # few CPU cores the worker pool fills with such waiters and the rendezvous
  # deadlocks ("Expected 8 threads to join the rendezvous"). On CPU we
  # therefore finish each step before dispatching the next (~1 ms/step).
  sync_each_step = (jax.devices()[0].platform == "cpu" and
                    jax.device_count() > 1)

  timing = Timing(start=time.perf_counter())
  step = begin.step
  while step < total_steps:
    following = run.batch(next(stream))
    if config.pipelined:
      state, metrics = step_fn(state, current, following)
    else:
      state, metrics = step_fn(state, current)
    current = following
    monitor.window.append(metrics)
    step += 1
    if sync_each_step:
      jax.block_until_ready(metrics.loss)
    if timing.first is None:
      jax.block_until_ready(metrics.loss)
      timing.first, timing.first_step = time.perf_counter(), step
    if step % config.log_every == 0 or step == total_steps:
      mse = monitor.host_check(step)
      now = time.perf_counter()
      rate = ((step - timing.first_step) * batch_size /
              (now - timing.first - evaluator.seconds)
              if step > timing.first_step else float("nan"))
      eta = ((total_steps - step) * batch_size / rate
             if rate == rate and rate > 0 else 0.0)
      log(f"step {step:>7d}/{total_steps}  train_mse {mse:.4f}  "
          f"{rate:,.0f} ex/s  ETA {fmt_time(eta)}")
    if step % schedule.eval_every == 0 or step == total_steps:
      eval_mse = evaluator.record(step, state)
      name = run.data.eval_name
      log(f"step {step:>7d}  {name}_mse {eval_mse:.4f}  "
          f"{name}_rmse {math.sqrt(eval_mse):.4f}")
  jax.block_until_ready(state)
  timing.end = time.perf_counter()
  return state, step, timing, current
