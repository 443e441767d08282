"""The config of the feature model (`configs/movielens_features.py`).

`FeaturesConfig` is a `configs.TrainConfig` with the fields of the
feature-rich MovieLens model (examples/models.py `FeatureMF`): which feature
groups it uses, their tables and the validation split for tuning. A config
file returning one switches `examples.train` to that model; every field is
a flag as usual.

Plain python (no jax), like the configs package.
"""

from __future__ import annotations

import dataclasses

from configs import TrainConfig


def _field(default, help_text: str):
  return dataclasses.field(default=default, metadata={"help": help_text})


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
