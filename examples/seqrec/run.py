"""Builds, trains and evaluates the sequence model of a SeqRecConfig."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.config import ConfigError
from examples.config import PROGRAM
from examples.config import SeqRecConfig
from examples.loop import fmt_time
from examples.seqrec import data as data_lib
from examples.seqrec import evaluate
from examples.seqrec import hstu
from examples.seqrec import model as model_lib
from examples.seqrec import timing
import pallas_emb as pe
from pallas_emb.flax import FlaxTrainer

TABLE = "items"
OPTIMIZERS = ("adam", "rowwise_adagrad", "sgd")
CATALOGUES = ("all", "rated")  # --catalogue: ml-1m.item's 3,883 or 3,706
# --compute_dtype: "auto" is resolved by `compute_dtype`.
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
                  "auto": None}
# --encoder: the class and the name the log and the metrics give it.
ENCODERS = {"sasrec": (model_lib.Encoder, "SASRec"),
            "hstu": (hstu.HSTU, "HSTU")}


def check_config(config: SeqRecConfig) -> None:
  """Raises ConfigError for a value the program cannot run."""
  def fail(name, want):
    raise ConfigError(f"{PROGRAM}: --{name}={getattr(config, name)!r}; "
                      f"expected {want}.")
  for name in ("max_len", "emb_dim", "num_blocks", "num_heads",
               "num_negatives", "batch_size", "epochs", "eval_every",
               "eval_batch_size", "log_every"):
    if getattr(config, name) < 1:
      fail(name, "an integer >= 1")
  if config.max_users < 0:
    fail("max_users", "0 (all users) or a positive count")
  if config.emb_dim % config.num_heads:
    fail("num_heads", f"a divisor of --emb_dim={config.emb_dim}")
  if not 0 <= config.dropout < 1:
    fail("dropout", "a rate in [0, 1)")
  if config.max_minutes < 0:
    fail("max_minutes", "0 (no limit) or a positive number of minutes")
  for name in ("temperature", "dense_lr", "emb_lr"):
    if not getattr(config, name) > 0:
      fail(name, "a positive number")
  for name, choices in (("emb_optimizer", OPTIMIZERS),
                        ("encoder", tuple(ENCODERS)),
                        ("catalogue", CATALOGUES),
                        ("negatives", model_lib.NEGATIVE_MODES),
                        ("loss_norm", model_lib.LOSS_NORMS),
                        ("positions", model_lib.POSITION_MODES),
                        ("compute_dtype", tuple(COMPUTE_DTYPES))):
    if getattr(config, name) not in choices:
      fail(name, f"one of {choices}")
  if config.hashed and config.hash_rows < 2:
    fail("hash_rows", "at least 2 rows (row 0 is padding)")
  seeds(config)
  buckets(config)


def seeds(config: SeqRecConfig) -> list[int]:
  """The seeds to train (--seeds, else --seed); raises ConfigError."""
  if not config.seeds.strip():
    return [config.seed]
  try:
    values = [int(x) for x in config.seeds.split(",")]
  except ValueError:
    values = []
  if not values or len(set(values)) != len(values) or min(values) < 0:
    raise ConfigError(f"{PROGRAM}: --seeds={config.seeds!r}; expected "
                      "distinct comma-separated integers >= 0, e.g. "
                      "'11,12,13'.")
  return values


# --length_buckets=auto: buckets on CPUs, where attention's square of the
# length dominates a step; one shape on accelerators, where compiling a
# program per bucket (and per pipelined pair of buckets) is what costs.
AUTO_BUCKETS = {"cpu": "64,128"}


def buckets(config: SeqRecConfig) -> tuple[int, ...]:
  """The length buckets, max_len last; raises ConfigError."""
  spec = config.length_buckets
  if spec == "auto":  # the platform's, those shorter than max_len
    spec = ",".join(
        x for x in AUTO_BUCKETS.get(jax.devices()[0].platform, "").split(",")
        if x and int(x) < config.max_len)
  try:
    lengths = [int(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    lengths = [0]
  if any(not 0 < n < config.max_len for n in lengths) or (
      lengths != sorted(set(lengths))):
    raise ConfigError(
        f"{PROGRAM}: --length_buckets={config.length_buckets!r}; expected "
        f"ascending comma-separated lengths in [1, {config.max_len}) or ''.")
  return tuple(lengths) + (config.max_len,)


def sparse_optimizer(config: SeqRecConfig):
  if config.emb_optimizer == "adam":
    return pe.Adam(config.emb_lr, b1=0.9, b2=config.dense_b2,
                   eps=config.emb_eps)
  if config.emb_optimizer == "rowwise_adagrad":
    return pe.RowwiseAdagrad(config.emb_lr, eps=config.emb_eps)
  return pe.Sgd(config.emb_lr)


@dataclasses.dataclass
class Run:
  config: SeqRecConfig
  data: data_lib.SeqData
  collection: pe.EmbeddingCollection
  encoder: model_lib.Encoder
  trainer: FlaxTrainer


def compute_dtype(name: str):
  """--compute_dtype's dtype; "auto": bfloat16 on a TPU (whose matrix unit
  is bf16), float32 elsewhere."""
  if name == "auto":
    return jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float32
  return COMPUTE_DTYPES[name]


def build(config: SeqRecConfig, data: data_lib.SeqData) -> Run:
  """The collection, encoder and trainer of a config."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  if config.batch_size % mesh.size:
    raise ConfigError(f"{PROGRAM}: --batch_size={config.batch_size} must be "
                      f"a multiple of the {mesh.size} devices.")
  # The table's columns shard over the devices: d rounded up; the model
  # reads the first d columns (the rest get no gradient and stay put).
  width = -(-config.emb_dim // mesh.size) * mesh.size
  std = config.init_std

  def init(key, shape, dtype=jnp.float32):
    return (std * jax.random.truncated_normal(key, -2.0, 2.0, shape)
            ).astype(dtype)

  rows = config.hash_rows if config.hashed else data.num_items + 1
  collection = pe.EmbeddingCollection(
      [pe.TableSpec(TABLE, rows, width, optimizer=sparse_optimizer(config),
                    initializer=init, padding_id=0)],
      [pe.FeatureSpec(f, TABLE) for f in model_lib.FEATURES], mesh, "x",
      backend=config.backend or None)
  encoder = ENCODERS[config.encoder][0](
      dim=config.emb_dim, max_len=config.max_len,
      num_blocks=config.num_blocks, num_heads=config.num_heads,
      dropout=config.dropout, hashed=config.hashed,
      from_oldest=config.positions == "oldest",
      dtype=compute_dtype(config.compute_dtype))
  seqrec = model_lib.SeqRec(collection, encoder)
  dense = optax.adamw(config.dense_lr, b1=0.9, b2=config.dense_b2,
                      weight_decay=config.dense_weight_decay)
  positions = config.batch_size * max(float(np.mean(
      np.count_nonzero(data.targets, axis=1))), 1.0)
  loss = model_lib.make_loss(
      config.temperature, positions,
      per_position=config.negatives == "per_position",
      num_negatives=config.num_negatives, num_items=data.num_items,
      batch_norm=config.loss_norm == "batch")
  trainer = FlaxTrainer(seqrec, collection, loss, dense,
                        pipelined=config.pipelined)
  return Run(config, data, collection, encoder, trainer)


class Programs:
  """A run's jitted programs and device data, shared by its seeds: the
  seed and the step are arguments, so each program compiles once."""

  def __init__(self, run: Run):
    config, trainer = run.config, run.trainer
    self.run = run
    sharding = run.collection.token_sharding()
    replicated = jax.sharding.NamedSharding(run.collection.mesh,
                                            jax.sharding.PartitionSpec())
    self.arrays = data_lib.device_arrays(run.data, replicated)

    def batch(arrays, users, step, seed, length):
      made = data_lib.device_batch(
          arrays, users, step, seed, length=length,
          num_items=run.data.num_items, num_negatives=config.num_negatives,
          per_position=config.negatives == "per_position")
      return jax.lax.with_sharding_constraint(made, sharding)

    def step(state, arrays, users, next_users, step, seed, *, length,
             next_length):
      current = batch(arrays, users, step, seed, length)
      if not trainer.pipelined:
        return trainer.step(state, current)
      following = batch(arrays, next_users, step + 1, seed, next_length)
      return trainer.step(state, current, following)

    self.batch = jax.jit(batch, static_argnames="length")
    self.step = jax.jit(step, donate_argnums=0,
                        static_argnames=("length", "next_length"))
    self.init = jax.jit(trainer.model.init)
    self.evaluator = evaluate.RankingEvaluator(
        trainer, run.encoder, run.data.item_rows, config.eval_batch_size)
    # The epoch's mean loss, queued on the device (read at the end).
    self.mean = jax.jit(lambda losses: jnp.mean(jnp.stack(losses)))


def _skipped(updates: list) -> int:
  """Staged updates that were not applied among the steps' stats (read
  from the device), emptying the list."""
  count = sum(int(s.pending and not s.valid)
              for u in jax.device_get(updates) for s in u.values())
  updates.clear()
  return count


def _describe(config: SeqRecConfig, run: Run, per_epoch: int,
              lengths: tuple[int, ...], seed_list: list[int]) -> str:
  data, table = run.data, run.collection.tables[TABLE]
  options = [f"{config.negatives} negatives", f"{config.loss_norm} loss norm",
             f"positions from the {config.positions}",
             jnp.dtype(compute_dtype(config.compute_dtype)).name]
  return (
      f"{PROGRAM}: MovieLens-1M, {data.num_users} users, {data.num_items} "
      f"items ({config.catalogue}), history {config.max_len}; "
      f"{ENCODERS[config.encoder][1]} d={config.emb_dim}, "
      f"{config.num_blocks} blocks x {config.num_heads} heads "
      f"({', '.join(options)}); table {TABLE!r} {table.vocab_rows} x "
      f"{table.emb_width} ({config.emb_optimizer}"
      f"{', hashed ids' if config.hashed else ''}); {jax.device_count()} "
      f"{jax.devices()[0].platform} devices; {config.epochs} epochs x "
      f"{per_epoch} steps of {config.batch_size} users, lengths {lengths}; "
      f"seed{'s' if len(seed_list) > 1 else ''} "
      f"{', '.join(map(str, seed_list))}.")


def train(config: SeqRecConfig, log: Callable[[str], None] = print) -> dict:
  """Trains each seed, evaluating validation every eval_every epochs and
  test at the end; returns the metrics dict (what --metrics_out writes):
  one seed's fields at the top level, or with several seeds their "runs"
  and "mean" / "sd"; "timing" says where the wall time went."""
  check_config(config)
  seed_list = seeds(config)
  with timing.compile_cache(config.compile_cache, log) as cache_dir, \
      timing.Clock() as clock:
    with clock.phase("load"):
      data = data_lib.load(
          config.data_path, max_users=config.max_users,
          max_len=config.max_len, train_on_valid=config.train_on_valid,
          hash_rows=config.hash_rows if config.hashed else None,
          all_movies=config.catalogue == "all")
    with clock.phase("init"):
      run = build(config, data)
      programs = Programs(run)
    lengths = buckets(config)
    per_epoch = data_lib.steps_per_epoch(data, config.batch_size, lengths)
    log(_describe(config, run, per_epoch, lengths, seed_list))
    runs = [_train_seed(programs, seed, lengths, per_epoch, clock, log)
            for seed in seed_list]
  metrics = {
      "config": dataclasses.asdict(config),
      "model": ENCODERS[config.encoder][1], "dataset": "movielens-1m",
      "users": data.num_users, "items": data.num_items,
      "untied_users": int(np.count_nonzero(data.untied)),
      "devices": jax.device_count(), "platform": jax.devices()[0].platform,
      "timing": clock.seconds(),
      "compile_cache": {"dir": cache_dir, "read": clock.cache_hits,
                        "compiled": clock.cache_misses},
  }
  if len(runs) == 1:
    metrics.update(runs[0])
  else:
    metrics.update(seeds=seed_list, runs=runs, **_mean_sd(runs))
    log(f"mean +- sd of {len(runs)} seeds: " + result_line(
        {k: f"{v:.4f} +- {metrics['sd'][k]:.4f}"
         for k, v in metrics["mean"].items()}))
  log(clock.summary())
  return metrics


# The result line's metrics: every test metric, then the untied users'.
def result_line(values: dict) -> str:
  """`test_hr@10 x ... | untied users: hr@10 y ...` of per-key values."""
  def fmt(v):
    return v if isinstance(v, str) else f"{v:.4f}"
  main = "  ".join(f"{k} {fmt(v)}" for k, v in values.items()
                   if k.startswith("test_") and "untied" not in k)
  untied = "  ".join(f"{k[len('test_untied_'):]} {fmt(v)}"
                     for k, v in values.items()
                     if k.startswith("test_untied_"))
  return main + (f"  | untied users: {untied}" if untied else "")


def _mean_sd(runs: list[dict]) -> dict:
  """{"mean": {k: mean}, "sd": {k: sample sd}} of the runs' metrics."""
  keys = [k for k, v in runs[0].items() if isinstance(v, float) and (
      k.startswith(("test_", "valid_")) or k == "examples_per_sec")]
  values = {k: np.asarray([r[k] for r in runs], np.float64) for k in keys}
  return {"mean": {k: float(v.mean()) for k, v in values.items()},
          "sd": {k: float(v.std(ddof=1)) for k, v in values.items()}}


def _train_seed(programs: Programs, seed: int, lengths: tuple[int, ...],
                per_epoch: int, clock: timing.Clock,
                log: Callable[[str], None]) -> dict:
  """One seed's training and evaluation; its metrics."""
  run, config = programs.run, programs.run.config
  data, trainer, evaluator = run.data, run.trainer, programs.evaluator
  arrays = programs.arrays
  plan = data_lib.batch_plan(data, batch_size=config.batch_size, seed=seed,
                             buckets=lengths)
  with clock.phase("init"):
    current = next(plan)
    first = programs.batch(arrays, current.users, 0, seed, current.length)
    params = programs.init(jax.random.key(seed), first)
    state = trainer.init(params["params"], first)
  total = per_epoch * config.epochs
  curve, losses, epoch_losses, updates, skipped = [], [], [], [], 0
  # As examples/loop.py: queued steps can deadlock XLA:CPU's in-process
  # collectives, so on CPU each step finishes before the next one starts.
  sync_each_step = (jax.devices()[0].platform == "cpu"
                    and jax.device_count() > 1)
  users_per_step = data.num_users / per_epoch
  t_start = time.perf_counter()
  t_first, eval_seconds = None, 0.0
  step = 0
  while step < total:
    with clock.phase("batching"):
      following = next(plan)
    with clock.phase("steps"):
      state, metrics = programs.step(
          state, arrays, current.users, following.users, step, seed,
          length=current.length, next_length=following.length)
      step += 1
      current = following
      losses.append(metrics.aux["loss"])
      updates.append(metrics.updates)
      if sync_each_step:
        jax.block_until_ready(metrics.loss)
      if t_first is None:
        jax.block_until_ready(metrics.loss)
        t_first = time.perf_counter()
      if step % config.log_every == 0 or step == total:
        # Read at log points only: a read per step would wait for each step.
        skipped += _skipped(updates)
        rate = ((step - 1) * users_per_step /
                (time.perf_counter() - t_first - eval_seconds)
                if step > 1 else float("nan"))
        log(f"seed {seed} step {step:>6d}/{total}  loss "
            f"{float(np.mean(jax.device_get(losses[-config.log_every:]))):.4f}"
            f"  {rate:,.0f} users/s  ETA "
            f"{fmt_time((total - step) * users_per_step / rate)}")
      epoch, rest = divmod(step, per_epoch)
      if rest:
        continue
      epoch_losses.append(programs.mean(losses[-per_epoch:]))
      losses = losses[-config.log_every:]
      out_of_time = (config.max_minutes and time.perf_counter() - t_start
                     - eval_seconds >= 60 * config.max_minutes)
      if out_of_time:
        log(f"stopping after epoch {epoch}: --max_minutes="
            f"{config.max_minutes} of training have passed.")
        total = step
    if epoch % config.eval_every == 0 or step == total:
      t0 = time.perf_counter()
      with clock.phase("evaluation"):
        valid = evaluator(state, data.valid_history, data.valid_targets,
                          data.valid_times)
      eval_seconds += time.perf_counter() - t0
      epoch_loss = float(epoch_losses[-1])
      curve.append(dict(epoch=epoch, train_loss=epoch_loss,
                        **{f"valid_{k}": v for k, v in valid.items()}))
      log(f"seed {seed} epoch {epoch:>4d}  train_loss {epoch_loss:.4f}  "
          + "  ".join(f"valid_{k} {v:.4f}" for k, v in valid.items()))
  with clock.phase("steps"):
    skipped += _skipped(updates)
    jax.block_until_ready(state)
  t_end = time.perf_counter()
  # Real users (not the filler rows of partial batches) trained per
  # second, without the first (compiling) step and the evaluations.
  throughput = ((total - 1) * users_per_step /
                max(t_end - t_first - eval_seconds, 1e-9))
  t0 = time.perf_counter()
  with clock.phase("evaluation"):
    test, untied = evaluator(state, data.test_history, data.test_targets,
                             data.test_times, subset=data.untied)
  eval_seconds += time.perf_counter() - t0
  result = {
      "seed": seed, "epochs": total // per_epoch, "steps": total,
      "train_seconds": t_end - t_start - eval_seconds,
      "eval_seconds": eval_seconds, "examples_per_sec": throughput,
      "skipped_updates": skipped,
      **{k: v for k, v in curve[-1].items() if k.startswith("valid_")},
      **{f"test_{k}": v for k, v in test.items()},
      **{f"test_untied_{k}": v for k, v in untied.items()},
      "curve": curve,
      "epoch_losses": [float(x) for x in jax.device_get(epoch_losses)],
  }
  log(f"seed {seed} done: {total} steps in {fmt_time(t_end - t_start)} "
      f"({throughput:,.0f} users/s after compile, "
      f"{eval_seconds:.1f} s evaluating); " + result_line(result))
  if not math.isfinite(curve[-1]["train_loss"]):
    log("warning: the training loss is not finite.")
  return result
