"""Builds a run from a config: mesh, collection, model, trainer, schedule."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import features as feature_lib
from examples.config import ConfigError
from examples.config import FeaturesConfig
from examples.config import PROGRAM
from examples.config import TrainConfig
from examples.data import Data
from examples.data import place
from examples.models import BiasedMF
from examples.models import FEATURES
from examples.models import feature_collection
from examples.models import FeatureMF
from examples.models import IMPLICIT_TABLES
from examples.models import make_loss
from examples.models import SIDE_COMBINERS
from examples.models import TABLE_KEYS
import pallas_emb as pe
from pallas_emb import datasets
from pallas_emb.flax import FlaxTrainer


@dataclasses.dataclass
class Run:
  """What the program builds from a config."""
  config: TrainConfig
  data: Data
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
      self._placed_entities = place(self.entity_arrays, self.sharding)
    return dict(place(batch, self.sharding), **self._placed_entities)


def sparse_optimizer(config: TrainConfig, lr: float,
                     weight_decay: float | None = None) -> pe.RowwiseAdagrad:
  return pe.RowwiseAdagrad(
      lr, eps=config.emb_eps,
      initial_accumulator_value=config.emb_initial_accumulator,
      half_life_steps=config.emb_half_life or None,
      weight_decay=(config.emb_weight_decay if weight_decay is None
                    else weight_decay))


def build_biased_mf(config: TrainConfig, mesh, train_ds: datasets.Dataset,
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
  optimizer = sparse_optimizer(config, config.emb_lr)
  collection = pe.EmbeddingCollection(
      [pe.TableSpec(TABLE_KEYS[f], train_ds.vocab_sizes[f], config.emb_width,
                    optimizer=optimizer, dtype=dtype, padding_id=0,
                    max_unique=config.num_unique or None)
       for f in FEATURES],
      [pe.FeatureSpec(f, TABLE_KEYS[f]) for f in FEATURES], mesh, "x",
      backend=config.backend or None)
  return model, collection


def build_features(config: FeaturesConfig, mesh, data: Data, dtype
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
      id_optimizer=sparse_optimizer(config, config.emb_lr),
      side_optimizer=sparse_optimizer(config, config.side_lr),
      implicit_optimizer=sparse_optimizer(
          config, config.implicit_lr or config.emb_lr,
          config.implicit_weight_decay or None),
      init_scale=config.init_scale, dtype=dtype,
      backend=config.backend or None)
  model = FeatureMF(
      collection, side_features=featurizer.side_features(),
      implicit=featurizer.implicit, l2=config.l2, side_l2=config.side_l2,
      mean=float(np.mean(train_ds.labels)))
  return model, collection, featurizer


def build(config: TrainConfig, data: Data) -> Run:
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  dtype = jnp.dtype(config.table_dtype)
  entity_arrays = {}
  if isinstance(config, FeaturesConfig):
    model, collection, featurizer = build_features(config, mesh, data,
                                                    dtype)
    entity_arrays = featurizer.arrays
    loss = make_loss(1.0)  # FeatureMF's "l2" output is already weighted.
  else:
    model, collection = build_biased_mf(config, mesh, data.train, dtype)
    loss = make_loss(config.l2)
  trainer = FlaxTrainer(model, collection, loss, optax.adam(config.dense_lr),
                        pipelined=config.pipelined)
  rating_range = None
  if config.data == "movielens":
    rating_range = (float(data.train.labels.min()),
                    float(data.train.labels.max()))
  return Run(config, data, mesh, collection, model, trainer, rating_range,
              entity_arrays)


@dataclasses.dataclass(frozen=True)
class Schedule:
  total_steps: int
  eval_every: int


def schedule(config: TrainConfig, train_ds: datasets.Dataset) -> Schedule:
  per_epoch = train_ds.num_examples // config.batch_size
  if per_epoch == 0:
    raise ConfigError(f"{PROGRAM}: {train_ds.num_examples} training "
                      f"examples are fewer than --batch_size="
                      f"{config.batch_size}.")
  return Schedule(total_steps=config.num_steps or config.epochs * per_epoch,
                   eval_every=config.eval_every or per_epoch)


def describe(run: Run, schedule: Schedule) -> str:
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
