"""FBGEMM's CPU TBE side of `bench/fbgemm_compare.py` (runs in a torch venv).

Not imported by pallas_emb: `fbgemm_compare.py` starts it as a subprocess
with the python of a separate environment that has torch and fbgemm-gpu-cpu
(see the README section "CPU: pallas_emb vs FBGEMM"):

    $FBGEMM_PYTHON bench/fbgemm_worker.py --probe
    $FBGEMM_PYTHON bench/fbgemm_worker.py --data=DIR --jobs='[...]' \
        --out_dir=DIR --threads=1

`--data` is the workload directory `fbgemm_compare.py` wrote: `table.npy`
(f32 `[rows, width]`, the initial table of both sides, memory-mapped here)
and `workload.npz` (`ids` int32 `[B]` or `[B, L]`, `cotangent` f32
`[B, width]`, `unique_ids` int32, `lr`, `eps`). Each job (JSON) is one
`SplitTableBatchedEmbeddingBagsCodegen` on the host (`EmbeddingLocation.HOST`,
`ComputeDevice.CPU`, `EXACT_ROWWISE_ADAGRAD`, `PoolingMode.SUM` or `.NONE`,
weights `fp32` or `fp16`), trained `warmup + steps` times on the same ids:

    out = tbe(indices, offsets)     # [B, width] (SUM) / [N, width] (NONE)
    loss = (out * cotangent).sum()
    loss.backward()                 # the fused row-wise Adagrad runs here

Each step is timed with `time.perf_counter` (torch runs the CPU ops
synchronously). Per job it writes `<name>.npz` (the final rows and
row-wise accumulators at `unique_ids`) to `--out_dir` and prints one JSON
line per job: step times, losses, CPU/wall ratio, checksums of the whole
final table, how many rows moved.

Only argparse, numpy and torch: the torch venv has no absl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

CHUNK_ROWS = 1 << 20


def _versions() -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import fbgemm_gpu  # pylint: disable=g-import-not-at-top
  return {"torch": torch.__version__,
          "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
          "numpy": np.__version__, "python": platform.python_version(),
          "torch_threads": torch.get_num_threads(),
          "torch_interop_threads": torch.get_num_interop_threads(),
          "torch_parallel_info": torch.__config__.parallel_info().strip(),
          "affinity": sorted(os.sched_getaffinity(0)),
          "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def _tbe_modules():
  """fbgemm_gpu's TBE class and enums (fbgemm-gpu-cpu 1.8.0 names)."""
  # pylint: disable=g-import-not-at-top
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as common
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
  return (train.SplitTableBatchedEmbeddingBagsCodegen,
          common.EmbeddingLocation, train.ComputeDevice,
          configs.EmbOptimType, common.PoolingMode, configs.SparseType)


def table_summary(final, init, unique_ids, cast=None) -> dict:
  """Checksums of a `[rows, width]` table and which rows left `init`.

  Read chunk by chunk as f32: `final` (numpy, or anything `np.asarray`
  takes per chunk) and `init` (the f32 initial table), which `cast` (f32
  chunk -> f32 chunk) first rounds as the table's dtype stores it.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  total = total_abs = 0.0
  moved = np.zeros(final.shape[0], bool)
  for start in range(0, final.shape[0], CHUNK_ROWS):
    f = np.asarray(final[start:start + CHUNK_ROWS], np.float32)
    i = np.asarray(init[start:start + CHUNK_ROWS], np.float32)
    if cast is not None:
      i = cast(i)
    total += float(f.sum(dtype=np.float64))
    total_abs += float(np.abs(f).sum(dtype=np.float64))
    moved[start:start + f.shape[0]] = np.any(f != i, axis=1)
  touched = np.zeros(final.shape[0], bool)
  touched[unique_ids] = True
  return {"checksum": total, "abs_checksum": total_abs,
          "rows_moved": int(moved.sum()),
          "untouched_rows_moved": int((moved & ~touched).sum()),
          "touched_rows": int(touched.sum())}


class _AsF32:
  """Row slices of a torch tensor as f32 numpy arrays (no full copy)."""

  def __init__(self, tensor):
    self.tensor, self.shape = tensor, tuple(tensor.shape)

  def __getitem__(self, index):
    return self.tensor[index].float().numpy()


def run_job(job: dict, data_dir: str, out_dir: str) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  (tbe_cls, location, device, optim, pooling,
   sparse_type) = _tbe_modules()
  work = np.load(os.path.join(data_dir, "workload.npz"))
  init = np.load(os.path.join(data_dir, "table.npy"), mmap_mode="r")
  rows, width = init.shape
  ids = work["ids"]
  cotangent = torch.from_numpy(np.ascontiguousarray(work["cotangent"]))
  unique_ids = work["unique_ids"]
  bag = 1 if ids.ndim == 1 else ids.shape[1]
  mode = {"sum": pooling.SUM, "none": pooling.NONE}[job["pooling"]]
  if mode == pooling.NONE and bag != 1:
    raise ValueError("PoolingMode.NONE is the sequence path: bags of 1 only "
                     f"(got bags of {bag}).")
  precision = {"fp32": sparse_type.FP32, "fp16": sparse_type.FP16}[
      job["precision"]]
  tbe = tbe_cls(
      [(rows, width, location.HOST, device.CPU)],
      optimizer=optim.EXACT_ROWWISE_ADAGRAD,
      learning_rate=float(work["lr"]), eps=float(work["eps"]),
      weight_decay=0.0, pooling_mode=mode, weights_precision=precision,
      output_dtype=sparse_type.FP32,
      stochastic_rounding=bool(job.get("stochastic_rounding", True)))
  weights = tbe.split_embedding_weights()[0]
  with torch.no_grad():
    for start in range(0, rows, CHUNK_ROWS):
      weights[start:start + CHUNK_ROWS].copy_(torch.from_numpy(
          np.array(init[start:start + CHUNK_ROWS])))
  index_dtype = {"int64": torch.int64, "int32": torch.int32}[
      job.get("index_dtype", "int64")]
  indices = torch.from_numpy(ids.reshape(-1).astype(np.int64)).to(
      index_dtype)
  offsets = torch.arange(0, indices.numel() + 1, bag, dtype=index_dtype)
  if cotangent.shape[0] != offsets.numel() - 1:
    raise ValueError(f"cotangent {tuple(cotangent.shape)} for "
                     f"{offsets.numel() - 1} outputs")

  times, cpu, losses = [], [], []
  for i in range(job["warmup"] + job["steps"]):
    c0 = time.process_time()
    t0 = time.perf_counter()
    out = tbe(indices, offsets)
    loss = (out * cotangent).sum()
    loss.backward()
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    losses.append(float(loss.item()))
    if i >= job["warmup"]:
      times.append(elapsed)
      cpu.append(cpu_s)

  final = tbe.split_embedding_weights()[0].detach()
  momentum = tbe.split_optimizer_states()[0][0].detach()
  cast = None
  if final.dtype != torch.float32:
    # The initial table as this precision stores it, for "rows moved".
    def cast(x):
      return torch.from_numpy(np.array(x)).to(final.dtype).float().numpy()
  summary = table_summary(_AsF32(final), init, unique_ids, cast)
  summary["momentum_nonzero"] = int((momentum != 0).sum())
  path = os.path.join(out_dir, job["name"] + ".npz")
  touched = torch.from_numpy(unique_ids.astype(np.int64))
  np.savez(path, rows=final[touched].float().numpy(),
           row_state=momentum[touched].float().numpy())
  times_np = np.asarray(times)
  return {"name": job["name"], "pooling": job["pooling"],
          "precision": job["precision"],
          "index_dtype": job.get("index_dtype", "int64"),
          "stochastic_rounding": bool(job.get("stochastic_rounding", True)),
          "median_ms": 1e3 * float(np.median(times_np)),
          "p25_ms": 1e3 * float(np.percentile(times_np, 25)),
          "p75_ms": 1e3 * float(np.percentile(times_np, 75)),
          "min_ms": 1e3 * float(times_np.min()),
          "times_ms": [1e3 * t for t in times],
          "cpu_per_wall": float(sum(cpu) / sum(times)),
          "losses": losses, "steps": len(losses), "rows_file": path,
          "output_shape": list(out.shape), **summary}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--probe", action="store_true",
                      help="import torch and fbgemm_gpu, print versions")
  parser.add_argument("--data", help="workload directory")
  parser.add_argument("--jobs", help="JSON list of jobs")
  parser.add_argument("--out_dir", help="where <job>.npz files go")
  parser.add_argument("--threads", type=int, default=1,
                      help="torch intra-op threads")
  args = parser.parse_args(argv)
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.threads)
  try:
    torch.set_num_interop_threads(1)
  except RuntimeError:
    pass
  _tbe_modules()  # fails here, with its import error, if fbgemm is broken
  if args.probe:
    print(json.dumps(_versions()))
    return 0
  if not (args.data and args.jobs and args.out_dir):
    parser.error("--data, --jobs and --out_dir are required without --probe")
  for job in json.loads(args.jobs):
    result = run_job(job, args.data, args.out_dir)
    result["versions"] = _versions()
    print("RESULT " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
