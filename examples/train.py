"""Train a recommender with sharded tables: the example program.

From the repository root:

    python -m examples.train --config=configs/tiny.py
    python -m examples.train --config=configs/movielens.py --split_seed=3
    python -m examples.train --config=configs/movielens_features.py
    python -m examples.train --config=configs/large.py --help

A config is a python file whose `get_config()` returns a `configs.TrainConfig`
(the biased MF) or an `examples.feature_config.FeaturesConfig` (the feature
model); every field is a flag (`--<field>=value`, see `--help`) defaulting
to the config file's value.

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

`train()` runs the steps in order: load the data, `build` the mesh, model and
trainer, `_initial_state` (init, or restore a checkpoint), `_train_loop`
(with `_UpdateMonitor` for the host-side checks and `_Evaluator` for the
test curve), then `_finish` (the last staged update, checkpoint, metrics,
report). A checkpoint also holds the embeddings the next step consumes, so
a pipelined run resumes exactly where it stopped.

Devices: without a device count in XLA_FLAGS the CPU platform gets 8
simulated devices (set before jax is imported; it does not affect GPUs, and a
GPU host trains over all its GPUs). `--distributed` calls
`jax.distributed.initialize()` and trains over every process's devices; each
process builds the same data stream and feeds its own shards.
"""

from __future__ import annotations

import os
import sys

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _simulate_cpu_devices(count: int = 8) -> None:
  """Gives the CPU platform `count` devices unless XLA_FLAGS already says."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if _DEVICE_COUNT_FLAG not in xla_flags:
    os.environ["XLA_FLAGS"] = (
        f"{xla_flags} {_DEVICE_COUNT_FLAG}={count}".strip())


_simulate_cpu_devices()  # Before jax is imported.

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import dataclasses
import functools
import itertools
import json
import math
import time
from typing import Callable, Iterator

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

import configs
from configs import ConfigError
from configs import TrainConfig
from examples import features as feature_lib
from examples.feature_config import FeaturesConfig
from examples.models import BiasedMF
from examples.models import FEATURES
from examples.models import feature_collection
from examples.models import FeatureMF
from examples.models import IMPLICIT_TABLES
from examples.models import make_loss
from examples.models import SIDE_COMBINERS
from examples.models import TABLE_KEYS
import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import datasets
from pallas_emb.datasets import movielens
from pallas_emb.flax import FlaxTrainer

PROGRAM = "examples.train"

# --- config file + flags -----------------------------------------------------


# The config classes: TrainConfig runs the biased MF, FeaturesConfig the
# feature model (examples/feature_config.py).
CONFIG_CLASSES = {cls.__name__: cls for cls in (TrainConfig, FeaturesConfig)}


def load_config(path: str) -> TrainConfig:
  """`get_config()` of the python file at `path`."""
  config = configs.load_file(path, PROGRAM)
  cls = CONFIG_CLASSES.get(type(config).__name__)
  if cls is None or not dataclasses.is_dataclass(config):
    raise ConfigError(f"{PROGRAM}: {path}: get_config() returned a "
                      f"{type(config).__name__}; expected configs.TrainConfig "
                      "or examples.feature_config.FeaturesConfig.")
  return cls(**dataclasses.asdict(config))


def config_path_from_argv(argv: list[str]) -> str | None:
  """The value of --config in argv (before flags are defined), or None."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "--":
      break
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def define_flags(defaults: TrainConfig,
                 flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """One flag per field of `defaults`'s class, defaulting to its values."""
  flags.DEFINE_string(
      "config", None, "Config file: a python file with get_config() -> "
      "configs.TrainConfig, e.g. configs/tiny.py. Its values are the "
      "defaults of the flags below.", flag_values=flag_values)
  for field in dataclasses.fields(defaults):
    value = getattr(defaults, field.name)
    help_text = field.metadata.get("help", field.name)
    define = (flags.DEFINE_boolean if isinstance(value, bool) else
              flags.DEFINE_integer if isinstance(value, int) else
              flags.DEFINE_float if isinstance(value, float) else
              flags.DEFINE_string)
    define(field.name, value, help_text, flag_values=flag_values)


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS,
                      config_class: type[TrainConfig] = TrainConfig
                      ) -> TrainConfig:
  return config_class(**{f.name: flag_values[f.name].value
                         for f in dataclasses.fields(config_class)})


def parse_config(argv: list[str]) -> TrainConfig:
  """The config `python -m examples.train <argv[1:]>` would run."""
  path = config_path_from_argv(argv)
  flag_values = flags.FlagValues()
  defaults = load_config(path) if path else TrainConfig()
  define_flags(defaults, flag_values)
  rest = flag_values(argv)
  if len(rest) > 1:
    raise ConfigError(f"{PROGRAM}: unexpected arguments {rest[1:]}.")
  return config_from_flags(flag_values, type(defaults))


def check_config(config: TrainConfig) -> None:
  if config.data not in ("synthetic", "movielens"):
    raise ConfigError(f"{PROGRAM}: --data={config.data!r}; expected "
                      "'synthetic' or 'movielens'.")
  if config.table_dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"{PROGRAM}: --table_dtype={config.table_dtype!r};"
                      " expected 'float32' or 'bfloat16'.")
  if config.emb_width < 2:
    raise ConfigError(f"{PROGRAM}: --emb_width={config.emb_width} must "
                      "be >= 2 (factors + the bias column).")
  for name in ("batch_size", "log_every"):
    if getattr(config, name) < 1:
      raise ConfigError(f"{PROGRAM}: --{name}="
                        f"{getattr(config, name)} must be >= 1.")
  for name in ("epochs", "num_steps", "eval_every", "num_unique"):
    if getattr(config, name) < 0:
      raise ConfigError(f"{PROGRAM}: --{name}="
                        f"{getattr(config, name)} must be >= 0.")
  if config.epochs == 0 and config.num_steps == 0:
    raise ConfigError(f"{PROGRAM}: --epochs=0 and --num_steps=0: "
                      "nothing to train.")
  if isinstance(config, FeaturesConfig):
    _check_features_config(config)


def _check_features_config(config: FeaturesConfig) -> None:
  if config.data != "movielens":
    raise ConfigError(f"{PROGRAM}: the feature model reads MovieLens side "
                      f"features; --data={config.data!r} must be 'movielens'.")
  if config.implicit_table not in IMPLICIT_TABLES:
    raise ConfigError(f"{PROGRAM}: --implicit_table={config.implicit_table!r}"
                      f"; expected one of {sorted(IMPLICIT_TABLES)}.")
  if not 0 <= config.validation_fraction < 1:
    raise ConfigError(f"{PROGRAM}: --validation_fraction="
                      f"{config.validation_fraction} must be in [0, 1).")
  for name in ("side_width", "eval_batch_size", "zip_prefix_len",
               "year_bucket", "title_buckets"):
    if getattr(config, name) < 1:
      raise ConfigError(f"{PROGRAM}: --{name}={getattr(config, name)} must "
                        "be >= 1.")
  if config.implicit_max_len < 0:
    raise ConfigError(f"{PROGRAM}: --implicit_max_len="
                      f"{config.implicit_max_len} must be >= 0.")


# --- data --------------------------------------------------------------------


# The validation split of split_seed s is carved from its training split
# with seed VALIDATION_SEED_OFFSET + s.
VALIDATION_SEED_OFFSET = 1000


@dataclasses.dataclass
class _Data:
  """What a run trains and evaluates on.

  `evaluate` is the test split, or (with FeaturesConfig.validation_fraction)
  a validation split carved from the training split; `eval_name` says which.
  `users` / `items`: the MovieLens side features (feature model only).
  """
  train: datasets.Dataset
  evaluate: datasets.Dataset
  eval_name: str = "test"
  users: movielens.SideFeatures | None = None
  items: movielens.SideFeatures | None = None


def _split(dataset: datasets.Dataset, fraction: float, seed: int):
  try:
    return datasets.split(dataset, fraction, seed=seed)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def load_data(config: TrainConfig) -> _Data:
  """Raises datasets.DataError for missing or malformed data."""
  users = items = None
  if isinstance(config, FeaturesConfig):
    dataset, users, items = movielens.load_movielens_features(
        config.data_path or None, zip_prefix_len=config.zip_prefix_len,
        year_bucket=config.year_bucket, title_buckets=config.title_buckets)
  elif config.data == "movielens":
    dataset = datasets.load_movielens(config.data_path or None)
  else:
    dataset = datasets.synthetic(
        config.num_examples, config.num_users, config.num_items,
        rank=config.signal_rank, zipf_exponent=config.zipf_exponent,
        noise_std=config.noise_std, seed=config.data_seed)
  train, test = _split(dataset, config.test_fraction, config.split_seed)
  if getattr(config, "validation_fraction", 0):
    # Tuning: the test split is dropped here and never seen.
    train, val = _split(train, config.validation_fraction,
                        VALIDATION_SEED_OFFSET + config.split_seed)
    return _Data(train, val, "val", users, items)
  return _Data(train, test, "test", users, items)


def _place(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """A global host batch onto the token sharding (each process its shards)."""
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
  return {k: jax.make_array_from_callback(v.shape, sharding,
                                          lambda index, v=v: v[index])
          for k, v in batch.items()}


# --- build: mesh, contexts, model, trainer, schedule -------------------------


def _fmt_time(seconds: float) -> str:
  seconds = int(round(max(seconds, 0.0)))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclasses.dataclass
class _Run:
  """What the program builds from a config."""
  config: TrainConfig
  data: _Data
  mesh: jax.sharding.Mesh
  collection: pe.EmbeddingCollection
  model: BiasedMF | FeatureMF
  trainer: FlaxTrainer
  rating_range: tuple[float, float] | None
  # Arrays every batch carries besides its examples (the feature model's
  # per-entity features): placed once, reused by every step.
  entity_arrays: dict[str, np.ndarray] = dataclasses.field(
      default_factory=dict)
  _placed_entities: dict[str, jax.Array] | None = None

  @property
  def train(self) -> datasets.Dataset:
    return self.data.train

  @property
  def sharding(self) -> jax.sharding.Sharding:
    """Where batches go: the collection's token sharding."""
    return self.collection.token_sharding()

  @property
  def eval_batch_size(self) -> int:
    return getattr(self.config, "eval_batch_size", self.config.batch_size)

  def batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A host rating batch, placed, with the entity arrays."""
    if self._placed_entities is None:
      self._placed_entities = _place(self.entity_arrays, self.sharding)
    return dict(_place(batch, self.sharding), **self._placed_entities)


def _sparse_optimizer(config: TrainConfig, lr: float,
                      weight_decay: float | None = None) -> pe.RowwiseAdagrad:
  return pe.RowwiseAdagrad(
      lr, eps=config.emb_eps,
      initial_accumulator_value=config.emb_initial_accumulator,
      half_life_steps=config.emb_half_life or None,
      weight_decay=(config.emb_weight_decay if weight_decay is None
                    else weight_decay))


def _build_biased_mf(config: TrainConfig, mesh, train_ds: datasets.Dataset,
                     dtype) -> tuple[BiasedMF, pe.EmbeddingCollection]:
  """Two Embed tables (user, item), trained through a collection."""
  # The Embed layers fix the batch size of their contexts; the collection
  # (tables named after the Embeds' module paths) trains them.
  contexts = {
      feature: pe.make_context(
          mesh, "x", tokens_per_batch=config.batch_size,
          emb_width=config.emb_width,
          num_unique=pe.default_num_unique(config.batch_size,
                                           train_ds.vocab_sizes[feature]))
      for feature in FEATURES}
  model = BiasedMF(
      vocab_sizes=dict(train_ds.vocab_sizes), contexts=contexts,
      emb_width=config.emb_width, param_dtype=dtype,
      init_scale=config.init_scale,
      mean=float(np.mean(train_ds.labels)))
  optimizer = _sparse_optimizer(config, config.emb_lr)
  collection = pe.EmbeddingCollection(
      [pe.TableSpec(TABLE_KEYS[f], train_ds.vocab_sizes[f], config.emb_width,
                    optimizer=optimizer, dtype=dtype, padding_id=0,
                    max_unique=config.num_unique or None)
       for f in FEATURES],
      [pe.FeatureSpec(f, TABLE_KEYS[f]) for f in FEATURES], mesh, "x",
      backend=config.backend or None)
  return model, collection


def _build_features(config: FeaturesConfig, mesh, data: _Data, dtype
                    ) -> tuple[FeatureMF, pe.EmbeddingCollection,
                               feature_lib.Featurizer]:
  """The feature model: ids, side features and the implicit bag."""
  train_ds = data.train
  users = data.users if config.user_features else None
  items = data.items if config.item_features else None
  featurizer = feature_lib.Featurizer(
      users, items,
      # From the training split only (without the validation split).
      feature_lib.implicit_bags(train_ds, config.implicit_max_len,
                                seed=config.seed)
      if config.implicit else None,
      implicit_table=IMPLICIT_TABLES[config.implicit_table],
      combiners=SIDE_COMBINERS, multiple=mesh.size)
  collection = feature_collection(
      mesh, vocab_sizes=dict(train_ds.vocab_sizes),
      entity_features=featurizer.features,
      side_vocab_sizes={name: vocab for side in (users, items) if side
                        for name, vocab in side.vocab_sizes.items()},
      emb_width=config.emb_width, side_width=config.side_width,
      id_optimizer=_sparse_optimizer(config, config.emb_lr),
      side_optimizer=_sparse_optimizer(config, config.side_lr),
      implicit_optimizer=_sparse_optimizer(
          config, config.implicit_lr or config.emb_lr,
          config.implicit_weight_decay or None),
      init_scale=config.init_scale, dtype=dtype,
      backend=config.backend or None)
  model = FeatureMF(
      collection, side_features=featurizer.side_features(),
      implicit=featurizer.implicit, l2=config.l2, side_l2=config.side_l2,
      mean=float(np.mean(train_ds.labels)))
  return model, collection, featurizer


def build(config: TrainConfig, data: _Data) -> _Run:
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  dtype = jnp.dtype(config.table_dtype)
  entity_arrays = {}
  if isinstance(config, FeaturesConfig):
    model, collection, featurizer = _build_features(config, mesh, data,
                                                    dtype)
    entity_arrays = featurizer.arrays
    loss = make_loss(1.0)  # FeatureMF's "l2" output is already weighted.
  else:
    model, collection = _build_biased_mf(config, mesh, data.train, dtype)
    loss = make_loss(config.l2)
  trainer = FlaxTrainer(model, collection, loss, optax.adam(config.dense_lr),
                        pipelined=config.pipelined)
  rating_range = None
  if config.data == "movielens":
    rating_range = (float(data.train.labels.min()),
                    float(data.train.labels.max()))
  return _Run(config, data, mesh, collection, model, trainer, rating_range,
              entity_arrays)


@dataclasses.dataclass(frozen=True)
class _Schedule:
  total_steps: int
  eval_every: int


def _schedule(config: TrainConfig, train_ds: datasets.Dataset) -> _Schedule:
  per_epoch = train_ds.num_examples // config.batch_size
  if per_epoch == 0:
    raise ConfigError(f"{PROGRAM}: {train_ds.num_examples} training "
                      f"examples are fewer than --batch_size="
                      f"{config.batch_size}.")
  return _Schedule(total_steps=config.num_steps or config.epochs * per_epoch,
                   eval_every=config.eval_every or per_epoch)


def _describe(run: _Run, schedule: _Schedule) -> str:
  config, train_ds, eval_ds = run.config, run.train, run.data.evaluate
  text = (f"{PROGRAM}: {train_ds.name} ({train_ds.num_examples} train / "
          f"{eval_ds.num_examples} {run.data.eval_name}, vocab "
          f"{dict(train_ds.vocab_sizes)})"
          f" on {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{jax.process_count()} process(es); emb_width {config.emb_width} "
          f"({config.emb_width // jax.device_count()} columns per device), "
          "batch "
          f"{config.batch_size}, {schedule.total_steps} steps, "
          f"{'pipelined' if config.pipelined else 'synchronous'} step.")
  if isinstance(config, FeaturesConfig):
    groups = [name for name, on in (("user side", config.user_features),
                                    ("item side", config.item_features),
                                    ("implicit bag", config.implicit)) if on]
    text += (f"\nFeature model: ids{''.join(' + ' + g for g in groups)}; "
             f"the collection's stacks:\n{run.collection.plan}")
  return text


# --- init or restore ---------------------------------------------------------


def _extra(state: pe.PipelineState, step: int, next_embeddings):
  """What a checkpoint stores besides the collection's logical tables.

  `next_embeddings` are the embeddings the next step consumes (see
  `_next_embeddings`): with them a pipelined run resumes exactly.
  """
  return {"dense_params": state.dense_params,
          "dense_opt_state": state.dense_opt_state, "step": step,
          "next_embeddings": next_embeddings}


def _next_embeddings(run: _Run, state: pe.PipelineState, next_batch):
  """The embeddings of `next_batch` that the next step would consume.

  Pipelined: the state's prefetched lookup, read from the tables before
  the last staged update (which a checkpoint holds applied); synchronous:
  a lookup from the state's tables.
  """
  if run.config.pipelined:
    return state.prefetched.embeddings
  return jax.jit(run.collection.lookup)(state.embedding, next_batch)


def _restore(run: _Run, state: pe.PipelineState, saved: int, first_batch):
  """(state, step) of checkpoint `saved` in config.checkpoint_dir.

  Restored onto `state`'s layout. A pipelined state consumes the saved
  next_embeddings first, as the uninterrupted run would have (nothing is
  staged: the checkpoint's tables hold the last update), so resuming gives
  the same result as not stopping.
  """
  template = _extra(state, 0, _next_embeddings(run, state, first_batch))
  embedding, extra = checkpoint.restore_collection(
      run.config.checkpoint_dir, run.collection, step=saved, extra=template)
  fresh = run.trainer.init_from(
      embedding, extra["dense_params"],
      first_batch if run.config.pipelined else None)
  fresh = fresh._replace(dense_opt_state=extra["dense_opt_state"])
  if run.config.pipelined:
    fresh = fresh._replace(prefetched=fresh.prefetched._replace(
        embeddings=extra["next_embeddings"]))
  return fresh, int(extra["step"])


@dataclasses.dataclass
class _Start:
  """Where the loop starts: the state, the batch stream and its next batch."""
  state: pe.PipelineState
  stream: Iterator[dict[str, np.ndarray]]
  current: dict[str, jax.Array]
  step: int


def _initial_state(run: _Run, log: Callable[[str], None]) -> _Start:
  """Fresh parameters, or the latest checkpoint in config.checkpoint_dir.

  On resume the batch stream continues where the checkpointed run stopped.
  """
  config, trainer = run.config, run.trainer
  stream = datasets.batches(run.train, config.batch_size, seed=config.seed)
  saved = (checkpoint.latest_step(config.checkpoint_dir)
           if config.checkpoint_dir else None)
  if saved is not None:
    stream = itertools.islice(stream, saved, None)
  current = run.batch(next(stream))
  params = jax.jit(run.model.init)(jax.random.key(config.seed),
                                   current)["params"]
  state = trainer.init(params, current if config.pipelined else None)
  del params
  start = 0
  if saved is not None:
    state, start = _restore(run, state, saved, current)
    log(f"resumed from {config.checkpoint_dir} at step {start}")
  return _Start(state, stream, current, start)


# --- the training loop -------------------------------------------------------


def eval_batches(dataset: datasets.Dataset, batch_size: int, multiple: int
                 ) -> Iterator[dict[str, np.ndarray]]:
  """Every example once, in order, in batches of any size.

  Batches of `batch_size` (rounded up to a multiple of `multiple`, the
  device count, which the collection's batches must divide by) and a
  shorter last one, padded with id 0, label 0 and weight 0 only up to a
  multiple of `multiple` (not to `batch_size`: the collection reads the
  batch size per call). Yields {feature: int32[B], "label", "weight"}.
  """
  size = -(-batch_size // multiple) * multiple
  n = dataset.num_examples
  columns = dict(dataset.features, **{datasets.LABEL_KEY: dataset.labels})
  for start in range(0, n, size):
    real = min(size, n - start)
    padded = -(-real // multiple) * multiple
    out = {}
    for key, values in columns.items():
      out[key] = np.full(padded, datasets.PAD_ID, values.dtype)
      out[key][:real] = values[start:start + real]
    out[datasets.WEIGHT_KEY] = (np.arange(padded) < real).astype(np.float32)
    yield out


class _Evaluator:
  """Eval-set MSE of a state (weighted over `eval_batches`); keeps the curve.

  The eval set is the test split, or the validation split when tuning.
  """

  def __init__(self, run: _Run):
    self.run = run
    self.seconds = 0.0  # spent evaluating, left out of the training time
    self.curve: list[tuple[int, float]] = []  # (step, eval MSE)
    trainer, rating_range = run.trainer, run.rating_range
    # FlaxTrainer.flush is jitted (not donating): one compilation serves
    # every evaluation and the last update in _finish.
    self._flush = trainer.flush

    @jax.jit
    def squared_error(state, batch):
      pred = trainer.apply(state, batch)["pred"]
      if rating_range is not None:
        pred = jnp.clip(pred, *rating_range)
      weight = batch[datasets.WEIGHT_KEY]
      return (jnp.sum(weight * (pred - batch[datasets.LABEL_KEY]) ** 2),
              jnp.sum(weight))
    self._squared_error = squared_error

  def __call__(self, state) -> float:
    t0 = time.perf_counter()
    if self.run.config.pipelined:  # Evaluate with the staged update applied.
      state, _ = self._flush(state)
    sq, count = 0.0, 0.0
    for batch in eval_batches(self.run.data.evaluate,
                              self.run.eval_batch_size, self.run.mesh.size):
      s, c = self._squared_error(state, self.run.batch(batch))
      sq, count = sq + float(s), count + float(c)
    self.seconds += time.perf_counter() - t0
    return sq / count

  def record(self, step: int, state) -> float:
    """Evaluates and appends (step, eval MSE) to the curve."""
    self.curve.append((step, self(state)))
    return self.curve[-1][1]


class _UpdateMonitor:
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
class _Timing:
  """Wall-clock marks of the loop (perf_counter seconds)."""
  start: float
  end: float = 0.0
  first: float | None = None  # after the first (compiling) step
  first_step: int = 0


def _train_loop(run: _Run, schedule: _Schedule, begin: _Start,
                evaluator: _Evaluator, monitor: _UpdateMonitor,
                log: Callable[[str], None]
                ) -> tuple[pe.PipelineState, int, _Timing, dict]:
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

  timing = _Timing(start=time.perf_counter())
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
          f"{rate:,.0f} ex/s  ETA {_fmt_time(eta)}")
    if step % schedule.eval_every == 0 or step == total_steps:
      eval_mse = evaluator.record(step, state)
      name = run.data.eval_name
      log(f"step {step:>7d}  {name}_mse {eval_mse:.4f}  "
          f"{name}_rmse {math.sqrt(eval_mse):.4f}")
  jax.block_until_ready(state)
  timing.end = time.perf_counter()
  return state, step, timing, current


# --- finish: last update, checkpoint, metrics, report ------------------------


def _finish(run: _Run, state: pe.PipelineState, step: int, start: int,
            timing: _Timing, evaluator: _Evaluator, monitor: _UpdateMonitor,
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
        extra=_extra(state, step, _next_embeddings(run, state, next_batch)),
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
  log(f"done: {step} steps in {_fmt_time(train_seconds)} "
      f"(+{eval_seconds:.1f}s eval; {throughput:,.0f} examples/s after "
      f"compile); {name}_mse "
      f"{eval_mse:.4f} {name}_rmse {math.sqrt(eval_mse):.4f}"
      + (f" (noise floor {train_ds.label_floor:.4f})"
         if train_ds.label_floor is not None else "")
      + f"; skipped updates {monitor.skipped}.")
  return metrics


def _report(config: TrainConfig, metrics: dict,
            log: Callable[[str], None]) -> None:
  """Writes the metrics JSON and the curves' plot where the config says."""
  if config.metrics_out:
    write_metrics(config.metrics_out, metrics)
    log(f"wrote {config.metrics_out}")
  if config.plot_out:
    log(plot_curves(config.plot_out, metrics))


def train(config: TrainConfig, log: Callable[[str], None] = print) -> dict:
  """Trains and evaluates one config; returns the metrics dict.

  Raises datasets.DataError (bad or missing data), ConfigError and the
  library's ValueErrors (pallas_emb.ShardingError, ...) for configs that
  cannot run.
  """
  check_config(config)
  run = build(config, load_data(config))
  is_main = jax.process_index() == 0
  log = log if is_main else (lambda _: None)
  schedule = _schedule(config, run.train)
  log(_describe(run, schedule))

  begin = _initial_state(run, log)
  evaluator = _Evaluator(run)
  monitor = _UpdateMonitor(run.trainer)
  state, step, timing, next_batch = _train_loop(run, schedule, begin,
                                                evaluator, monitor, log)
  metrics = _finish(run, state, step, begin.step, timing, evaluator, monitor,
                    next_batch, log)
  if is_main:
    _report(config, metrics, log)
  return metrics


def write_metrics(path: str, metrics: dict) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(metrics, f, indent=2, default=float)


def plot_curves(path: str, metrics: dict) -> str:
  """Draws the train/eval MSE curves into `path`; returns a status line."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return (f"matplotlib is not installed, so no plot was written to {path} "
            "(pip install matplotlib).")
  fig, ax = plt.subplots(figsize=(6, 4))
  eval_name = metrics.get("eval_set", "test")
  for name in ("train", eval_name):
    points = metrics[f"{name}_curve"]
    ax.plot([p["step"] for p in points], [p[f"{name}_mse"] for p in points],
            marker="." if name != "train" else None, label=f"{name} MSE")
  if metrics.get("label_floor") is not None:
    ax.axhline(metrics["label_floor"], color="gray", ls=":",
               label="noise floor")
  ax.set_xlabel("step")
  ax.set_ylabel("MSE")
  title = f"{metrics['dataset']}: {eval_name} RMSE " \
      f"{metrics[f'{eval_name}_rmse']:.4f}"
  if metrics.get("model", "BiasedMF") != "BiasedMF":
    title += f" ({metrics['model']})"
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return f"wrote {path}"


# --- entry point -------------------------------------------------------------

_ERRORS = (datasets.DataError, ConfigError, pe.ShardingError,
           pe.HyperParameterError, checkpoint.CheckpointError)


def initialize_distributed(config: TrainConfig) -> None:
  """`jax.distributed.initialize` from the config ('' / 0 / -1: auto)."""
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    # Cross-process collectives of CPU devices; GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  if config.coordinator_address:
    kwargs["coordinator_address"] = config.coordinator_address
  if config.num_processes:
    kwargs["num_processes"] = config.num_processes
  if config.process_id >= 0:
    kwargs["process_id"] = config.process_id
  jax.distributed.initialize(**kwargs)


def _main(argv: list[str], config_class: type[TrainConfig] = TrainConfig
          ) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = config_from_flags(flags.FLAGS, config_class)
  if not flags.FLAGS["verbosity"].present:
    # Quiet the INFO chatter of jax and orbax; --verbosity=0 brings it back.
    logging.set_verbosity(logging.WARNING)
  try:
    if config.distributed:
      initialize_distributed(config)
    train(config)
  except _ERRORS as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv if argv is None else argv)
  path = config_path_from_argv(argv)
  try:
    defaults = load_config(path) if path else TrainConfig()
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  define_flags(defaults)
  app.run(functools.partial(_main, config_class=type(defaults)), argv=argv)


if __name__ == "__main__":
  main()
