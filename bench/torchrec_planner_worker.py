"""TorchRec's planner side of `bench/planner_compare.py` (runs in a torch venv).

Not imported by pallas_emb: `planner_compare.py` starts it as a subprocess
with the python of a separate environment that has torch, fbgemm-gpu-cpu
and torchrec (docs/planner.md, "Against TorchRec's planner"):

    $TORCHREC_PYTHON bench/torchrec_planner_worker.py --probe
    $TORCHREC_PYTHON bench/torchrec_planner_worker.py < problem.json

The problem (JSON on stdin, or `--problem=FILE`):

    {"world_size": W, "local_world_size": 8, "hbm_cap": bytes per rank,
     "reserve_fraction": 0.2, "batch_size": examples per rank,
     "tables": [{"name", "rows", "width", "dtype": "float32" | "bfloat16",
                 "features": [names], "ids_per_example": [per feature],
                 "pooled": bool}, ...]}

TorchRec's `EmbeddingShardingPlanner` (its default enumerator, proposers,
partitioner and perf model) plans the tables for
`Topology(world_size=W, compute_device="cuda", hbm_cap=...,
local_world_size=...)`, with `FixedPercentageStorageReservation(
reserve_fraction)` (the same budget as pe.plan's reserve) and the batch
size per rank. Pooled tables are `EmbeddingBagConfig`s in an
`EmbeddingBagCollection`, sequence ones `EmbeddingConfig`s in an
`EmbeddingCollection`, all on the meta device (nothing is allocated), each
table's parameter given a row-wise Adagrad in backward
(`apply_optimizer_in_backward(RowWiseAdagrad)`, which the planner reads to
count the optimizer state); `ParameterConstraints.pooling_factors` carry the
ids per example. It prints one JSON line: per table the sharding type,
compute kernel, ranks and shards `[row offset, column offset, rows,
columns, rank]`, and per rank the HBM its own estimate gives the shards.

Only argparse, json and torch/torchrec: the torch venv has no absl.
"""

import argparse
import json
import sys
import time


def _versions():
  import fbgemm_gpu  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import torchrec  # pylint: disable=g-import-not-at-top
  return {"torch": torch.__version__, "fbgemm_gpu": fbgemm_gpu.__version__,
          "torchrec": torchrec.__version__}


def plan(problem: dict) -> dict:
  # pylint: disable=g-import-not-at-top
  import torch
  from torchrec import optim as trec_optim
  from torchrec.distributed.embedding import EmbeddingCollectionSharder
  from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
  from torchrec.distributed.planner import EmbeddingShardingPlanner
  from torchrec.distributed.planner import ParameterConstraints
  from torchrec.distributed.planner import Topology
  from torchrec.distributed.planner.storage_reservations import (
      FixedPercentageStorageReservation)
  from torchrec.modules.embedding_configs import DataType
  from torchrec.modules.embedding_configs import EmbeddingBagConfig
  from torchrec.modules.embedding_configs import EmbeddingConfig
  from torchrec.modules.embedding_modules import EmbeddingBagCollection
  from torchrec.modules.embedding_modules import EmbeddingCollection
  from torchrec.optim.apply_optimizer_in_backward import (
      apply_optimizer_in_backward)
  # pylint: enable=g-import-not-at-top

  dtypes = {"float32": DataType.FP32, "bfloat16": DataType.BF16}
  meta = torch.device("meta")
  bags, seqs, constraints = [], [], {}
  for t in problem["tables"]:
    kind = EmbeddingBagConfig if t["pooled"] else EmbeddingConfig
    (bags if t["pooled"] else seqs).append(kind(
        name=t["name"], num_embeddings=t["rows"], embedding_dim=t["width"],
        feature_names=list(t["features"]), data_type=dtypes[t["dtype"]]))
    constraints[t["name"]] = ParameterConstraints(
        pooling_factors=[float(k) for k in t["ids_per_example"]])
  model = torch.nn.Module()
  if bags:
    model.bags = EmbeddingBagCollection(tables=bags, device=meta)
  if seqs:
    model.seqs = EmbeddingCollection(tables=seqs, device=meta)
  apply_optimizer_in_backward(trec_optim.RowWiseAdagrad,
                              list(model.parameters()), {"lr": 0.01})
  topology = Topology(world_size=problem["world_size"],
                      compute_device="cuda", hbm_cap=problem["hbm_cap"],
                      local_world_size=problem["local_world_size"])
  planner = EmbeddingShardingPlanner(
      topology=topology, batch_size=problem["batch_size"],
      storage_reservation=FixedPercentageStorageReservation(
          problem["reserve_fraction"]),
      constraints=constraints, debug=False)
  start = time.perf_counter()
  sharding = planner.plan(model, [EmbeddingBagCollectionSharder(),
                                  EmbeddingCollectionSharder()])
  seconds = time.perf_counter() - start
  tables = {}
  for params in sharding.plan.values():
    for name, p in params.items():
      shards = [[*s.shard_offsets, *s.shard_sizes, s.placement.rank()]
                for s in (p.sharding_spec.shards if p.sharding_spec else ())]
      tables[name] = {"sharding_type": p.sharding_type,
                      "compute_kernel": p.compute_kernel,
                      "ranks": list(p.ranks or []), "shards": shards}
  hbm = [0] * problem["world_size"]
  for option in planner._best_plan or ():  # pylint: disable=protected-access
    for shard in option.shards:
      hbm[shard.rank] += shard.storage.hbm
  return {"tables": tables, "hbm_estimate_per_rank": hbm,
          "plan_seconds": seconds, "versions": _versions()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--probe", action="store_true",
                      help="import torch, fbgemm_gpu and torchrec's planner, "
                      "print versions")
  parser.add_argument("--problem", help="the problem's JSON file (default: "
                      "stdin)")
  args = parser.parse_args(argv)
  # Fails here, with its import error, if torchrec's planner is broken.
  # pylint: disable-next=g-import-not-at-top,unused-import
  from torchrec.distributed.planner import EmbeddingShardingPlanner
  if args.probe:
    print(json.dumps(_versions()))
    return 0
  if args.problem:
    with open(args.problem) as f:
      problem = json.load(f)
  else:
    problem = json.load(sys.stdin)
  print(json.dumps(plan(problem)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
