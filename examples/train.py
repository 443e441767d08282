"""Train a recommender with sharded tables: the example program.

From the repository root:

    python -m examples.train --config=configs/movielens_features.py
    python -m examples.train --config=configs/movielens.py --split_seed=3
    python -m examples.train --config=configs/tiny.py
    python -m examples.train --config=configs/large.py --help

A config is a python file whose `get_config()` returns an
`examples.config.TrainConfig` (the biased MF), `FeaturesConfig` (the
feature model) or `SeqRecConfig` (next-item prediction on MovieLens-1M,
examples/seqrec: `--config=configs/movielens_1m.py`); every field is a
flag (`--<field>=value`, see `--help`) defaulting to the config file's
value. MovieLens-100k is downloaded into
~/.cache/pallas_emb on first use (the recbole 1.2.1 wheel, by pip).

The biased MF (`examples/models.py` `BiasedMF`): two `pallas_emb.flax.Embed`
tables (user, item) column-sharded over a 1-D mesh axis "x" of all devices,
and `pred = mu + <p_u, q_i> + b_u + b_i`, where the bias of each row is its
last column. The feature model (`FeatureMF`, MovieLens only) adds user and
item side features and an SVD++ implicit-feedback bag, all through one
`pallas_emb.flax.EmbeddingCollection` (tables in three stacks, bags pooled
per user / item: examples/features.py). The tables train with the fused
sparse `RowwiseAdagrad` through the pipelined (one-step-stale) step of
`pallas_emb.Trainer`, via `pallas_emb.flax.FlaxTrainer`; the dense params
(`mu`, the side features' projections) with optax Adam. Test predictions of
rating data are clipped to the rating range seen in training (as Surprise
does). With `--validation_fraction` the feature model trains on part of the
training split and evaluates on the rest (for tuning; test is never read).

`train()` runs the steps in order, one module each: the command line
(cli.py) and config (config.py), the data (data.py), `build` the mesh,
model and trainer (build.py), init or restore a checkpoint (resume.py),
the loop (loop.py, with evaluation.py for the test curve), then the last
staged update, checkpoint, metrics and report (report.py, plots.py).
startup.py sets the devices up. A checkpoint also holds the embeddings the
next step consumes, so a pipelined run resumes exactly where it stopped.

Devices: without a device count in XLA_FLAGS the CPU platform gets 8
simulated devices (set before jax is imported; it does not affect GPUs, and a
GPU host trains over all its GPUs). `--distributed` calls
`jax.distributed.initialize()` and trains over every process's devices; each
process builds the same data stream and feeds its own shards.
"""

from __future__ import annotations

from examples import startup

startup.simulate_cpu_devices()  # Before jax is imported.

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import functools
import os
import sys
from typing import Callable

from absl import app
from absl import flags
from absl import logging
import jax

from examples import build as build_lib
from examples import cli
from examples import data as data_lib
from examples import evaluation
from examples import loop
from examples import plots
from examples import report
from examples import resume
from examples.config import ConfigError
from examples.config import load_config
from examples.config import SeqRecConfig
from examples.config import TrainConfig
from examples.seqrec import run as seqrec
import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import datasets


def train(config: TrainConfig | SeqRecConfig,
          log: Callable[[str], None] = print) -> dict:
  """Trains and evaluates one config; returns the metrics dict.

  Raises datasets.DataError (bad or missing data), ConfigError and the
  library's ValueErrors (pallas_emb.ShardingError, ...) for configs that
  cannot run.
  """
  if isinstance(config, SeqRecConfig):
    metrics = seqrec.train(config, log)
    if jax.process_index() == 0:
      if config.metrics_out:
        report.write_metrics(config.metrics_out, metrics)
        log(f"wrote {config.metrics_out}")
      plot = config.plot_out or (
          os.path.splitext(config.metrics_out)[0] + ".png"
          if config.metrics_out else "")
      if plot:
        log(plots.plot_seqrec(plot, metrics))
    return metrics
  _, _, metrics = run_training(config, log)
  if jax.process_index() == 0:
    report.report(config, metrics, log)
  return metrics


def run_training(config: TrainConfig, log: Callable[[str], None] = print
                 ) -> tuple[build_lib.Run, pe.PipelineState, dict]:
  """`(run, state, metrics)`: `train` without the report. The state is the
  loop's last (pipelined: its last update still staged, which
  `run.trainer.flush` applies; the metrics evaluated it flushed)."""
  cli.check_config(config)
  run = build_lib.build(config, data_lib.load_data(config))
  is_main = jax.process_index() == 0
  log = log if is_main else (lambda _: None)
  schedule = build_lib.schedule(config, run.train)
  log(build_lib.describe(run, schedule))

  begin = resume.initial_state(run, log)
  evaluator = evaluation.Evaluator(run)
  monitor = loop.UpdateMonitor(run.trainer)
  state, step, timing, next_batch = loop.train_loop(run, schedule, begin,
                                                    evaluator, monitor, log)
  metrics = report.finish(run, state, step, begin.step, timing, evaluator,
                          monitor, next_batch, log)
  return run, state, metrics


# --- entry point -------------------------------------------------------------

ERRORS = (datasets.DataError, ConfigError, pe.ShardingError,
          pe.HyperParameterError, checkpoint.CheckpointError,
          report.TargetMissed)


def _main(argv: list[str], config_class: type[TrainConfig] = TrainConfig,
          program: Callable[[TrainConfig], object] | None = None) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = cli.config_from_flags(flags.FLAGS, config_class)
  if not flags.FLAGS["verbosity"].present:
    # Quiet the INFO chatter of jax and orbax; --verbosity=0 brings it back.
    logging.set_verbosity(logging.WARNING)
  try:
    if getattr(config, "distributed", False):  # SeqRecConfig has none
      startup.initialize_distributed(config)
    (program or train)(config)
  except ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


def main(argv: list[str] | None = None,
         program: Callable[[TrainConfig], object] | None = None) -> None:
  """Parses the config and flags, then runs `program(config)` (default:
  `train`; examples.serve passes its own)."""
  argv = list(sys.argv if argv is None else argv)
  path = cli.config_path_from_argv(argv)
  try:
    defaults = load_config(path) if path else TrainConfig()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  cli.define_flags(defaults)
  # The flags live in examples/cli.py; --help lists them as this program's.
  flags.adopt_module_key_flags(cli)
  app.run(functools.partial(_main, config_class=type(defaults),
                            program=program), argv=argv)


if __name__ == "__main__":
  main()
