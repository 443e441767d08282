"""End of a run: the last update, checkpoint, metrics and their report."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable

import jax

from examples.build import Run
from examples.config import TrainConfig
from examples.evaluation import Evaluator
from examples.loop import fmt_time
from examples.loop import Timing
from examples.loop import UpdateMonitor
from examples.plots import plot_curves
from examples.resume import checkpoint_extra
from examples.resume import next_embeddings
import pallas_emb as pe
from pallas_emb import checkpoint

# Test RMSE of other models on MovieLens-100k, printed beside a run's: the
# Surprise library's benchmark (5-fold cross-validation) and this repo's
# two configs over the random 80/20 splits of split seeds 0-4.
ML100K_RMSE = (
    ("Surprise SVD, 5-fold", "0.934"),
    ("Surprise SVD++, 5-fold", "0.92"),
    ("biased MF (configs/movielens.py), split seeds 0-4", "0.9074 +- 0.0030"),
    ("feature model (configs/movielens_features.py), split seeds 0-4",
     "0.8964 +- 0.0022"),
)
ML100K_RATINGS = 100_000


def finish(run: Run, state: pe.PipelineState, step: int, start: int,
           timing: Timing, evaluator: Evaluator, monitor: UpdateMonitor,
           next_batch: dict, log: Callable[[str], None]) -> dict:
  """Applies the last staged update, saves, evaluates; the metrics dict."""
  config, train_ds = run.config, run.train
  if config.pipelined:  # The last staged update (prefetched is unchanged).
    state, stats = run.trainer.flush(state)
    monitor.check_updates(jax.device_get(stats))
  timed_steps = step - timing.first_step if timing.first is not None else 0
  eval_seconds = evaluator.seconds
  # Training only: without the first (compiling) step and the evaluations.
  throughput = (timed_steps * config.batch_size /
                (timing.end - timing.first - eval_seconds)
                if timed_steps else float("nan"))
  if not evaluator.curve:  # Resumed at or past total_steps: nothing trained.
    evaluator.record(step, state)
  eval_mse = evaluator.curve[-1][1]

  if config.checkpoint_dir and step > start:
    checkpoint.save_collection(
        config.checkpoint_dir, run.collection, state.embedding,
        extra=checkpoint_extra(state, step,
                               next_embeddings(run, state, next_batch)),
        step=step)
    log(f"saved checkpoint {config.checkpoint_dir}/{step}")

  train_seconds = timing.end - timing.start - eval_seconds
  # "test_*" keys, or "val_*" when tuning on a validation split.
  name = run.data.eval_name
  metrics = {
      "config": dataclasses.asdict(config),
      "model": type(run.model).__name__,
      "dataset": train_ds.name.split("/")[0],
      "eval_set": name,
      "train_examples": train_ds.num_examples,
      f"{name}_examples": run.data.evaluate.num_examples,
      "vocab_sizes": dict(train_ds.vocab_sizes),
      "devices": jax.device_count(),
      "platform": jax.devices()[0].platform,
      "processes": jax.process_count(),
      "steps": step,
      "resumed_from_step": start,
      "train_seconds": train_seconds,
      "eval_seconds": eval_seconds,
      "examples_per_sec": throughput if timed_steps else None,
      f"{name}_loss": eval_mse,
      f"{name}_rmse": math.sqrt(eval_mse),
      "label_floor": train_ds.label_floor,
      "skipped_updates": monitor.skipped,
      "train_curve": [{"step": s, "train_mse": v} for s, v in monitor.curve],
      f"{name}_curve": [{"step": s, f"{name}_mse": v}
                        for s, v in evaluator.curve],
  }
  log(f"done: {step} steps in {fmt_time(train_seconds)} "
      f"(+{eval_seconds:.1f}s eval; {throughput:,.0f} examples/s after "
      f"compile); {name}_mse "
      f"{eval_mse:.4f} {name}_rmse {math.sqrt(eval_mse):.4f}"
      + (f" (noise floor {train_ds.label_floor:.4f})"
         if train_ds.label_floor is not None else "")
      + f"; skipped updates {monitor.skipped}.")
  if (config.data == "movielens" and name == "test" and
      train_ds.num_examples + run.data.evaluate.num_examples
      == ML100K_RATINGS):
    log(compare_ml100k(math.sqrt(eval_mse), metrics["model"],
                       config.split_seed))
  return metrics


def compare_ml100k(rmse: float, model: str, split_seed: int) -> str:
  """A run's ML-100k test RMSE beside the published ones (lower is better)."""
  rows = [(f"this run: {model}, split_seed {split_seed}", f"{rmse:.4f}")]
  rows += list(ML100K_RMSE)
  width = max(len(label) for label, _ in rows)
  return "\n".join(["MovieLens-100k test RMSE (lower is better):"] + [
      f"  {label:<{width}}  {value}" for label, value in rows])


class TargetMissed(Exception):
  """The run's test RMSE is above the config's `target_test_rmse`."""


def report(config: TrainConfig, metrics: dict,
           log: Callable[[str], None]) -> None:
  """Writes the metrics JSON and the curves' plot where the config says,
  then raises TargetMissed if the config's target was not reached."""
  if config.metrics_out:
    write_metrics(config.metrics_out, metrics)
    log(f"wrote {config.metrics_out}")
  if config.plot_out:
    log(plot_curves(config.plot_out, metrics))
  check_target(config, metrics, log)


def check_target(config: TrainConfig, metrics: dict,
                 log: Callable[[str], None]) -> None:
  target = config.target_test_rmse
  if not target:
    return
  rmse = metrics["test_rmse"]
  if not rmse <= target:  # NaN misses too
    raise TargetMissed(
        f"test RMSE {rmse:.4f} is above the config's target_test_rmse "
        f"{target}; the run did not reproduce it (check the data, the "
        "config's values and the number of devices).")
  log(f"test RMSE {rmse:.4f} <= target {target}: reproduced.")


def write_metrics(path: str, metrics: dict) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(metrics, f, indent=2, default=float)
