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
from examples.data import place
from examples.loop import fmt_time
from examples.seqrec import data as data_lib
from examples.seqrec import evaluate
from examples.seqrec import hstu
from examples.seqrec import model as model_lib
import pallas_emb as pe
from pallas_emb.flax import FlaxTrainer

TABLE = "items"
OPTIMIZERS = ("adam", "rowwise_adagrad", "sgd")
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
  if config.emb_optimizer not in OPTIMIZERS:
    fail("emb_optimizer", f"one of {OPTIMIZERS}")
  if config.encoder not in ENCODERS:
    fail("encoder", f"one of {tuple(ENCODERS)}")
  if config.hashed and config.hash_rows < 2:
    fail("hash_rows", "at least 2 rows (row 0 is padding)")
  buckets(config)


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
      dropout=config.dropout, hashed=config.hashed)
  seqrec = model_lib.SeqRec(collection, encoder, seed=config.seed)
  dense = optax.adamw(config.dense_lr, b1=0.9, b2=config.dense_b2,
                      weight_decay=config.dense_weight_decay)
  positions = config.batch_size * max(float(np.mean(
      np.count_nonzero(data.targets, axis=1))), 1.0)
  trainer = FlaxTrainer(seqrec, collection,
                        model_lib.make_loss(config.temperature, positions),
                        dense, pipelined=config.pipelined)
  return Run(config, data, collection, encoder, trainer)


def _skipped(updates: list) -> int:
  """Staged updates that were not applied among the steps' stats (read
  from the device), emptying the list."""
  count = sum(int(s.pending and not s.valid)
              for u in jax.device_get(updates) for s in u.values())
  updates.clear()
  return count


def train(config: SeqRecConfig, log: Callable[[str], None] = print) -> dict:
  """Trains, evaluates validation every eval_every epochs and test at the
  end; returns the metrics dict (what --metrics_out writes)."""
  check_config(config)
  t_start = time.perf_counter()
  data = data_lib.load(config.data_path, max_users=config.max_users,
                       max_len=config.max_len,
                       train_on_valid=config.train_on_valid,
                       hash_rows=config.hash_rows if config.hashed else None)
  run = build(config, data)
  sharding = run.collection.token_sharding()
  lengths = buckets(config)
  per_epoch = data_lib.steps_per_epoch(data, config.batch_size, lengths)
  total = per_epoch * config.epochs
  log(f"{PROGRAM}: MovieLens-1M, {data.num_users} users, {data.num_items} "
      f"items, history {config.max_len}; "
      f"{ENCODERS[config.encoder][1]} d={config.emb_dim}, "
      f"{config.num_blocks} blocks; table {TABLE!r} "
      f"{run.collection.tables[TABLE].vocab_rows} x "
      f"{run.collection.tables[TABLE].emb_width} ({config.emb_optimizer}"
      f"{', hashed ids' if config.hashed else ''}); {jax.device_count()} "
      f"{jax.devices()[0].platform} devices; {config.epochs} epochs x "
      f"{per_epoch} steps of {config.batch_size} users, lengths {lengths}.")

  stream = data_lib.batches(data, batch_size=config.batch_size,
                            num_negatives=config.num_negatives,
                            seed=config.seed, buckets=lengths)
  current = place(next(stream), sharding)
  params = run.trainer.model.init(jax.random.key(config.seed), current)
  state = run.trainer.init(params["params"], current)
  evaluator = evaluate.RankingEvaluator(
      run.trainer, run.encoder, data.item_rows, config.eval_batch_size)
  step_fn = jax.jit(run.trainer.step, donate_argnums=0)
  curve, losses, updates, skipped = [], [], [], 0
  # As examples/loop.py: queued steps can deadlock XLA:CPU's in-process
  # collectives, so on CPU each step finishes before the next one starts.
  sync_each_step = (jax.devices()[0].platform == "cpu"
                    and jax.device_count() > 1)
  t_first = None
  users_per_step = data.num_users / per_epoch
  step = 0
  while step < total:
    step += 1
    following = place(next(stream), sharding)
    if config.pipelined:
      state, metrics = step_fn(state, current, following)
    else:
      state, metrics = step_fn(state, current)
    current = following
    losses.append(metrics.aux["loss"])
    updates.append(metrics.updates)
    if sync_each_step:
      jax.block_until_ready(metrics.loss)
    if t_first is None:
      t_first = time.perf_counter()
    if step % config.log_every == 0 or step == total:
      # Read at log points only: a read per step would wait for each step.
      skipped += _skipped(updates)
      rate = ((step - 1) * users_per_step /
              (time.perf_counter() - t_first - evaluator.seconds)
              if step > 1 else float("nan"))
      log(f"step {step:>6d}/{total}  loss "
          f"{float(np.mean(jax.device_get(losses[-config.log_every:]))):.4f}"
          f"  {rate:,.0f} users/s  ETA "
          f"{fmt_time((total - step) * users_per_step / rate)}")
    epoch, rest = divmod(step, per_epoch)
    if rest:
      continue
    out_of_time = (config.max_minutes and time.perf_counter() - t_start
                   - evaluator.seconds >= 60 * config.max_minutes)
    if out_of_time:
      log(f"stopping after epoch {epoch}: --max_minutes="
          f"{config.max_minutes} of training have passed.")
      total = step
    if epoch % config.eval_every == 0 or step == total:
      valid = evaluator(state, data.valid_history, data.valid_targets,
                        data.valid_times)
      epoch_loss = float(np.mean(jax.device_get(losses[-per_epoch:])))
      curve.append(dict(epoch=epoch, train_loss=epoch_loss,
                        **{f"valid_{k}": v for k, v in valid.items()}))
      log(f"epoch {epoch:>4d}  train_loss {epoch_loss:.4f}  "
          + "  ".join(f"valid_{k} {v:.4f}" for k, v in valid.items()))
  skipped += _skipped(updates)
  jax.block_until_ready(state)
  t_end = time.perf_counter()
  train_seconds = t_end - t_start - evaluator.seconds
  # Real users (not the padding rows of partial batches) trained per
  # second, without the first (compiling) step.
  throughput = ((total - 1) * users_per_step /
                (t_end - t_first - evaluator.seconds))
  test = evaluator(state, data.test_history, data.test_targets,
                   data.test_times)
  metrics = {
      "config": dataclasses.asdict(config),
      "model": ENCODERS[config.encoder][1], "dataset": "movielens-1m",
      "users": data.num_users, "items": data.num_items,
      "devices": jax.device_count(), "platform": jax.devices()[0].platform,
      "epochs": total // per_epoch, "steps": total,
      "train_seconds": train_seconds, "eval_seconds": evaluator.seconds,
      "wall_seconds": time.perf_counter() - t_start,
      "examples_per_sec": throughput,
      "skipped_updates": skipped,
      **{k: v for k, v in curve[-1].items() if k.startswith("valid_")},
      **{f"test_{k}": v for k, v in test.items()},
      "curve": curve,
  }
  log(f"done: {total} steps in {fmt_time(train_seconds)} (+"
      f"{evaluator.seconds:.0f}s eval; {throughput:,.1f} users/s after "
      f"compile); " + "  ".join(f"test_{k} {v:.4f}" for k, v in test.items()))
  if not math.isfinite(curve[-1]["train_loss"]):
    log("warning: the training loss is not finite.")
  return metrics
