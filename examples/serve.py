"""Serve a trained recommender: int8 / bf16 tables, an exported scorer.

From the repository root:

    python -m examples.serve --config=configs/movielens_features.py
    python -m examples.serve --config=configs/movielens_features.py \\
        --checkpoint_dir=/tmp/ml100k       # trains once, then restores

Trains the config as examples.train does (or restores the latest
checkpoint of --checkpoint_dir, training only the steps left), then:

1. quantizes the collection's tables (`coll.quantize`): row-wise int8 and
   bfloat16 serving copies, beside the float32 tables;
2. exports, per table dtype, an inference function scoring (user, item)
   pairs (`pallas_emb.export.save`: the collection lookup of the serving
   state and the model's dense part, predictions clipped to the training
   ratings' range; the per-user / per-item feature arrays travel in the
   exported state), one program per batch shape of the evaluation split;
3. loads the three exports in a fresh process that imports only jax,
   numpy and pallas_emb, scores the evaluation split there, and prints its
   RMSE per table dtype and the tables' bytes.

Every flag of examples.train is accepted (the config's fields); besides
them --export_dir (default: a temporary directory) and --serve_out (a JSON
file of the printed figures).
"""

from __future__ import annotations

from examples import startup

startup.simulate_cpu_devices()  # Before jax is imported.

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import json
import os
import subprocess
import sys
import tempfile
import textwrap

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from examples import evaluation
from examples import train as train_lib
from examples.config import TrainConfig
from examples.models import FeatureMF
import pallas_emb as pe
from pallas_emb import datasets
from pallas_emb import export
from pallas_emb import flax as pe_flax

_EXPORT_DIR = flags.DEFINE_string(
    "export_dir", "", "Where the exported functions go ('': a temporary "
    "directory).")
_SERVE_OUT = flags.DEFINE_string(
    "serve_out", "", "Write the serving figures (RMSE and table bytes per "
    "dtype) as JSON here ('': don't).")

DTYPES = ("float32", "bfloat16", "int8")
TRAINING_ONLY = ("flax", "optax", "orbax", "haiku")

# Runs in a fresh process: argv[1] the export directory, argv[2] the pair
# keys (JSON), argv[3:] the exports to score.
LOADER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import pallas_emb
    from pallas_emb import export
    root, keys = sys.argv[1], json.loads(sys.argv[2])
    rmse = {}
    with np.load(os.path.join(root, "eval.npz")) as data:
      batches = int(data["num_batches"])
      for name in sys.argv[3:]:
        served = export.load(os.path.join(root, name))
        sq = count = 0.0
        for i in range(batches):
          pred = np.asarray(served({k: data[f"b{i}_{k}"] for k in keys}),
                            np.float64)
          weight = data[f"b{i}_weight"]
          sq += float(np.sum(weight * (pred - data[f"b{i}_label"]) ** 2))
          count += float(np.sum(weight))
        rmse[name] = (sq / count) ** 0.5
    loaded = sorted(m for m in sys.modules
                    if m.split(".")[0] in TRAINING_ONLY)
    print(json.dumps({"rmse": rmse, "training_modules": loaded}))
""").replace("TRAINING_ONLY", repr(TRAINING_ONLY))


def scorer(run):
  """`score(state, pairs) -> predictions [B]`: the model on serving tables.

  `state`: {"emb": a CollectionState or ServingState, "dense": the dense
  params, "entities": the per-user / per-item feature arrays}.
  """
  trainer, rating_range = run.trainer, run.rating_range
  # The feature model reads its tables through one EmbeddingCollection
  # layer ("embed"), which serves the tables it is handed; biased MF's
  # per-table Embed layers get the trainer's lookups.
  by_layer = isinstance(run.model, FeatureMF)

  def score(state, pairs):
    batch = dict(pairs, **state["entities"])
    if by_layer:
      pred = run.model.apply(
          {"params": state["dense"],
           **pe_flax.serving_variables(state["emb"], "embed")}, batch)["pred"]
    else:
      pred = trainer.apply(pe.PipelineState(state["emb"], state["dense"],
                                            None, None, None), batch)["pred"]
    return pred if rating_range is None else jnp.clip(pred, *rating_range)

  return score


def table_bytes(tables) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tables))


def serve(config: TrainConfig, export_dir: str, log=print) -> dict:
  """Trains (or restores), quantizes, exports, scores in a fresh process."""
  run, state, metrics = train_lib.run_training(config, log)
  if config.pipelined:  # The metrics evaluated a flushed copy: serve it.
    state, _ = run.trainer.flush(state)
  coll = run.collection
  # Serving needs the tables only: no optimizer state in the f32 export.
  f32 = pe.CollectionState(
      {name: pe.StackState(s.table, None)
       for name, s in state.embedding.stacks.items()},
      state.embedding.fingerprint)
  serving = {"float32": f32,
             "bfloat16": coll.quantize(state.embedding, "bfloat16"),
             "int8": coll.quantize(state.embedding, "int8")}

  eval_set = run.data.evaluate
  keys = sorted(eval_set.features)
  arrays, shapes = {}, {}
  batches = list(evaluation.eval_batches(eval_set, run.eval_batch_size,
                                         run.mesh.size))
  for i, batch in enumerate(batches):
    for k in keys + [datasets.LABEL_KEY, datasets.WEIGHT_KEY]:
      arrays[f"b{i}_{k}"] = batch[k]
    # One exported program per batch shape (the last batch may be shorter).
    shapes.setdefault(batch[keys[0]].shape[0], {k: batch[k] for k in keys})
  os.makedirs(export_dir, exist_ok=True)
  np.savez(os.path.join(export_dir, "eval.npz"), num_batches=len(batches),
           **arrays)
  score = scorer(run)
  entities = run.batch({})
  for dtype, emb in serving.items():
    export.save(os.path.join(export_dir, dtype), score,
                {"emb": emb, "dense": state.dense_params,
                 "entities": entities}, [(pairs,) for pairs in shapes.values()])
  log(f"exported {', '.join(DTYPES)} scorers to {export_dir} "
      f"({len(shapes)} program(s) each)")

  proc = subprocess.run(
      [sys.executable, "-c", LOADER, export_dir, json.dumps(keys), *DTYPES],
      capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"the fresh scoring process failed:\n"
                       f"{proc.stderr[-5000:]}")
  loaded = json.loads(proc.stdout.strip().splitlines()[-1])
  if loaded["training_modules"]:
    raise RuntimeError(f"the scoring process imported training code: "
                       f"{loaded['training_modules']}")
  name = run.data.eval_name
  sizes = {dtype: table_bytes(
      [s.table for s in emb.stacks.values()] if dtype == "float32"
      else emb.stacks) for dtype, emb in serving.items()}
  figures = {f"{name}_rmse": loaded["rmse"], "table_bytes": sizes,
             f"trained_{name}_rmse": metrics[f"{name}_rmse"],
             "steps": metrics["steps"]}
  rmse = loaded["rmse"]
  log(f"served {name} RMSE (fresh process, jax + numpy + pallas_emb only): "
      + ", ".join(f"{d} {rmse[d]:.5f}" for d in DTYPES)
      + f"; the trained state's own evaluation {metrics[f'{name}_rmse']:.5f}")
  log("table bytes: " + ", ".join(
      f"{d} {sizes[d] / 2**20:.2f} MiB ({sizes['float32'] / sizes[d]:.2f}x)"
      for d in DTYPES))
  return figures


def serve_from_flags(config: TrainConfig) -> dict:
  """`serve` with --export_dir and --serve_out."""
  export_dir = _EXPORT_DIR.value or tempfile.mkdtemp(
      prefix="pallas_emb_serve_")
  figures = serve(config, export_dir)
  if _SERVE_OUT.value:
    with open(_SERVE_OUT.value, "w") as f:
      json.dump(figures, f, indent=1)
  return figures


def main() -> None:
  # examples.train's command line (config file, a flag per field, errors).
  train_lib.main(program=serve_from_flags)


if __name__ == "__main__":
  main()
