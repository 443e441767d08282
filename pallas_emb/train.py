"""Train a biased matrix factorisation with sharded tables: the training binary.

    python -m pallas_emb.train --config=configs/tiny.py
    python -m pallas_emb.train --config=configs/movielens.py --split_seed=3
    python -m pallas_emb.train --config=configs/large.py --help

A config is a python file whose `get_config()` returns a `configs.TrainConfig`;
every field is a flag (`--<field>=value`, see `--help`) defaulting to the
config file's value.

The model: two `pallas_emb.flax.Embed` tables (user, item) column-sharded over
a 1-D mesh axis "x" of all devices, and
`pred = mu + <p_u, q_i> + b_u + b_i`, where the bias of each row is its last
column (so no width-1 table is needed). The tables train with the fused
sparse `RowwiseAdagrad` through the pipelined (one-step-stale) step of
`pallas_emb.Trainer`, via `pallas_emb.layers.training.FlaxTrainer`; `mu` with
optax Adam. Test predictions of rating data are clipped to the rating range
seen in training (as Surprise does).

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

# pylint: disable=g-import-not-at-top,g-bad-import-order
import dataclasses
import importlib.util
import itertools
import json
import math
import time
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pallas_emb as pe
from pallas_emb import checkpoint
from pallas_emb import data
from pallas_emb import flax as pe_flax
from pallas_emb import pipeline
from pallas_emb.layers.training import FlaxTrainer

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_configs():
  """The `configs` package (TrainConfig), from the repo next to pallas_emb."""
  try:
    import configs  # pylint: disable=import-outside-toplevel
  except ImportError:
    sys.path.insert(0, _REPO_ROOT)
    import configs  # pylint: disable=import-outside-toplevel
  return configs


TrainConfig = _import_configs().TrainConfig

FEATURES = ("user", "item")
TABLE_KEYS = {"user": "user_embed", "item": "item_embed"}


class ConfigError(ValueError):
  """A config that cannot be run (bad file, bad value)."""


# --- config file + flags -----------------------------------------------------


def load_config(path: str) -> TrainConfig:
  """`get_config()` of the python file at `path`."""
  if not os.path.isfile(path):
    raise ConfigError(f"pallas_emb.train: config file {path!r} does not exist; "
                      "pass e.g. --config=configs/tiny.py.")
  # A config in <root>/configs/ imports `configs` from <root>.
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if os.path.isfile(os.path.join(root, "configs", "__init__.py")) and \
      root not in sys.path:
    sys.path.insert(0, root)
  spec = importlib.util.spec_from_file_location("_pallas_emb_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"pallas_emb.train: config file {path!r} defines no "
                      "get_config() returning a configs.TrainConfig.")
  config = module.get_config()
  if type(config).__name__ != "TrainConfig" or not dataclasses.is_dataclass(
      config):
    raise ConfigError(f"pallas_emb.train: {path}: get_config() returned a "
                      f"{type(config).__name__}; expected configs.TrainConfig.")
  return TrainConfig(**dataclasses.asdict(config))


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
  """One flag per TrainConfig field, defaulting to `defaults`'s values."""
  flags.DEFINE_string(
      "config", None, "Config file: a python file with get_config() -> "
      "configs.TrainConfig, e.g. configs/tiny.py. Its values are the "
      "defaults of the flags below.", flag_values=flag_values)
  for field in dataclasses.fields(TrainConfig):
    value = getattr(defaults, field.name)
    help_text = field.metadata.get("help", field.name)
    define = (flags.DEFINE_boolean if isinstance(value, bool) else
              flags.DEFINE_integer if isinstance(value, int) else
              flags.DEFINE_float if isinstance(value, float) else
              flags.DEFINE_string)
    define(field.name, value, help_text, flag_values=flag_values)


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS
                      ) -> TrainConfig:
  return TrainConfig(**{f.name: flag_values[f.name].value
                        for f in dataclasses.fields(TrainConfig)})


def parse_config(argv: list[str]) -> TrainConfig:
  """The config `python -m pallas_emb.train <argv[1:]>` would run."""
  path = config_path_from_argv(argv)
  flag_values = flags.FlagValues()
  define_flags(load_config(path) if path else TrainConfig(), flag_values)
  rest = flag_values(argv)
  if len(rest) > 1:
    raise ConfigError(f"pallas_emb.train: unexpected arguments {rest[1:]}.")
  return config_from_flags(flag_values)


def check_config(config: TrainConfig) -> None:
  if config.data not in ("synthetic", "movielens"):
    raise ConfigError(f"pallas_emb.train: --data={config.data!r}; expected "
                      "'synthetic' or 'movielens'.")
  if config.table_dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"pallas_emb.train: --table_dtype={config.table_dtype!r};"
                      " expected 'float32' or 'bfloat16'.")
  if config.emb_width < 2:
    raise ConfigError(f"pallas_emb.train: --emb_width={config.emb_width} must "
                      "be >= 2 (factors + the bias column).")
  for name in ("batch_size", "log_every"):
    if getattr(config, name) < 1:
      raise ConfigError(f"pallas_emb.train: --{name}="
                        f"{getattr(config, name)} must be >= 1.")
  for name in ("epochs", "num_steps", "eval_every", "num_unique"):
    if getattr(config, name) < 0:
      raise ConfigError(f"pallas_emb.train: --{name}="
                        f"{getattr(config, name)} must be >= 0.")
  if config.epochs == 0 and config.num_steps == 0:
    raise ConfigError("pallas_emb.train: --epochs=0 and --num_steps=0: "
                      "nothing to train.")


# --- data --------------------------------------------------------------------


def load_data(config: TrainConfig) -> tuple[data.Dataset, data.Dataset]:
  """(train, test); raises data.DataError for missing or malformed data."""
  if config.data == "movielens":
    dataset = data.load_movielens(config.data_path or None)
  else:
    dataset = data.synthetic(
        config.num_examples, config.num_users, config.num_items,
        rank=config.signal_rank, zipf_exponent=config.zipf_exponent,
        noise_std=config.noise_std, seed=config.data_seed)
  try:
    return data.split(dataset, config.test_fraction, seed=config.split_seed)
  except ValueError as e:
    raise ConfigError(str(e)) from e


def _place(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """A global host batch onto the token sharding (each process its shards)."""
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
  return {k: jax.make_array_from_callback(v.shape, sharding,
                                          lambda index, v=v: v[index])
          for k, v in batch.items()}


# --- the model ---------------------------------------------------------------


def _factor_init(scale: float):
  """Normal(0, scale) factor columns; the last (bias) column starts at 0."""
  def init(key, shape, dtype=jnp.float32):
    x = jax.random.normal(key, shape, jnp.float32) * scale
    return x.at[:, -1].set(0.0).astype(dtype)
  return init


class BiasedMF(nn.Module):
  """pred = mu + <p_u, q_i> + b_u + b_i; b_* is the last column of each row.

  Returns {"pred": [B], "l2": [B] squared norm of the two looked-up rows}.
  """
  vocab_sizes: dict[str, int]
  contexts: dict[str, pe.EmbeddingContext]
  emb_width: int
  param_dtype: Any = jnp.float32
  init_scale: float = 0.1
  mean: float = 0.0

  @nn.compact
  def __call__(self, batch):
    rows = {}
    for feature in FEATURES:
      rows[feature] = pe_flax.Embed(
          self.vocab_sizes[feature], self.emb_width, self.contexts[feature],
          param_dtype=self.param_dtype,
          embedding_init=_factor_init(self.init_scale),
          name=TABLE_KEYS[feature])(batch[feature]).astype(jnp.float32)
    mu = self.param("mu", nn.initializers.constant(self.mean), (),
                    jnp.float32)
    u, v = rows["user"], rows["item"]
    pred = (mu + jnp.sum(u[:, :-1] * v[:, :-1], axis=-1) + u[:, -1] +
            v[:, -1])
    l2 = jnp.sum(u * u, axis=-1) + jnp.sum(v * v, axis=-1)
    return {"pred": pred, "l2": l2}


def make_loss(l2: float) -> Callable:
  def loss(outputs, batch):
    mse = jnp.mean((outputs["pred"] - batch[data.LABEL_KEY]) ** 2)
    total = mse + l2 * jnp.mean(outputs["l2"]) if l2 else mse
    return total, {"mse": mse}
  return loss


# --- training ----------------------------------------------------------------


def _fmt_time(seconds: float) -> str:
  seconds = int(round(max(seconds, 0.0)))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclasses.dataclass
class _Run:
  """What the binary builds from a config."""
  config: TrainConfig
  train: data.Dataset
  test: data.Dataset
  mesh: jax.sharding.Mesh
  contexts: dict[str, pe.EmbeddingContext]
  model: BiasedMF
  trainer: FlaxTrainer
  rating_range: tuple[float, float] | None


def build(config: TrainConfig, train_ds: data.Dataset,
          test_ds: data.Dataset) -> _Run:
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  contexts = {}
  for feature in FEATURES:
    vocab = train_ds.vocab_sizes[feature]
    contexts[feature] = pe.make_context(
        mesh, "x", tokens_per_batch=config.batch_size,
        emb_width=config.emb_width,
        num_unique=config.num_unique or pe.default_num_unique(
            config.batch_size, vocab))
  model = BiasedMF(
      vocab_sizes=dict(train_ds.vocab_sizes), contexts=contexts,
      emb_width=config.emb_width,
      param_dtype=jnp.dtype(config.table_dtype),
      init_scale=config.init_scale,
      mean=float(np.mean(train_ds.labels)))
  optimizer = pe.RowwiseAdagrad(
      config.emb_lr, eps=config.emb_eps,
      initial_accumulator_value=config.emb_initial_accumulator,
      half_life_steps=config.emb_half_life or None,
      weight_decay=config.emb_weight_decay)
  tables = {TABLE_KEYS[f]: pe.TableSpec(contexts[f], optimizer, f)
            for f in FEATURES}
  trainer = FlaxTrainer(model, tables, make_loss(config.l2),
                        optax.adam(config.dense_lr),
                        pipelined=config.pipelined,
                        backend=config.backend or None)
  rating_range = None
  if config.data == "movielens":
    rating_range = (float(train_ds.labels.min()),
                    float(train_ds.labels.max()))
  return _Run(config, train_ds, test_ds, mesh, contexts, model, trainer,
              rating_range)


def _checkpoint_tree(state: pe.PipelineState, step: int):
  return {"tables": {k: {"table": t.table, "opt_state": t.opt_state}
                     for k, t in state.tables.items()},
          "dense_params": state.dense_params,
          "dense_opt_state": state.dense_opt_state,
          "step": step}


def _restore(run: _Run, state: pe.PipelineState, saved: int, first_batch):
  """(state, step) of checkpoint `saved` in config.checkpoint_dir.

  Restored onto `state`'s layout; a pipelined state re-issues the lookup of
  `first_batch` from the restored tables (nothing is staged).
  """
  directory = run.config.checkpoint_dir
  tree = checkpoint.restore(directory, _checkpoint_tree(state, 0), step=saved)
  tables = {k: t["table"] for k, t in tree["tables"].items()}
  fresh = run.trainer.init_from(tables, tree["dense_params"], first_batch)
  state = fresh._replace(
      tables={k: pipeline.TableState(tables[k], t["opt_state"])
              for k, t in tree["tables"].items()},
      dense_opt_state=tree["dense_opt_state"])
  return state, int(tree["step"])


def train(config: TrainConfig, log: Callable[[str], None] = print) -> dict:
  """Trains and evaluates one config; returns the metrics dict.

  Raises data.DataError (bad or missing data), ConfigError and the library's
  ValueErrors (pallas_emb.ShardingError, ...) for configs that cannot run.
  """
  check_config(config)
  train_ds, test_ds = load_data(config)
  run = build(config, train_ds, test_ds)
  trainer = run.trainer
  sharding = pe.token_sharding(run.contexts["user"])
  is_main = jax.process_index() == 0
  log = log if is_main else (lambda _: None)

  batch_size = config.batch_size
  per_epoch = train_ds.num_examples // batch_size
  if per_epoch == 0:
    raise ConfigError(f"pallas_emb.train: {train_ds.num_examples} training "
                      f"examples are fewer than --batch_size={batch_size}.")
  total_steps = config.num_steps or config.epochs * per_epoch
  eval_every = config.eval_every or per_epoch
  platform = jax.devices()[0].platform
  log(f"pallas_emb.train: {train_ds.name} ({train_ds.num_examples} train / "
      f"{test_ds.num_examples} test, vocab {dict(train_ds.vocab_sizes)}) on "
      f"{jax.device_count()} {platform} device(s), "
      f"{jax.process_count()} process(es); emb_width {config.emb_width} "
      f"({run.contexts['user'].shard_width} columns per device), batch "
      f"{batch_size}, {total_steps} steps, "
      f"{'pipelined' if config.pipelined else 'synchronous'} step.")

  stream = data.batches(train_ds, batch_size, seed=config.seed)
  init_batch = {f: np.zeros(batch_size, np.int32) for f in FEATURES}
  params = jax.jit(run.model.init)(jax.random.key(config.seed),
                                   _place(init_batch, sharding))["params"]

  # Resume: the batch stream continues where the checkpointed run stopped.
  saved = (checkpoint.latest_step(config.checkpoint_dir)
           if config.checkpoint_dir else None)
  if saved is not None:
    stream = itertools.islice(stream, saved, None)
  current = _place(next(stream), sharding)
  first_batch = current if config.pipelined else None
  state = trainer.init(params, first_batch)
  del params
  start = 0
  if saved is not None:
    state, start = _restore(run, state, saved, first_batch)
    log(f"resumed from {config.checkpoint_dir} at step {start}")

  step_fn = jax.jit(trainer.step, donate_argnums=0)
  flush_fn = jax.jit(trainer.flush)

  @jax.jit
  def eval_fn(state, batch):
    pred = trainer.apply(state, batch)["pred"]
    if run.rating_range is not None:
      pred = jnp.clip(pred, *run.rating_range)
    weight = batch[data.WEIGHT_KEY]
    return (jnp.sum(weight * (pred - batch[data.LABEL_KEY]) ** 2),
            jnp.sum(weight))

  eval_seconds = 0.0

  def evaluate(state) -> float:
    nonlocal eval_seconds
    t0 = time.perf_counter()
    if config.pipelined:  # Evaluate with the staged update applied.
      state, _ = flush_fn(state)
    sq, count = 0.0, 0.0
    for batch in data.eval_batches(test_ds, batch_size):
      s, c = eval_fn(state, _place(batch, sharding))
      sq, count = sq + float(s), count + float(c)
    eval_seconds += time.perf_counter() - t0
    return sq / count

  train_curve, test_curve = [], []
  window: list = []  # StepMetrics since the last host check
  skipped = 0
  overflow_guard = {k: spec.ctx.num_unique
                    for k, spec in trainer.tables.items()}

  def check_updates(updates) -> None:
    """Host-side overflow guard; counts skipped (non-finite) updates."""
    nonlocal skipped
    for key, stats in updates.items():
      pe.raise_if_overflow(stats.num_overflow,
                           overflow_guard[key] + stats.num_overflow,
                           overflow_guard[key])
      skipped += int(stats.pending and not stats.valid)

  def host_check(step: int) -> float:
    """Checks the window's updates; returns (and records) its mean train MSE."""
    fetched = jax.device_get([(m.aux["mse"], m.updates) for m in window])
    for _, updates in fetched:
      check_updates(updates)
    window.clear()
    mse = float(np.mean([m for m, _ in fetched]))
    train_curve.append((step, mse))
    return mse

  # XLA:CPU runs each simulated device's part of a program as soon as that
  # device's inputs are ready, so with several steps queued a fast device
  # can enter step t+1's collective while others are still in step t; with
  # few CPU cores the worker pool fills with such waiters and the rendezvous
  # deadlocks ("Expected 8 threads to join the rendezvous"). On CPU we
  # therefore finish each step before dispatching the next (~1 ms/step).
  sync_each_step = platform == "cpu" and jax.device_count() > 1

  t_start = time.perf_counter()
  t_first = None  # after the first (compiling) step
  step = start
  while step < total_steps:
    if config.pipelined:
      following = (_place(next(stream), sharding) if step + 1 < total_steps
                   else current)
      state, metrics = step_fn(state, current, following)
      current = following
    else:
      state, metrics = step_fn(state, current)
      if step + 1 < total_steps:
        current = _place(next(stream), sharding)
    window.append(metrics)
    step += 1
    if sync_each_step:
      jax.block_until_ready(metrics.loss)
    if t_first is None:
      jax.block_until_ready(metrics.loss)
      t_first, first_step = time.perf_counter(), step
    if step % config.log_every == 0 or step == total_steps:
      mse = host_check(step)
      now = time.perf_counter()
      rate = ((step - first_step) * batch_size /
              (now - t_first - eval_seconds)
              if step > first_step else float("nan"))
      eta = ((total_steps - step) * batch_size / rate
             if rate == rate and rate > 0 else 0.0)
      log(f"step {step:>7d}/{total_steps}  train_mse {mse:.4f}  "
          f"{rate:,.0f} ex/s  ETA {_fmt_time(eta)}")
    if step % eval_every == 0 or step == total_steps:
      test_curve.append((step, evaluate(state)))
      log(f"step {step:>7d}  test_mse {test_curve[-1][1]:.4f}  "
          f"test_rmse {math.sqrt(test_curve[-1][1]):.4f}")
  jax.block_until_ready(state)
  t_end = time.perf_counter()
  if config.pipelined:  # The last staged update.
    state, stats = jax.jit(trainer.flush, donate_argnums=0)(state)
    check_updates(jax.device_get(stats))
  timed_steps = step - first_step if t_first is not None else 0
  # Training only: without the first (compiling) step and the evaluations.
  throughput = (timed_steps * batch_size /
                (t_end - t_first - eval_seconds)
                if timed_steps else float("nan"))
  if not test_curve:  # Resumed at or past total_steps: nothing trained.
    test_curve.append((step, evaluate(state)))
  test_mse = test_curve[-1][1]

  if config.checkpoint_dir and step > start:
    checkpoint.save(config.checkpoint_dir, _checkpoint_tree(state, step),
                    step=step)
    log(f"saved checkpoint {config.checkpoint_dir}/{step}")

  metrics = {
      "config": dataclasses.asdict(config),
      "dataset": train_ds.name.split("/")[0],
      "train_examples": train_ds.num_examples,
      "test_examples": test_ds.num_examples,
      "vocab_sizes": dict(train_ds.vocab_sizes),
      "devices": jax.device_count(),
      "platform": platform,
      "processes": jax.process_count(),
      "steps": step,
      "resumed_from_step": start,
      "train_seconds": t_end - t_start - eval_seconds,
      "eval_seconds": eval_seconds,
      "examples_per_sec": throughput if timed_steps else None,
      "test_loss": test_mse,
      "test_rmse": math.sqrt(test_mse),
      "label_floor": train_ds.label_floor,
      "skipped_updates": skipped,
      "train_curve": [{"step": s, "train_mse": v} for s, v in train_curve],
      "test_curve": [{"step": s, "test_mse": v} for s, v in test_curve],
  }
  log(f"done: {step} steps in {_fmt_time(t_end - t_start - eval_seconds)} "
      f"(+{eval_seconds:.1f}s eval; {throughput:,.0f} examples/s after "
      f"compile); test_mse "
      f"{test_mse:.4f} test_rmse {math.sqrt(test_mse):.4f}"
      + (f" (noise floor {train_ds.label_floor:.4f})"
         if train_ds.label_floor is not None else "")
      + f"; skipped updates {skipped}.")
  if is_main and config.metrics_out:
    write_metrics(config.metrics_out, metrics)
    log(f"wrote {config.metrics_out}")
  if is_main and config.plot_out:
    log(plot_curves(config.plot_out, metrics))
  return metrics


def write_metrics(path: str, metrics: dict) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(metrics, f, indent=2, default=float)


def plot_curves(path: str, metrics: dict) -> str:
  """Draws the train/test MSE curves into `path`; returns a status line."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return (f"matplotlib is not installed, so no plot was written to {path} "
            "(pip install matplotlib).")
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, key in (("train", "train_curve"), ("test", "test_curve")):
    points = metrics[key]
    ax.plot([p["step"] for p in points], [p[f"{name}_mse"] for p in points],
            marker="." if name == "test" else None, label=f"{name} MSE")
  if metrics.get("label_floor") is not None:
    ax.axhline(metrics["label_floor"], color="gray", ls=":",
               label="noise floor")
  ax.set_xlabel("step")
  ax.set_ylabel("MSE")
  ax.set_title(f"{metrics['dataset']}: test RMSE {metrics['test_rmse']:.4f}")
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return f"wrote {path}"


# --- entry point -------------------------------------------------------------

_ERRORS = (data.DataError, ConfigError, pe.ShardingError,
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


def _main(argv: list[str]) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  config = config_from_flags()
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
  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
