"""A batch as a collection reads it, checked before anything is traced.

`read_batch` turns `{feature: ids or pe.Bag, ...}` into int32 ids per
feature and float32 combiner input weights per pooled feature, naming the
feature in every error; `read_grads` checks the embedding gradients of an
update. Keys of the batch that belong to no feature (labels, dense inputs)
are the model's and are not read, but a key in a feature's namespace that
the feature would not read (`<name>_weights` of a sequence feature) is an
error: nothing given to the collection is dropped silently.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_emb import validation
from pallas_emb.errors import InputError
from pallas_emb.specs import Bag
from pallas_emb.specs import FeatureSpec

WEIGHTS_SUFFIX = "_weights"


class BatchInputs(NamedTuple):
  """ids: `{feature: int32 ids}`; weights: `{pooled feature: f32 [B, L]}`;
  implicit: the pooled features whose weights are ones or a lengths mask
  (static: the update may skip the weight product for them)."""
  ids: dict[str, jax.Array]
  weights: dict[str, jax.Array]
  implicit: tuple[str, ...]

  def shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(x.shape)) for name, x in self.ids.items())


def check_per_feature(features, mapping, what: str, noun: str,
                      fix: str) -> None:
  """`mapping` is a dict with an entry for every feature."""
  if not isinstance(mapping, Mapping):
    raise InputError(
        f"pallas_emb collection {what} is a {type(mapping).__name__}; "
        f"expected a dict {{feature name: {noun}}}.")
  missing = [f for f in features if f not in mapping]
  if missing:
    raise InputError(f"pallas_emb collection {what} has no {noun} for "
                     f"features {missing}; it has keys "
                     f"{sorted(map(str, mapping))}. {fix}")


def read_batch(coll, batch: Mapping[str, Any]) -> BatchInputs:
  """Every feature's ids and every pooled feature's weights, converted and
  checked: integer ids, a leading batch dimension of at least one example
  that shards evenly, bags `[B, L]` with matching weights or lengths."""
  check_per_feature(coll.features, batch, "batch", "ids",
                    "Give every feature's ids.")
  ids, weights, implicit = {}, {}, []
  for name, spec in coll.features.items():
    value = batch[name]
    bag = value if isinstance(value, Bag) else Bag(value)
    if spec.combiner is None:
      if isinstance(value, Bag):
        raise InputError(
            f"pallas_emb batch[{name!r}] is a Bag, but feature {name!r} is "
            "a sequence feature (no combiner); pass its ids as an array.")
      if name + WEIGHTS_SUFFIX in batch:
        raise InputError(
            f"pallas_emb batch has {name + WEIGHTS_SUFFIX!r}, but feature "
            f"{name!r} is a sequence feature, which reads no weights; drop "
            "that key, or give the feature a combiner to pool weighted bags.")
    x = validation.as_ids(bag.ids, f"batch[{name!r}]")
    validation.check_leading_dim(x.shape, coll.group_size, coll.num_replicas,
                                 f"batch[{name!r}]")
    if x.shape[0] == 0:
      raise InputError(
          f"pallas_emb batch[{name!r}] has shape {tuple(x.shape)}: no "
          "examples; a batch needs at least one example per rank (pad it "
          "with the padding id or zero weights).")
    ids[name] = x
    if spec.combiner is not None:
      weights[name], from_mask = _bag_weights(spec, bag, batch, x)
      if from_mask:
        implicit.append(name)
  return BatchInputs(ids, weights, tuple(implicit))


def _bag_weights(spec: FeatureSpec, bag: Bag, batch, ids
                 ) -> tuple[jax.Array, bool]:
  """The input weights `[B, L]` of a pooled feature's bags, and whether they
  are implicit (ones or a lengths mask: 0 or 1 only).

  From `bag.weights` or `batch[name + "_weights"]` (e.g. the 0/1 mask of
  `pe.pad_ragged`; required for a weighted feature), else from
  `bag.lengths` (the first lengths[b] ids are real), else ones (the table's
  padding id, if any, is zeroed later, per rank).
  """
  name = spec.name
  if ids.ndim != 2:
    raise InputError(
        f"pallas_emb batch[{name!r}] has shape {tuple(ids.shape)}; pooled "
        f"feature {name!r} ({spec.combiner}) takes bags [batch, max_len]. "
        "Pad ragged bags with pe.pad_ragged.")
  key = name + WEIGHTS_SUFFIX
  weights = bag.weights
  if key in batch:
    if weights is not None or bag.lengths is not None:
      raise InputError(
          f"pallas_emb feature {name!r} has both batch[{key!r}] and a pe.Bag "
          "with weights or lengths; give the bag's weights one way.")
    weights = batch[key]
  if weights is None and spec.weighted:
    raise InputError(
        f"pallas_emb feature {name!r} is weighted but the batch has no "
        f"{key!r} and batch[{name!r}] is not a pe.Bag with weights; give "
        "the per-id weights [batch, max_len].")
  if weights is not None:
    if bag.lengths is not None:
      raise InputError(
          f"pallas_emb feature {name!r} got both weights and lengths; give "
          "one (zero weights mark padding).")
    if not hasattr(weights, "shape"):
      weights = np.asarray(weights, np.float32)
    if tuple(weights.shape) != tuple(ids.shape) or not jnp.issubdtype(
        weights.dtype, jnp.floating):
      raise InputError(
          f"pallas_emb weights of feature {name!r} are "
          f"{np.dtype(weights.dtype).name}{list(weights.shape)}; expected "
          f"float weights of the ids' shape {list(ids.shape)}.")
    return jnp.asarray(weights, jnp.float32), False
  if bag.lengths is not None:
    lengths = validation.as_ids(bag.lengths, f"lengths of feature {name!r}")
    if tuple(lengths.shape) != tuple(ids.shape[:1]):
      raise InputError(
          f"pallas_emb lengths of feature {name!r} have shape "
          f"{tuple(lengths.shape)}; expected ({ids.shape[0]},), one per "
          "example.")
    if not isinstance(lengths, jax.core.Tracer):
      host = np.asarray(lengths)
      bad = np.flatnonzero((host < 0) | (host > ids.shape[1]))
      if bad.size:
        raise InputError(
            f"pallas_emb lengths of feature {name!r} hold {int(host[bad[0]])} "
            f"at example {int(bad[0])}; expected 0 <= length <= "
            f"{ids.shape[1]} (the bags' max_len). Pad the bags to the "
            "longest one (pe.pad_ragged) or fix the lengths.")
    return (jnp.arange(ids.shape[1]) < lengths[:, None]).astype(
        jnp.float32), True
  return jnp.ones(ids.shape, jnp.float32), True


def read_grads(coll, emb_grads, shapes) -> dict[str, jax.Array]:
  """Embedding gradients shaped like the lookup's output, per feature."""
  check_per_feature(coll.features, emb_grads, "emb_grads", "gradient",
                    "Give every feature's (zeros for unused ones).")
  out = {}
  for name, spec in coll.features.items():
    width = coll.tables[spec.table].emb_width
    rows = shapes[name][:1] if spec.combiner else shapes[name]
    validation.check_grads_array(emb_grads[name], tuple(rows) + (width,),
                                 f"emb_grads[{name!r}]")
    out[name] = emb_grads[name]
  return out
