"""Benchmarks of the public API: lookup, sparse update, a full sparse step.

Run from the repository root (`pip install -e ".[examples]"` brings optax and
matplotlib):

    python -m bench.bench --what=step --num_devices=8
    python -m bench.bench --what=lookup --dtype=float32,bfloat16
    python -m bench.bench --what=step --scan --plot_out=scan.png

What is timed (each jitted, table and optimizer state donated):

  lookup  `pe.lookup` of one batch;
  update  `pe.dedup` + `pe.apply_gradients` with given embedding gradients;
  step    lookup -> `jax.grad` of a trivial dense loss w.r.t. the embeddings
          -> dedup -> apply_gradients.

Every requested backend runs next to two baselines, in the same process and
interleaved round by round (so machine noise hits all of them alike):
`dense` (a replicated table, `jnp.take`, `jax.grad` w.r.t. the whole table
and `optax.adagrad`, donated) and the `xla` backend of this library. A
jitted `x + 1` over a large buffer gives the memory-copy bandwidth of the
same run. Reported per case: median and spread (IQR, min/max) after
warm-up; tokens/s; the bytes the piece must move (gathered rows; touched rows
read + written; row state; gradients) per second and as a fraction of the
copy bandwidth; the compiled executable's `memory_analysis()` (per device);
the bytes each collective moves per step, read from the compiled HLO, next
to the analytic minimum of the column-sharded layout; and how many ops of
the optimized HLO produce table-sized arrays (copies / converts / full
passes; see `pallas_emb.testing.hlo.full_table_ops`).

Timing: after `--warmup` rounds, each of `--repeats` rounds runs every case
`--burst` times in a row and keeps all but the first call of the burst
(which pays for the cache state the previous case left). Ids cycle through
`--num_batches` Zipf batches, so most calls see a fresh batch (the hot head
of the distribution stays cached, the tail does not, as in training). The
ids are `pallas_emb.datasets.zipf_ids` over rows 1..vocab_rows-1 (row 0, the
padding id, gets no gradient and is never drawn), all batches from one draw,
so the same rows are hot in every batch. On a
GPU the kept calls of a burst are dispatched back to back and waited for
once (`--pipelined_timing`). The kernels alone (Pallas vs their xla twins,
and their block-size sweeps) are `python -m bench.kernels`.

Sizes are in absl flags (`--help`), optionally preset by
`--config=configs/bench_x.py` (a python file whose `get_config()` returns a
dict or dataclass of flag values; flags given on the command line win).

On CPU, `--num_devices=N` simulates N devices
(`--xla_force_host_platform_device_count`, set before JAX starts its
backend). Simulated devices share the host's cores and memory, so the
bandwidth fraction compares whole-system bytes with one copy's bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Callable

from absl import app
from absl import flags

from examples.config import load_file
from pallas_emb.datasets import zipf_ids
from pallas_emb.testing.hlo import collective_bytes
from pallas_emb.testing.hlo import full_table_ops

WHATS = ("lookup", "update", "step")

_WHAT = flags.DEFINE_enum("what", "step", WHATS, "Piece to time.")
_CONFIG = flags.DEFINE_string(
    "config", None, "Python file with get_config() -> dict/dataclass of flag "
    "values (command-line flags override it).")
_VOCAB = flags.DEFINE_integer("vocab_rows", 1_000_000, "Table rows.")
_WIDTH = flags.DEFINE_integer("emb_width", 64, "Embedding width.")
_TOKENS = flags.DEFINE_integer("tokens_per_batch", 16_384,
                               "Ids per global batch.")
_ZIPF = flags.DEFINE_float(
    "zipf", 1.05, "Zipf exponent of the ids (truncated to the table); 0 for "
    "uniform ids.")
_PERMUTE = flags.DEFINE_bool(
    "permute_ids", True, "Scatter the hot ids over the table (a seeded "
    "random permutation of the rows, the same for every batch) instead of "
    "leaving them at its start.")
_NUM_DEVICES = flags.DEFINE_integer(
    "num_devices", 1, "Devices in the mesh (simulated on CPU).")
_DTYPE = flags.DEFINE_list("dtype", ["float32"],
                           "Table dtype(s): float32, bfloat16.")
_BACKENDS = flags.DEFINE_list(
    "backends", ["xla"], "Library backends to time (pallas_emb.BACKENDS), "
    "e.g. xla, pallas, mosaic_tpu, interpret.")
_BASELINES = flags.DEFINE_list(
    "baselines", ["dense", "xla"],
    "Baselines timed in the same run (dense, xla); '' for none.")
_ALSO_VOCAB = flags.DEFINE_list(
    "also_vocab_rows", [], "More table sizes timed in the same rounds as "
    "--vocab_rows (e.g. 1e7, to compare sizes interleaved).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed rounds first.")
_BURST = flags.DEFINE_integer(
    "burst", 5, "Calls per case per round; the first of each burst is not "
    "counted (cache state left by the previous case). 1: cold, every call "
    "counted.")
_NUM_BATCHES = flags.DEFINE_integer(
    "num_batches", 16, "Distinct id batches, cycled call by call (fresh ids "
    "most calls, as in training: the Zipf head stays cached, the tail not).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of ids and tables.")
_LR = flags.DEFINE_float("learning_rate", 0.01,
                         "The sparse optimizer's learning rate.")
_LAZY = flags.DEFINE_bool(
    "lazy", False, "Lazy row-wise Adagrad (half-life 1000 steps).")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam",
              "partial_rowwise_adam", "ftrl")
_OPTIMIZER = flags.DEFINE_list(
    "optimizer", ["rowwise_adagrad"],
    f"The table's sparse optimizer(s), of {OPTIMIZERS}; "
    "several are timed in the same rounds (--scan: the first). Default "
    "hyper-parameters but --learning_rate; --lazy applies to "
    "rowwise_adagrad.")
flags.register_validator(
    "optimizer", lambda names: bool(names) and set(names) <= set(OPTIMIZERS),
    f"--optimizer takes one or more of {OPTIMIZERS}")
_COPY_MB = flags.DEFINE_integer(
    "copy_mb", 256, "Size of the buffer of the copy-bandwidth probe.")
_MAX_DENSE_GB = flags.DEFINE_float(
    "max_dense_gb", 0.0, "Skip the dense baseline when its estimated "
    "footprint exceeds this; 0: half the host RAM (CPU) / device memory.")
_XLA_FLAGS = flags.DEFINE_string(
    "xla_flags", "", "Extra XLA flags appended to XLA_FLAGS before JAX "
    "starts (prototyping, e.g. --xla_disable_hlo_passes=...).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")
_PLOT_OUT = flags.DEFINE_string("plot_out", None,
                                "Scan mode: write a plot here (matplotlib).")
_SCAN = flags.DEFINE_bool(
    "scan", False, "Scaling scan: vocab rows, tokens and ranks, one at a "
    "time around the flag values.")
_SCAN_VOCAB = flags.DEFINE_list("scan_vocab", ["1e5", "1e6", "1e7"],
                                "Scan: vocab rows (skipped if too big).")
_SCAN_TOKENS = flags.DEFINE_list("scan_tokens", ["4096", "16384", "65536"],
                                 "Scan: tokens per batch.")
_SCAN_RANKS = flags.DEFINE_list("scan_ranks", ["1", "2", "4", "8"],
                                "Scan: communicator sizes.")
_SCAN_REPEATS = flags.DEFINE_integer("scan_repeats", 5,
                                     "Scan: timed rounds per point.")
_SCAN_DENSE_GB = flags.DEFINE_float(
    "scan_max_dense_gb", 2.0, "Scan: run the dense baseline only where its "
    "estimated footprint is below this (it is slow and big).")
_PIPELINED = flags.DEFINE_enum(
    "pipelined_timing", "auto", ["auto", "on", "off"],
    "Dispatch a burst's calls back to back and wait once (auto: on for GPU).")

# Set by main when --json_out is given: writes the records so far, so a
# run killed by a timeout still leaves what it measured.
_save_partial: Callable[[list], None] = lambda records: None


# ---------------------------------------------------------------------------
# configuration that must happen before JAX starts
# ---------------------------------------------------------------------------


def load_config(path: str) -> dict[str, Any]:
  """`get_config()` of a python file, as a dict of flag values."""
  config = load_file(path, "bench.bench")
  if dataclasses.is_dataclass(config):
    config = dataclasses.asdict(config)
  return dict(config)


def apply_config(path: str | None) -> None:
  """Sets flags from a config file, except those given on the command line."""
  if not path:
    return
  for name, value in load_config(path).items():
    if name not in flags.FLAGS:
      raise ValueError(f"bench.bench config {path} sets {name!r}, which "
                       "is not a flag of the benchmark (see --help).")
    if not flags.FLAGS[name].present:
      if isinstance(value, (list, tuple)):
        value = [str(v) for v in value]
      flags.FLAGS[name].value = value


def configure_jax(num_devices: int, extra_flags: str = "") -> None:
  """Simulated CPU devices (and extra XLA flags), before the backend starts.

  If the backend is already up (a test imported jax first) nothing can be
  changed: then it only checks there are enough devices.
  """
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if xla_bridge.backends_are_initialized():
    import jax  # pylint: disable=g-import-not-at-top
    if len(jax.devices()) < num_devices:
      raise RuntimeError(
          f"bench.bench needs {num_devices} devices but JAX already "
          f"started with {len(jax.devices())}; run it in a fresh process.")
    return
  parts = [p for p in os.environ.get("XLA_FLAGS", "").split()
           if not p.startswith("--xla_force_host_platform_device_count")]
  parts.append(f"--xla_force_host_platform_device_count={num_devices}")
  parts.extend(extra_flags.split())
  os.environ["XLA_FLAGS"] = " ".join(parts)


# ---------------------------------------------------------------------------
# collectives: the analytic minimum (the HLO's bytes: pallas_emb.testing.hlo)
# ---------------------------------------------------------------------------


def collective_minimum(what: str, group_size: int, tokens_per_rank: int,
                       emb_width: int, num_unique: int, table_bytes: int,
                       grad_bytes: int) -> dict[str, dict]:
  """Analytic minimum per device of the column-sharded layout.

  lookup: all-gather the ids once (W*T int32 result) and one all-to-all of
  the served rows (T*E values per device, in and out). update: the same
  ids (segment ids can be derived locally from them), one all-to-all of the
  gradients (T*E) and one psum of the U+1 row statistics (f32). A step is
  both, sharing one id all-gather.
  """
  w, t, e = group_size, tokens_per_rank, emb_width
  if w == 1:
    return {}
  ids = {"count": 1, "result_bytes": w * t * 4,
         "wire_bytes": w * t * 4 * (w - 1) / w}
  rows = {"count": 1, "result_bytes": t * e * table_bytes,
          "wire_bytes": t * e * table_bytes * (w - 1) / w}
  grads = {"count": 1, "result_bytes": t * e * grad_bytes,
           "wire_bytes": t * e * grad_bytes * (w - 1) / w}
  norms = {"count": 1, "result_bytes": (num_unique + 1) * 4,
           "wire_bytes": 2 * (num_unique + 1) * 4 * (w - 1) / w}

  def add(*parts):
    total = {"count": 0, "result_bytes": 0, "wire_bytes": 0.0}
    for p in parts:
      for k in total:
        total[k] += p[k]
    return total

  if what == "lookup":
    return {"all-gather": ids, "all-to-all": rows}
  if what == "update":
    return {"all-gather": ids, "all-to-all": grads, "all-reduce": norms}
  return {"all-gather": ids, "all-to-all": add(rows, grads),
          "all-reduce": norms}


# ---------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
  vocab_rows: int
  emb_width: int
  tokens_per_batch: int
  zipf: float
  num_devices: int
  dtype: str
  seed: int = 0
  permute_ids: bool = True
  lazy: bool = False
  learning_rate: float = 0.01
  num_batches: int = 16
  optimizer: str = "rowwise_adagrad"


def make_optimizer(work: Workload):
  """The sparse optimizer `work.optimizer` names."""
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  if work.optimizer == "rowwise_adagrad":
    return pe.RowwiseAdagrad(work.learning_rate,
                             half_life_steps=1000.0 if work.lazy else None,
                             lazy=work.lazy)
  return {"sgd": pe.Sgd, "adagrad": pe.Adagrad, "adam": pe.Adam,
          "partial_rowwise_adam": pe.PartialRowwiseAdam,
          "ftrl": pe.Ftrl}[work.optimizer](work.learning_rate)


def _stats(times: list[float]) -> dict[str, float]:
  import numpy as np  # pylint: disable=g-import-not-at-top
  t = np.asarray(times)
  return {"median_s": float(np.median(t)),
          "p25_s": float(np.percentile(t, 25)),
          "p75_s": float(np.percentile(t, 75)),
          "min_s": float(t.min()), "max_s": float(t.max()),
          "n": int(t.size)}


def _memory(compiled) -> dict[str, int]:
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    m = None
  if m is None:
    return {}
  out = {k: int(getattr(m, f"{k}_size_in_bytes", 0))
         for k in ("temp", "argument", "output", "alias",
                   "generated_code")}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


@dataclasses.dataclass
class Case:
  """One timed function with the state it carries from call to call.

  With `batches`, argument `ids_arg` cycles through them (a new batch of ids
  every call, as in training).
  """
  what: str
  name: str         # "sparse", "dense", "copy", "gather", ...
  backend: str      # library backend, or "dense" / "jnp" / "copy"
  dtype: str
  compiled: Any
  args: list
  feedback: Callable[[Any, list], list] | None  # (outputs, args) -> args
  bytes_moved: float
  extra: dict = dataclasses.field(default_factory=dict)
  times: list = dataclasses.field(default_factory=list)
  batches: list | None = None
  ids_arg: int = 0
  calls: int = 0

  def call(self):
    """Dispatches one call (asynchronously); returns its outputs."""
    if self.batches:
      self.args[self.ids_arg] = self.batches[self.calls % len(self.batches)]
    self.calls += 1
    out = self.compiled(*self.args)
    if self.feedback is not None:
      self.args = self.feedback(out, self.args)
    return out

  def run(self) -> float:
    """One call, waited for; its wall time."""
    import jax  # pylint: disable=g-import-not-at-top
    start = time.perf_counter()
    jax.block_until_ready(self.call())
    return time.perf_counter() - start


def time_cases(cases: list[Case], repeats: int, warmup: int,
               burst: int = 1, pipelined: bool = False) -> None:
  """Round-robin: every round runs each case `burst` times in a row.

  All cases see the same machine noise (rounds interleave them); within a
  burst the first call is dropped (it pays for the cache state the previous
  case left behind), so with burst > 1 the times are steady-state ones.
  `pipelined` (GPU): the burst's later calls are dispatched back to back
  and waited for once, one sample = their time / (burst - 1), so host
  dispatch overlaps device work as in a training loop.
  """
  import jax  # pylint: disable=g-import-not-at-top
  for _ in range(warmup):
    for case in cases:
      case.run()
  for _ in range(repeats):
    for case in cases:
      if pipelined and burst > 1:
        case.run()
        start = time.perf_counter()
        outs = [case.call() for _ in range(burst - 1)]
        jax.block_until_ready(outs[-1])
        case.times.append((time.perf_counter() - start) / (burst - 1))
        del outs
        continue
      times = [case.run() for _ in range(burst)]
      case.times.extend(times[1:] if burst > 1 else times)


def _loss(emb):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return 0.5 * jnp.mean(jnp.square(emb.astype(jnp.float32)))


def _host_memory_bytes() -> int:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  except (ValueError, OSError):
    return 8 << 30


def _device_memory_bytes(device) -> int:
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  return int(stats.get("bytes_limit", 0)) or _host_memory_bytes()


def _dense_budget(devices) -> float:
  if _SCAN.value:
    return _SCAN_DENSE_GB.value * 2**30
  if _MAX_DENSE_GB.value > 0:
    return _MAX_DENSE_GB.value * 2**30
  if devices[0].platform == "cpu":
    return 0.5 * _host_memory_bytes()
  return 0.5 * _device_memory_bytes(devices[0]) * len(devices)


def _put_table(shape, dtype, sharding, seed):
  """A random table created on the devices (no host copy)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  @functools.partial(jax.jit, static_argnums=(0, 1), out_shardings=sharding)
  def make(shape, dtype):
    return (0.05 * jax.random.normal(jax.random.key(seed), shape,
                                     jnp.float32)).astype(dtype)
  return make(tuple(shape), jnp.dtype(dtype))


def copy_case(devices, megabytes: int) -> Case:
  """`x + 1` over a large f32 buffer: read + write = the copy bandwidth."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  n = max(megabytes * 2**20 // 4, 1024)
  x = jax.device_put(jnp.zeros((n,), jnp.float32), devices[0])
  fn = jax.jit(lambda x: x + 1)
  compiled = fn.lower(x).compile()
  return Case("copy", "copy", "copy", "float32", compiled, [x], None,
              bytes_moved=2.0 * 4 * n, extra={"buffer_bytes": 4 * n})


def build_cases(work: Workload, what: str, backends: list[str],
                baselines: list[str], devices) -> tuple[list[Case], dict]:
  """The sparse cases (one per backend) and the dense baseline."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top

  v, e, n = work.vocab_rows, work.emb_width, work.tokens_per_batch
  mesh = jax.sharding.Mesh(np.array(devices[:work.num_devices]), ("x",))
  num_unique = pe.default_num_unique(n, v)
  ctx = pe.make_context(mesh, "x", tokens_per_batch=n, emb_width=e,
                        num_unique=num_unique)
  rng = np.random.default_rng(work.seed)
  ids_np = list(zipf_ids(rng, v - 1, n * max(work.num_batches, 1), work.zipf,
                         permute=work.permute_ids).reshape(-1, n))
  distinct = float(np.mean([np.unique(b).size for b in ids_np]))
  dtype = jnp.dtype(work.dtype)
  itemsize = dtype.itemsize
  batches = [jax.device_put(b, pe.token_sharding(ctx)) for b in ids_np]
  ids = batches[0]
  grads = jax.device_put(
      (0.01 * rng.standard_normal((n, e), np.float32)).astype(dtype),
      pe.token_sharding(ctx))
  opt = make_optimizer(work)
  # Optimizer state bytes per touched row (f32 / int32 per row or element).
  state_bytes = sum(4 * (e if slot.kind == "element" else 1)
                    for slot in opt.slots())
  lookup_bytes = 2.0 * n * e * itemsize + 4 * n
  update_bytes = (n * e * itemsize + 2.0 * distinct * e * itemsize +
                  2.0 * distinct * state_bytes + 4 * n)
  moved = {"lookup": lookup_bytes, "update": update_bytes,
           "step": lookup_bytes + update_bytes}[what]
  info = {"distinct_ids": distinct, "num_unique": num_unique,
          "group_size": ctx.group_size, "tokens_per_rank": ctx.tokens_per_rank,
          "shard_width": ctx.shard_width}
  minimum = collective_minimum(what, ctx.group_size, ctx.tokens_per_rank, e,
                               num_unique, itemsize, itemsize)
  cases = []

  def sparse_case(backend):
    table = _put_table((v, e), dtype, pe.table_sharding(ctx), work.seed)
    state = opt.init(ctx, table)
    if what == "lookup":
      fn = jax.jit(lambda t, i: pe.lookup(ctx, t, i, backend=backend))
      args, feedback = [table, ids], None
    elif what == "update":
      def update(t, s, i, g):
        d = pe.dedup(ctx, i, vocab_rows=v)
        t, s, stats = pe.apply_gradients(ctx, opt, t, s, g, d,
                                         backend=backend)
        return t, s, stats.norm
      fn = jax.jit(update, donate_argnums=(0, 1))
      args = [table, state, ids, grads]
      feedback = lambda out, a: [out[0], out[1]] + a[2:]
    else:
      def step(t, s, i):
        emb = pe.lookup(ctx, t, i, backend=backend)
        g = jax.grad(_loss)(emb)
        d = pe.dedup(ctx, i, vocab_rows=v)
        t, s, stats = pe.apply_gradients(ctx, opt, t, s, g, d,
                                         backend=backend)
        return t, s, stats.norm
      fn = jax.jit(step, donate_argnums=(0, 1))
      args = [table, state, ids]
      feedback = lambda out, a: [out[0], out[1]] + a[2:]
    compiled = fn.lower(*args).compile()
    return Case(what, "sparse", backend, work.dtype, compiled, args, feedback,
                moved, extra={"collectives_min": minimum}, batches=batches,
                ids_arg=1 if what == "lookup" else 2)

  for backend in dict.fromkeys(backends + [b for b in baselines
                                           if b != "dense"]):
    cases.append(sparse_case(backend))

  if "dense" in baselines:
    import optax  # pylint: disable=g-import-not-at-top
    table_bytes = v * e * itemsize
    footprint = work.num_devices * table_bytes * (
        1 if what == "lookup" else 4)
    if footprint > _dense_budget(devices):
      info["dense_skipped"] = (
          f"needs ~{footprint / 2**30:.1f} GiB (> the "
          f"{'--scan_max_dense_gb' if _SCAN.value else '--max_dense_gb'} "
          "budget)")
    else:
      repl = NamedSharding(mesh, P())
      tok = NamedSharding(mesh, P("x"))
      tx = optax.adagrad(work.learning_rate)
      table = _put_table((v, e), dtype, repl, work.seed)
      take = lambda t, i: jnp.take(t, i, axis=0, mode="clip")
      if what == "lookup":
        fn = jax.jit(take, in_shardings=(repl, tok), out_shardings=tok)
        args, feedback = [table, ids], None
      else:
        ostate = jax.jit(tx.init, out_shardings=repl)(table)
        if what == "update":
          def dense_update(t, s, i, g):
            _, vjp = jax.vjp(lambda t: take(t, i), t)
            (g_table,) = vjp(g)
            updates, s = tx.update(g_table, s, t)
            return optax.apply_updates(t, updates), s
          fn = jax.jit(dense_update, donate_argnums=(0, 1),
                       in_shardings=(repl, repl, tok, tok),
                       out_shardings=(repl, repl))
          args = [table, ostate, ids, grads]
        else:
          def dense_step(t, s, i):
            g_table = jax.grad(lambda t: _loss(take(t, i)))(t)
            updates, s = tx.update(g_table, s, t)
            return optax.apply_updates(t, updates), s
          fn = jax.jit(dense_step, donate_argnums=(0, 1),
                       in_shardings=(repl, repl, tok),
                       out_shardings=(repl, repl))
          args = [table, ostate, ids]
        feedback = lambda out, a: [out[0], out[1]] + a[2:]
      compiled = fn.lower(*args).compile()
      dense_batches = [jax.device_put(b, tok) for b in ids_np]
      cases.append(Case(what, "dense", "dense", work.dtype, compiled, args,
                        feedback, moved, batches=dense_batches,
                        ids_arg=1 if what == "lookup" else 2))
  return cases, info


def summarize(case: Case, copy_gbps: float, work: Workload | None,
              info: dict, table_rows: int | None) -> dict:
  """One result record (JSON-able)."""
  st = _stats(case.times)
  med = st["median_s"]
  rec = {"what": case.what, "case": case.name, "backend": case.backend,
         "dtype": case.dtype, **st}
  if work is not None:
    rec.update(dataclasses.asdict(work))
    rec["tokens_per_s"] = work.tokens_per_batch / med
  rec.update({k: v for k, v in info.items() if not isinstance(v, dict)})
  rec["bytes_moved"] = case.bytes_moved
  rec["gbps"] = case.bytes_moved / med / 1e9
  rec["frac_copy_bw"] = rec["gbps"] / copy_gbps if copy_gbps else None
  if case.what == "lookup" and work is not None:
    gathered = work.tokens_per_batch * work.emb_width * \
        _itemsize(work.dtype)
    rec["gathered_gbps"] = gathered / med / 1e9
  rec["memory"] = _memory(case.compiled)
  try:
    text = case.compiled.as_text()
  except Exception:  # pylint: disable=broad-except
    text = ""
  group = info.get("group_size", 1)
  rec["collectives"] = collective_bytes(text, group) if text else {}
  if "collectives_min" in case.extra:
    rec["collectives_min"] = case.extra["collectives_min"]
  if table_rows and text:
    shard = table_rows * info.get("shard_width", 1)
    bad = full_table_ops(text, table_rows, min_elements=shard)
    rec["full_table_ops"] = len(bad)
    rec["full_table_op_names"] = [f"{b.opcode}:{b.name}:{b.shape}"
                                  for b in bad[:8]]
  rec.update({k: v for k, v in case.extra.items()
              if k != "collectives_min"})
  return rec


def _itemsize(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2}.get(dtype, 4)


def add_ratios(records: list[dict]) -> None:
  """speedup_vs_dense / _vs_xla and temp memory ratios within a group."""
  def key(r):
    return (r["what"], r.get("dtype"), r.get("vocab_rows"),
            r.get("tokens_per_batch"), r.get("num_devices"),
            r.get("emb_width"), r.get("optimizer"))
  groups: dict = {}
  for r in records:
    groups.setdefault(key(r), []).append(r)
  for group in groups.values():
    dense = next((r for r in group if r["case"] == "dense"), None)
    xla = next((r for r in group if r["case"] == "sparse" and
                r["backend"] == "xla"), None)
    for r in group:
      if dense is not None:
        r["speedup_vs_dense"] = dense["median_s"] / r["median_s"]
        dt = dense["memory"].get("temp", 0)
        rt = r["memory"].get("temp", 0)
        r["temp_vs_dense"] = rt / dt if dt else None
      if xla is not None:
        r["speedup_vs_xla"] = xla["median_s"] / r["median_s"]


def run_workloads(works: list[Workload], what: str, backends, baselines,
                  repeats, warmup, devices, copy: Case,
                  pipelined: bool = False) -> list[dict]:
  """Builds every workload's cases, then times them all interleaved."""
  built = [(work,) + build_cases(work, what, backends, baselines, devices)
           for work in works]
  time_cases([c for _, cases, _ in built for c in cases] + [copy], repeats,
             warmup, _BURST.value, pipelined)
  copy_gbps = copy.bytes_moved / _stats(copy.times)["median_s"] / 1e9
  copy.times.clear()
  records = []
  for work, cases, info in built:
    group = [summarize(case, copy_gbps, work, info, work.vocab_rows)
             for case in cases]
    for r in group:
      r["copy_gbps"] = copy_gbps
    if "dense_skipped" in info:
      group.append({"what": what, "case": "dense", "backend": "dense",
                    "dtype": work.dtype, **dataclasses.asdict(work),
                    "skipped": info["dense_skipped"], "median_s": None,
                    "memory": {}})
    add_ratios([r for r in group if r.get("median_s")])
    records += group
    for case in cases:  # free the device buffers
      case.args = []
  return records


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def _fmt_bytes(x) -> str:
  if x is None:
    return "-"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.0f}B"


def _coll_total(colls: dict, key: str = "wire_bytes") -> float:
  return sum(v.get(key, 0) for v in colls.values())


def format_table(records: list[dict]) -> str:
  """A fixed-width table of the result records."""
  head = ("what", "case", "optimizer", "backend", "dtype", "dev", "rows",
          "tokens", "median ms", "IQR ms", "min-max ms", "Mtok/s", "GB/s",
          "%copy", "gath GB/s", "temp", "peak", "coll HLO", "coll min",
          "tbl ops", "vs dense", "temp/dense", "vs xla")
  rows = [head]
  skipped = []
  for r in records:
    if r.get("median_s") is None:
      skipped.append(f"{r['what']} {r['case']}[{r['backend']}] "
                     f"{r['dtype']} dev={r.get('num_devices')} "
                     f"rows={r.get('vocab_rows', 0):.0e} "
                     f"tokens={r.get('tokens_per_batch')}: skipped, "
                     f"{r.get('skipped', '')}")
      continue
    ms = lambda k: f"{1e3 * r[k]:.3f}"
    iqr = f"{1e3 * (r['p75_s'] - r['p25_s']):.3f}"
    pct = (f"{100 * r['frac_copy_bw']:.0f}%" if r.get("frac_copy_bw")
           else "-")
    ratio = lambda k: f"{r[k]:.2f}x" if r.get(k) is not None else "-"
    mem = r.get("memory", {})
    rows.append((
        r["what"], r["case"],
        r.get("optimizer", "-") if r["case"] != "dense" else "optax.adagrad",
        r["backend"], r["dtype"],
        str(r["num_devices"]), f"{r['vocab_rows']:.0e}",
        str(r["tokens_per_batch"]), ms("median_s"), iqr,
        f"{1e3 * r['min_s']:.2f}-{1e3 * r['max_s']:.2f}",
        f"{r['tokens_per_s'] / 1e6:.2f}", f"{r['gbps']:.2f}", pct,
        f"{r['gathered_gbps']:.2f}" if "gathered_gbps" in r else "-",
        _fmt_bytes(mem.get("temp")), _fmt_bytes(mem.get("peak")),
        _fmt_bytes(_coll_total(r.get("collectives", {}))),
        _fmt_bytes(_coll_total(r["collectives_min"]))
        if "collectives_min" in r else "-",
        str(r.get("full_table_ops", "-")),
        ratio("speedup_vs_dense"),
        (f"{r['temp_vs_dense']:.4f}" if r.get("temp_vs_dense") is not None
         else "-"),
        ratio("speedup_vs_xla")))
  widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
  lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths))
           for row in rows]
  lines.insert(1, "-" * len(lines[0]))
  return "\n".join(lines + skipped)


def plot_scan(records: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  axes_names = ("vocab_rows", "tokens_per_batch", "num_devices")
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for ax, axis in zip(axes, axes_names):
    points = [r for r in records if r.get("scan_axis") == axis and
              r.get("median_s")]
    series: dict = {}
    for r in points:
      label = f"{r['case']}[{r['backend']}] {r['dtype']}"
      series.setdefault(label, []).append(
          (r[axis], 1e3 * r["median_s"], 1e3 * r["p25_s"],
           1e3 * r["p75_s"]))
    for label, pts in sorted(series.items()):
      pts.sort()
      x = [p[0] for p in pts]
      y = [p[1] for p in pts]
      lo = [p[1] - p[2] for p in pts]
      hi = [p[3] - p[1] for p in pts]
      ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2 if axis == "num_devices" else 10)
    ax.set_yscale("log")
    ax.set_xlabel(axis)
    ax.set_ylabel("median ms / call (IQR bars)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  what = records[0]["what"] if records else ""
  fig.suptitle(f"bench.bench --scan --what={what}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def _meta() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  d = jax.devices()[0]
  return {"jax": jax.__version__, "platform": d.platform,
          "device_kind": d.device_kind, "devices": len(jax.devices()),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
          "loadavg": _loadavg(), "cpu_count": os.cpu_count()}


def _loadavg():
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def _scan_values(values) -> list[int]:
  return [int(float(v)) for v in values]


def run(argv_flags=None) -> dict:
  """Runs what the flags ask; returns the JSON document."""
  del argv_flags
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  what = _WHAT.value
  backends = [b for b in _BACKENDS.value if b]
  baselines = [b for b in _BASELINES.value if b]
  doc = {"meta": _meta(), "what": what, "results": []}
  pipelined = (_PIPELINED.value == "on" or
               (_PIPELINED.value == "auto" and devices[0].platform == "gpu"))
  doc["meta"]["pipelined_timing"] = pipelined
  copy = copy_case(devices, _COPY_MB.value)

  def work(**over):
    base = dict(vocab_rows=_VOCAB.value, emb_width=_WIDTH.value,
                tokens_per_batch=_TOKENS.value, zipf=_ZIPF.value,
                num_devices=_NUM_DEVICES.value, dtype=_DTYPE.value[0],
                seed=_SEED.value, permute_ids=_PERMUTE.value,
                lazy=_LAZY.value, learning_rate=_LR.value,
                num_batches=_NUM_BATCHES.value,
                optimizer=_OPTIMIZER.value[0])
    base.update(over)
    return Workload(**base)

  if not _SCAN.value:
    vocabs = [_VOCAB.value] + _scan_values(_ALSO_VOCAB.value)
    works = [work(dtype=d, vocab_rows=v, optimizer=o) for v in vocabs
             for d in _DTYPE.value for o in _OPTIMIZER.value]
    doc["results"] = run_workloads(works, what, backends, baselines,
                                   _REPEATS.value, _WARMUP.value, devices,
                                   copy, pipelined)
    return doc

  points = []
  for v in _scan_values(_SCAN_VOCAB.value):
    points.append(("vocab_rows", dict(vocab_rows=v)))
  for t in _scan_values(_SCAN_TOKENS.value):
    points.append(("tokens_per_batch", dict(tokens_per_batch=t)))
  for w in _scan_values(_SCAN_RANKS.value):
    points.append(("num_devices", dict(num_devices=w)))
  for dtype in _DTYPE.value:
    for axis, over in points:
      wk = work(dtype=dtype, **over)
      table_bytes = wk.vocab_rows * wk.emb_width * _itemsize(dtype)
      # Sparse tables of every backend live at once (+ dense's budget).
      need = table_bytes * (len(backends) + len(baselines)) * 1.5
      if need > 0.6 * _host_memory_bytes() and devices[0].platform == "cpu":
        doc["results"].append({
            "what": what, "case": "sparse", "backend": ",".join(backends),
            "dtype": dtype, **dataclasses.asdict(wk), "scan_axis": axis,
            "skipped": f"needs ~{need / 2**30:.1f} GiB", "median_s": None,
            "memory": {}})
        continue
      if wk.tokens_per_batch % wk.num_devices or \
          wk.emb_width % wk.num_devices:
        continue
      recs = run_workloads([wk], what, backends, baselines,
                           _SCAN_REPEATS.value, 1, devices, copy, pipelined)
      for r in recs:
        r["scan_axis"] = axis
      doc["results"] += recs
      _save_partial(doc["results"])
      print(f"scan {axis}={over[axis]} {dtype}: " + ", ".join(
          f"{r['case']}[{r['backend']}] {1e3 * r['median_s']:.2f} ms"
          for r in recs if r.get("median_s")), flush=True)
  return doc


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  apply_config(_CONFIG.value)
  need = _NUM_DEVICES.value
  if _SCAN.value:
    need = max([need] + _scan_values(_SCAN_RANKS.value))
  configure_jax(need, _XLA_FLAGS.value)
  global _save_partial
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON_OUT.value)),
                exist_ok=True)

    def _save_partial(records):  # pylint: disable=redefined-outer-name
      with open(_JSON_OUT.value, "w") as f:
        json.dump({"meta": _meta(), "what": _WHAT.value, "partial": True,
                   "results": records}, f, indent=1, default=str)
  doc = run()
  doc["meta"]["loadavg_end"] = _loadavg()
  table = format_table([r for r in doc["results"]])
  print(f"# {doc['meta']['platform']} x{doc['meta']['devices']} "
        f"({doc['meta']['device_kind']}), jax {doc['meta']['jax']}, "
        f"load avg {doc['meta']['loadavg']} -> {doc['meta']['loadavg_end']}, "
        f"copy {doc['results'][0].get('copy_gbps', 0):.2f} GB/s"
        if doc["results"] else "# no results")
  print(table)
  doc["table"] = table
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump(doc, f, indent=1, default=str)
    print(f"wrote {_JSON_OUT.value}")
  if _PLOT_OUT.value and _SCAN.value:
    plot_scan(doc["results"], _PLOT_OUT.value)
    print(f"wrote {_PLOT_OUT.value}")


if __name__ == "__main__":
  app.run(main)
