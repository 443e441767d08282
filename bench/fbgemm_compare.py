"""pallas_emb vs FBGEMM's CPU TBE on the same workload, in one run.

    python -m bench.fbgemm_compare --fbgemm_python=/work/fbgemm_venv/bin/python
    python -m bench.fbgemm_compare --workloads=a:1e6:16384:1 --steps=10
    python -m bench.fbgemm_compare --json_out=/tmp/fbgemm.json --profile

A workload is `name:rows:batch:bag` (`--workloads`): one table `[rows,
--emb_width]` f32, `batch` examples of `bag` Zipf(`--zipf`) ids each
(`pallas_emb.datasets.zipf_ids`, ids in [1, rows - 1], the hot ones spread
or the lowest, `--hot_ids`; the same ids every step), a fixed random cotangent `[batch, width]` and the loss
`sum(emb * cotangent)`, so both sides get identical gradients. Every step is
forward + backward + exact row-wise Adagrad (`--lr`, `--eps`, accumulators
start at 0). The defaults are (a) bags of 1, 1M rows, 16,384 ids; (b) bags
of 20, 1M rows, 16,384 x 20 ids; (c) bags of 1, 10M rows, 65,536 ids.

The workload is generated once here (numpy) and written to a temporary
directory (`table.npy`, the initial table both sides start from, and
`workload.npz`: ids, cotangent, unique ids, lr, eps) that both sides read.

pallas_emb side (this process): an `EmbeddingCollection` of that one table
on a 1-device mesh, backend "xla", `RowwiseAdagrad(lr, eps=eps)`; per
`--dtypes` (float32, bfloat16) and `--pallas_cases`: `sequence`
(`FeatureSpec("f", "t")` on ids `[B]`, bags of 1 only), `pooled`
(`combiner="sum"` on ids `[B, L]`) and `pooled_fit` (the same, with the
collection's unique buffer fit to the workload's ids by
`coll.fit_max_unique([batch], headroom=--fit_headroom)` instead of sized
for every id distinct); a case name ending in `_map` (`sequence_map`,
`pooled_map`, `pooled_fit_map`) runs the same with
`EmbeddingCollection(dedup="slot_map")`, the sort-free dedup, so one run
can time both dedups; `default` is the pooled feature on a collection built
with no tuning argument (backend, dedup and unique buffer as a user gets
them), the case the defaults must make fast. One jitted step, the state
donated:

    emb, routing = coll.lookup_and_route(state, {"f": ids})
    loss, g = jax.value_and_grad(lambda e: sum(e["f"] * cotangent))(emb)
    state, _ = coll.apply_gradients(state, routing, g)

(the loss is returned, so XLA cannot drop the forward gather).

FBGEMM side (`bench/fbgemm_worker.py`, a subprocess run with
`--fbgemm_python`, default env `PALLAS_EMB_FBGEMM_PYTHON`, a venv with
torch and fbgemm-gpu-cpu): `SplitTableBatchedEmbeddingBagsCodegen` with
`EmbeddingLocation.HOST`, `ComputeDevice.CPU`, `EXACT_ROWWISE_ADAGRAD`,
`PoolingMode.SUM` (offsets every `bag` ids) and, for bags of 1,
`PoolingMode.NONE` (the sequence path TorchRec's EmbeddingCollection runs);
per `--fbgemm_precisions` (fp32; fp16, FBGEMM's CPU half table: its CPU
forward has no bf16). Without that python, or if it cannot import
fbgemm_gpu, the FBGEMM rows are skipped with a message saying why.

Threads: `--threads=1` (default) makes both sides single-threaded: XLA_FLAGS
gets `--xla_cpu_multi_thread_eigen=false` (XLA:CPU has no thread-count
flag: other values leave XLA as it is), the worker calls
`torch.set_num_threads(1)` (OMP/MKL_NUM_THREADS=1), and
`--pin_cpus` (default "0") pins this process and the worker (inherited) to
those cores. Every case records CPU time / wall time of its timed steps
(~1.0 = one busy thread) and the settings.

Timing: `--warmup` untimed steps, then the median of `--steps` step times
(wall, after the result is ready). Both sides run the same number of steps
on the same ids, then the final tables are compared: checksums of the whole
table, rows that moved (must be exactly the touched rows), the max abs
difference of the touched rows and of their row-wise accumulators, and the
per-step losses.

`--profile`: after the timed steps of every pallas_emb case, a few
more steps under `jax.profiler` (perfetto trace), summed per XLA op: the top
ops of a step (also in `--json_out`).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from bench import peer

_WORKLOADS = flags.DEFINE_list(
    "workloads", ["a:1000000:16384:1", "b:1000000:16384:20",
                  "c:10000000:65536:1"],
    "Workloads name:rows:batch:bag (bag = ids per example).")
_WIDTH = flags.DEFINE_integer("emb_width", 64, "Table width.")
_ZIPF = flags.DEFINE_float("zipf", 1.05, "Zipf exponent of the ids (0: "
                           "uniform).")
_HOT_IDS = flags.DEFINE_enum(
    "hot_ids", "permuted", ["permuted", "low"],
    "Which ids are hot: spread by a random permutation (hashed ids), or the "
    "lowest ids the hottest (an unhashed vocabulary sorted by frequency).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per case.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps first.")
_LR = flags.DEFINE_float("lr", 0.01, "Row-wise Adagrad learning rate.")
_EPS = flags.DEFINE_float("eps", 1e-8, "Row-wise Adagrad eps.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of table, ids, cotangent.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"],
                            "pallas_emb table dtypes.")
_PALLAS_CASES = flags.DEFINE_list(
    "pallas_cases", ["default", "pooled_fit_map", "sequence_map"],
    "pallas_emb features (bags > 1 run the pooled ones); `default`: the "
    "pooled feature on a collection with no tuning arguments; `_fit`: the "
    "collection's max_unique fit to the workload's ids "
    "(`EmbeddingCollection.fit_max_unique`, --fit_headroom); a `_map` "
    "suffix (e.g. pooled_fit_map): dedup='slot_map' instead of the sort.")
_FIT_HEADROOM = flags.DEFINE_float(
    "fit_headroom", 1.25, "Headroom of the `_fit` cases' max_unique.")
FBGEMM_ENV = "PALLAS_EMB_FBGEMM_PYTHON"
_FBGEMM_PYTHON = flags.DEFINE_string(
    "fbgemm_python", peer.default_python(FBGEMM_ENV),
    "Python of a venv with torch and fbgemm-gpu-cpu (default: env "
    "PALLAS_EMB_FBGEMM_PYTHON); empty: skip the FBGEMM rows.")
_FBGEMM_PRECISIONS = flags.DEFINE_list(
    "fbgemm_precisions", ["fp32", "fp16"], "FBGEMM weights precisions.")
_FBGEMM_SEQUENCE = flags.DEFINE_bool(
    "fbgemm_sequence", True,
    "Also run FBGEMM's PoolingMode.NONE (sequence) path for bags of 1.")
_THREADS = flags.DEFINE_integer(
    "threads", 1, "Threads of each side: 1 makes XLA:CPU's ops and torch "
    "single-threaded; N > 1 sets torch's threads and leaves XLA's default; "
    "0 leaves both libraries' defaults.")
_PIN = flags.DEFINE_list("pin_cpus", ["0"],
                         "Pin both processes to these cores; '' for none.")
_TMP = flags.DEFINE_string("tmp_dir", None,
                           "Where the workload files go (default: $TMPDIR).")
_PROFILE = flags.DEFINE_bool(
    "profile", False, "Profile the pallas_emb cases (top XLA ops).")
_PROFILE_STEPS = flags.DEFINE_integer("profile_steps", 5,
                                      "Steps traced per profiled case.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "fbgemm_worker.py")
SKIP = "FBGEMM rows skipped:"
BUILD_HINT = ("build one outside the repository: python3 -m venv "
              "/work/fbgemm_venv && /work/fbgemm_venv/bin/pip install "
              "torch==2.13.0 fbgemm-gpu-cpu==1.8.0 numpy")
# pallas_emb dtype -> the FBGEMM precision of the same width.
MATCHING_PRECISION = {"float32": "fp32", "bfloat16": "fp16"}
# pallas_emb feature -> the FBGEMM pooling mode that computes the same.
MATCHING_POOLING = {"sequence": "none", "pooled": "sum"}


def parse_workload(spec: str) -> dict:
  """'a:1e6:16384:1' -> {name, rows, batch, bag}."""
  parts = spec.split(":")
  if len(parts) != 4:
    raise app.UsageError(f"--workloads entry {spec!r}: expected "
                         "name:rows:batch:bag, e.g. a:1000000:16384:1.")
  name, rows, batch, bag = parts
  try:
    rows, batch, bag = (int(float(x)) for x in (rows, batch, bag))
  except ValueError as e:
    raise app.UsageError(f"--workloads entry {spec!r}: {e}") from e
  if rows < 2 or batch < 1 or bag < 1:
    raise app.UsageError(f"--workloads entry {spec!r}: needs rows >= 2, "
                         "batch >= 1, bag >= 1.")
  return {"name": name, "rows": rows, "batch": batch, "bag": bag}


def _loadavg():
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def configure(threads: int, pin: list[int]) -> dict:
  """Platform and thread settings of this process, before JAX starts.

  A CPU comparison: JAX runs on the CPU even where a GPU is present.
  """
  os.environ["JAX_PLATFORMS"] = "cpu"
  if pin:
    os.sched_setaffinity(0, pin)
  if threads == 1:
    # XLA:CPU has no thread-count flag; this one makes its ops one thread.
    parts = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(
        parts + ["--xla_cpu_multi_thread_eigen=false"])
  return {"xla_flags": os.environ.get("XLA_FLAGS", ""),
          "affinity": sorted(os.sched_getaffinity(0)),
          # glibc malloc settings change XLA:CPU's per-step page faults.
          "malloc_env": {k: v for k, v in os.environ.items()
                         if k.startswith("MALLOC_")}}


# ---------------------------------------------------------------------------
# the workload
# ---------------------------------------------------------------------------


def write_workload(work: dict, directory: str, width: int, zipf: float,
                   seed: int, lr: float, eps: float,
                   hot_ids: str = "permuted") -> dict:
  """The workload's files; returns its small arrays."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from pallas_emb.datasets import zipf_ids
  os.makedirs(directory, exist_ok=True)
  rng = np.random.default_rng(seed)
  rows, batch, bag = work["rows"], work["batch"], work["bag"]
  table = np.lib.format.open_memmap(os.path.join(directory, "table.npy"),
                                    "w+", np.float32, (rows, width))
  scale = np.float32(width ** -0.5)  # nn.Embed's N(0, 1 / width)
  chunk = 1 << 20
  for start in range(0, rows, chunk):
    n = min(chunk, rows - start)
    table[start:start + n] = rng.standard_normal((n, width),
                                                 np.float32) * scale
  table.flush()
  del table
  # Write the file back now: its dirty pages would otherwise be flushed
  # while the first case is timed.
  os.sync()
  ids = zipf_ids(rng, rows - 1, batch * bag, zipf,
                 permute=hot_ids == "permuted")
  ids = ids.reshape(batch) if bag == 1 else ids.reshape(batch, bag)
  cotangent = rng.standard_normal((batch, width), np.float32)
  unique_ids = np.unique(ids).astype(np.int32)
  arrays = {"ids": ids.astype(np.int32), "cotangent": cotangent,
            "unique_ids": unique_ids, "lr": np.float64(lr),
            "eps": np.float64(eps)}
  np.savez(os.path.join(directory, "workload.npz"), **arrays)
  return arrays


# ---------------------------------------------------------------------------
# pallas_emb side
# ---------------------------------------------------------------------------


def pallas_step(coll, jax, jnp):
  """The jitted training step (state donated); returns (state, loss)."""

  def step(state, ids, cotangent):
    emb, routing = coll.lookup_and_route(state, {"f": ids})

    def loss_fn(e):
      return jnp.sum(e["f"].astype(jnp.float32) * cotangent)

    loss, grads = jax.value_and_grad(loss_fn)(emb)
    state, _ = coll.apply_gradients(state, routing, grads)
    return state, loss

  return jax.jit(step, donate_argnums=0)


def run_pallas(work: dict, arrays: dict, directory: str, dtype_name: str,
               kind: str, warmup: int, steps: int, profile: bool) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from bench import fbgemm_worker
  from pallas_emb.testing.hlo import full_table_ops

  dtype = jnp.dtype(dtype_name)
  width = _WIDTH.value
  feature_kind = base_case(kind)
  mesh = jax.make_mesh((1,), ("x",))
  table_spec = pe.TableSpec(
      "t", work["rows"], width, dtype=dtype,
      optimizer=pe.RowwiseAdagrad(float(arrays["lr"]),
                                  eps=float(arrays["eps"])))
  feature = pe.FeatureSpec(
      "f", "t", combiner=None if feature_kind == "sequence" else "sum")
  if kind == "default":
    coll = pe.EmbeddingCollection([table_spec], [feature], mesh, "x")
  else:
    coll = pe.EmbeddingCollection(
        [table_spec], [feature], mesh, "x", backend="xla",
        dedup="slot_map" if kind.endswith("_map") else "sort")
  init = np.load(os.path.join(directory, "table.npy"), mmap_mode="r")
  table = jax.jit(lambda x: x.astype(dtype))(init)
  state = coll.state_from_arrays({"t": table})
  del table
  ids = arrays["ids"]
  if feature_kind == "pooled" and ids.ndim == 1:
    ids = ids[:, None]
  ids = jax.device_put(ids)
  if base_case(kind, fit=False).endswith("_fit"):
    coll = coll.fit_max_unique([{"f": ids}], headroom=_FIT_HEADROOM.value)
  cotangent = jax.device_put(arrays["cotangent"])
  compiled = pallas_step(coll, jax, jnp).lower(state, ids,
                                                    cotangent).compile()
  # Table-sized copies / converts / full passes in the step (bench.bench's
  # `full_table_ops` count): 0 means the step costs O(batch), not O(rows).
  big_ops = full_table_ops(compiled.as_text(), work["rows"],
                           min_elements=work["rows"] * width)
  load_before = _loadavg()
  times, cpu, losses = [], [], []
  for i in range(warmup + steps):
    c0 = time.process_time()
    t0 = time.perf_counter()
    state, loss = compiled(state, ids, cotangent)
    loss = jax.block_until_ready(loss)
    elapsed = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    losses.append(float(loss))
    if i >= warmup:
      times.append(elapsed)
      cpu.append(cpu_s)
  load_after = _loadavg()
  stack = state.stacks["stack0"]
  final = np.asarray(jax.device_get(coll.table_arrays(state)["t"]))
  row_state = np.asarray(jax.device_get(stack.opt_state.row_state))
  cast = None
  if dtype != jnp.float32:
    cast = lambda x: np.asarray(x).astype(dtype).astype(np.float32)
  summary = fbgemm_worker.table_summary(final, init, arrays["unique_ids"],
                                        cast)
  summary["momentum_nonzero"] = int(np.count_nonzero(row_state))
  rows = final[arrays["unique_ids"]].astype(np.float32)
  row_state = row_state[arrays["unique_ids"]]
  del final
  result = {"side": "pallas_emb", "case": kind, "dtype": dtype_name,
            **_timing(times, cpu), "losses": losses, "steps": len(losses),
            "loadavg_before": load_before, "loadavg_after": load_after,
            "full_table_ops": [f"{b.opcode}:{b.name}:{b.shape}"
                               for b in big_ops],
            **summary, "_rows": rows, "_row_state": row_state}
  if profile:
    result["profile"] = profile_steps(compiled, state, ids, cotangent,
                                      _PROFILE_STEPS.value)
  return result


def _timing(times, cpu) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  t = np.asarray(times)
  return {"median_ms": 1e3 * float(np.median(t)),
          "p25_ms": 1e3 * float(np.percentile(t, 25)),
          "p75_ms": 1e3 * float(np.percentile(t, 75)),
          "min_ms": 1e3 * float(t.min()),
          "times_ms": [1e3 * x for x in times],
          "cpu_per_wall": float(sum(cpu) / sum(times))}


def profile_steps(compiled, state, ids, cotangent, steps: int) -> dict:
  """`steps` more steps under the JAX profiler: time per XLA op and step.

  Reads the perfetto trace (Chrome JSON) the profiler writes: XLA:CPU's
  executor records one complete event per HLO op it runs (`args.hlo_op`).
  Times are exclusive (a while loop's own time excludes its body's ops,
  which are listed as `while.N/op`), per step, next to each op's shape and
  the jax op it came from (the compiled HLO's metadata).
  """
  import jax  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    times = []
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = compiled(state, ids, cotangent)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    paths = [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs
             if f.endswith("perfetto_trace.json.gz")]
    if not paths:
      return {"error": "the profiler wrote no perfetto trace"}
    with gzip.open(paths[0], "rt") as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return summarize_trace(events, steps, statistics.median(times),
                         hlo_ops(compiled.as_text()))


def hlo_ops(text: str) -> dict[str, str]:
  """HLO instruction name -> 'shape opcode [kind] <- jax op' (compiled)."""
  out = {}
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$", line)
    if not m:
      continue
    name, rest = m.groups()
    op = re.search(r"\s([a-z][a-z0-9\-]*)\(", " " + rest)
    if not op:
      continue
    shape = rest[:max(op.start() - 1, 0)].strip()
    kind = re.search(r"kind=(\w+)", rest)
    source = re.search(r'op_name="([^"]+)"', rest)
    out[name] = (f"{shape} {op.group(1)}"
                 + (f" {kind.group(1)}" if kind else "")
                 + (f" <- {source.group(1)}" if source else ""))
  return out


def summarize_trace(events, steps: int, step_s: float,
                    ops_info: dict[str, str] | None = None,
                    top: int = 40) -> dict:
  """Exclusive ms per step of each HLO op in a trace's complete events."""
  ops_info = ops_info or {}
  per_thread: dict = {}
  for e in events:
    if (e.get("ph") == "X" and "dur" in e and
        (e.get("args") or {}).get("hlo_op")):
      per_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
  totals: dict[str, float] = {}
  counts: dict[str, int] = {}
  for evs in per_thread.values():
    evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # [name, end, time of its children, duration]

    def close(entry):
      name, _, child, dur = entry
      totals[name] = totals.get(name, 0.0) + dur - child
      counts[name] = counts.get(name, 0) + 1

    for e in evs:
      while stack and e["ts"] >= stack[-1][1]:
        close(stack.pop())
      op = e["args"]["hlo_op"]
      name = f"{stack[-1][0]}/{op}" if stack else op
      if stack:
        stack[-1][2] += e["dur"]
      stack.append([name, e["ts"] + e["dur"], 0.0, e["dur"]])
    while stack:
      close(stack.pop())
  names = sorted(totals, key=totals.get, reverse=True)
  return {"step_ms": 1e3 * step_s, "traced_steps": steps,
          "ops_ms_per_step": sum(totals.values()) / 1e3 / steps,
          "top_ops": [{"op": n, "ms_per_step": totals[n] / 1e3 / steps,
                       "calls_per_step": counts[n] / steps,
                       "hlo": ops_info.get(n.split("/")[-1], "")}
                      for n in names[:top]]}


# ---------------------------------------------------------------------------
# FBGEMM side
# ---------------------------------------------------------------------------


def probe_fbgemm(python: str, threads: int) -> tuple[dict | None, str]:
  """(versions, "") if `python` runs the worker, else (None, why not)."""
  return peer.probe(python, WORKER,
                    ["--probe", f"--threads={max(threads, 1)}"],
                    skip=SKIP, what="FBGEMM", flag="--fbgemm_python",
                    env_names=(FBGEMM_ENV,), imports="torch / fbgemm_gpu",
                    hint=BUILD_HINT, threads=threads)


def run_fbgemm(python: str, directory: str, jobs: list[dict],
               threads: int) -> list[dict]:
  out_dir = os.path.join(directory, "fbgemm_out")
  os.makedirs(out_dir, exist_ok=True)
  results = []
  for job in jobs:  # one process per job: each starts with a cold cache
    load_before = _loadavg()
    cmd = [python, WORKER, f"--data={directory}", f"--jobs={json.dumps([job])}",
           f"--out_dir={out_dir}", f"--threads={max(threads, 1)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env=peer.worker_env(threads))
    if proc.returncode:
      raise RuntimeError(f"FBGEMM worker failed ({' '.join(cmd)}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    for line in lines:
      import numpy as np  # pylint: disable=g-import-not-at-top
      r = json.loads(line[len("RESULT "):])
      saved = np.load(r.pop("rows_file"))
      r.update(side="fbgemm", case=f"{r['pooling']}",
               dtype=r["precision"], loadavg_before=load_before,
               loadavg_after=_loadavg(), _rows=saved["rows"],
               _row_state=saved["row_state"])
      results.append(r)
  return results


# ---------------------------------------------------------------------------
# comparison and output
# ---------------------------------------------------------------------------


def compare(a: dict, b: dict) -> dict:
  """How far two sides' final states are apart (same workload)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows_a, rows_b = a["_rows"], b["_rows"]
  diff = np.abs(rows_a - rows_b)
  state_a, state_b = a["_row_state"], b["_row_state"]
  rel_state = np.abs(state_a - state_b) / np.maximum(
      np.abs(state_b), np.finfo(np.float32).tiny)
  la, lb = np.asarray(a["losses"]), np.asarray(b["losses"])
  n = min(la.size, lb.size)
  return {"a": _label(a), "b": _label(b),
          "checksum_a": a["checksum"], "checksum_b": b["checksum"],
          "checksum_diff": a["checksum"] - b["checksum"],
          "max_abs_diff_rows": float(diff.max()) if diff.size else 0.0,
          "mean_abs_diff_rows": float(diff.mean()) if diff.size else 0.0,
          "rows_bit_equal": float(np.mean(np.all(rows_a == rows_b, axis=1)))
          if diff.size else 1.0,
          "max_rel_diff_row_state": float(rel_state.max())
          if rel_state.size else 0.0,
          "max_rel_diff_loss": float(np.max(np.abs(la[:n] - lb[:n]) /
                                            np.maximum(np.abs(lb[:n]),
                                                       1e-30))),
          "rows_moved": [a["rows_moved"], b["rows_moved"]],
          "untouched_rows_moved": [a["untouched_rows_moved"],
                                   b["untouched_rows_moved"]]}


def base_case(case: str, fit: bool = True) -> str:
  """'pooled_fit_map' -> 'pooled': the feature a pallas_emb case runs
  ('pooled_fit' with fit=False; 'default' runs the pooled one)."""
  if case == "default":
    return "pooled"
  case = case.removesuffix("_map")
  return case.removesuffix("_fit") if fit else case


def _label(r: dict) -> str:
  return f"{r['side']} {r['case']} {r['dtype']}"


def match(pallas: dict, fbgemm: list[dict]) -> dict | None:
  """The FBGEMM case computing the same thing at the same width."""
  want_precision = MATCHING_PRECISION.get(pallas["dtype"])
  for pooling in (MATCHING_POOLING[base_case(pallas["case"])], "sum"):
    for r in fbgemm:
      if r["pooling"] == pooling and r["precision"] == want_precision:
        return r
  return None


def format_table(records: list[dict]) -> str:
  head = ("workload", "side", "case", "dtype", "median ms", "IQR ms",
          "cpu/wall", "FBGEMM match", "speed vs FBGEMM")
  rows = [head]
  for r in records:
    m = r.get("match")
    rows.append((r["workload"], r["side"], r["case"], r["dtype"],
                 f"{r['median_ms']:.2f}",
                 f"{r['p75_ms'] - r['p25_ms']:.2f}",
                 f"{r['cpu_per_wall']:.2f}",
                 f"{m['case']} {m['dtype']} {m['median_ms']:.2f} ms"
                 if m else "-",
                 f"{r['speed_vs_fbgemm']:.2f}x" if m else "-"))
  widths = [max(len(str(x[i])) for x in rows) for i in range(len(head))]
  lines = ["  ".join(str(c).rjust(w) for c, w in zip(x, widths))
           for x in rows]
  lines.insert(1, "-" * len(lines[0]))
  return "\n".join(lines + default_vs_tuned(records))


def default_vs_tuned(records: list[dict]) -> list[str]:
  """Per workload and dtype, the default collection's time over the
  fastest other pallas_emb case's (the best tuned one in the run)."""
  lines = []
  ours = [r for r in records if r["side"] == "pallas_emb"]
  for key in dict.fromkeys((r["workload"], r["dtype"]) for r in ours):
    same = [r for r in ours if (r["workload"], r["dtype"]) == key]
    default = [r for r in same if r["case"] == "default"]
    tuned = [r for r in same if r["case"] != "default"
             and base_case(r["case"]) == "pooled"]
    if default and tuned:
      best = min(tuned, key=lambda r: r["median_ms"])
      lines.append(
          f"{key[0]} {key[1]}: default {default[0]['median_ms']:.2f} ms = "
          f"{default[0]['median_ms'] / best['median_ms']:.2f}x the best "
          f"tuned case ({best['case']}, {best['median_ms']:.2f} ms)")
  return lines


def _public(r: dict) -> dict:
  return {k: v for k, v in r.items() if not k.startswith("_")}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  works = [parse_workload(w) for w in _WORKLOADS.value]
  pin = [int(c) for c in _PIN.value if c]
  threads = configure(_THREADS.value, pin)
  import jax  # pylint: disable=g-import-not-at-top
  # Before JAX starts: its malloc settings apply only then (cpu_malloc).
  import pallas_emb  # pylint: disable=g-import-not-at-top,unused-import

  versions, skipped = probe_fbgemm(_FBGEMM_PYTHON.value, _THREADS.value)
  if skipped:
    print(skipped, flush=True)
  doc = {"meta": {
      "jax": jax.__version__, "platform": jax.devices()[0].platform,
      "commit": peer.git_head(),
      "cpu_count": os.cpu_count(), "threads_flag": _THREADS.value,
      "pallas_emb_threads": threads, "fbgemm_versions": versions,
      "fbgemm_skipped": skipped or None, "argv": sys.argv,
      "time": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": _loadavg(),
      "warmup": _WARMUP.value, "steps": _STEPS.value, "lr": _LR.value,
      "eps": _EPS.value, "zipf": _ZIPF.value, "hot_ids": _HOT_IDS.value, "emb_width": _WIDTH.value},
      "results": [], "comparisons": []}
  print(f"# jax {jax.__version__} ({doc['meta']['platform']}), XLA_FLAGS="
        f"{threads['xla_flags']!r}, affinity {threads['affinity']}"
        + (f"; torch {versions['torch']}, fbgemm_gpu {versions['fbgemm_gpu']}"
           f", torch threads {versions['torch_threads']}"
           if versions else ""), flush=True)

  def save():
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump(doc, f, indent=1, default=str)

  root = tempfile.mkdtemp(prefix="fbgemm_compare_", dir=_TMP.value)
  try:
    for work in works:
      directory = os.path.join(root, work["name"])
      t0 = time.perf_counter()
      arrays = write_workload(work, directory, _WIDTH.value, _ZIPF.value,
                              _SEED.value, _LR.value, _EPS.value,
                              _HOT_IDS.value)
      work = dict(work, unique_ids=int(arrays["unique_ids"].size),
                  ids=int(arrays["ids"].size))
      print(f"workload {work['name']}: {work['rows']} rows x "
            f"{_WIDTH.value}, {work['batch']} bags of {work['bag']} "
            f"({work['unique_ids']} distinct ids), written in "
            f"{time.perf_counter() - t0:.1f} s", flush=True)
      kinds = [k for k in _PALLAS_CASES.value
               if work["bag"] == 1 or base_case(k) == "pooled"]
      pallas = []
      for dtype in _DTYPES.value:
        for kind in kinds:
          r = run_pallas(work, arrays, directory, dtype, kind,
                         _WARMUP.value, _STEPS.value,
                         _PROFILE.value)
          r["workload"] = work["name"]
          pallas.append(r)
          print(f"  pallas_emb {kind} {dtype}: {r['median_ms']:.2f} ms "
                f"(cpu/wall {r['cpu_per_wall']:.2f}; table-sized ops in "
                f"the step: {r['full_table_ops'] or 'none'})", flush=True)
          if "profile" in r:
            prof = r["profile"]
            print(f"    profile: {prof['ops_ms_per_step']:.2f} ms of XLA ops "
                  f"per step ({prof['step_ms']:.2f} ms traced step)")
            for op in prof["top_ops"][:10]:
              print(f"    {op['ms_per_step']:8.3f} ms  {op['op']}: "
                    f"{op['hlo'][:110]}")
      fbgemm = []
      if versions:
        jobs = []
        poolings = ["sum"] + (["none"] if work["bag"] == 1 and
                              _FBGEMM_SEQUENCE.value else [])
        for precision in _FBGEMM_PRECISIONS.value:
          for pooling in poolings:
            jobs.append({"name": f"{pooling}_{precision}", "pooling": pooling,
                         "precision": precision, "warmup": _WARMUP.value,
                         "steps": _STEPS.value})
        fbgemm = run_fbgemm(_FBGEMM_PYTHON.value, directory, jobs,
                            _THREADS.value)
        for r in fbgemm:
          r["workload"] = work["name"]
          print(f"  FBGEMM {r['pooling']} {r['precision']}: "
                f"{r['median_ms']:.2f} ms (cpu/wall "
                f"{r['cpu_per_wall']:.2f})", flush=True)
      for r in pallas:
        m = match(r, fbgemm)
        if m is not None:
          r["match"] = {"case": m["case"], "dtype": m["dtype"],
                        "median_ms": m["median_ms"]}
          r["speed_vs_fbgemm"] = m["median_ms"] / r["median_ms"]
      everyone = pallas + fbgemm
      for i, a in enumerate(everyone):
        for b in everyone[i + 1:]:
          c = compare(a, b)
          c["workload"] = work["name"]
          doc["comparisons"].append(c)
          if a["side"] != b["side"] and MATCHING_PRECISION.get(
              a["dtype"]) == b["dtype"] == "fp32":
            print(f"  final tables {c['a']} vs {c['b']}: checksums "
                  f"{c['checksum_a']:.6f} / {c['checksum_b']:.6f}, max "
                  f"|diff| {c['max_abs_diff_rows']:.3g} over "
                  f"{work['unique_ids']} touched rows, row state rel "
                  f"{c['max_rel_diff_row_state']:.3g}, loss rel "
                  f"{c['max_rel_diff_loss']:.3g}, rows moved "
                  f"{c['rows_moved']}", flush=True)
      doc["results"] += [dict(_public(r), **{"workload_spec": work})
                         for r in everyone]
      shutil.rmtree(directory, ignore_errors=True)
      save()
  finally:
    shutil.rmtree(root, ignore_errors=True)
  doc["meta"]["loadavg_end"] = _loadavg()
  table = format_table(doc["results"])
  doc["table"] = table
  print(table)
  if skipped:
    print(skipped)
  save()
  if _JSON_OUT.value:
    print(f"wrote {_JSON_OUT.value}")


if __name__ == "__main__":
  app.run(main)
