"""A host-tier table against a table held on the device, one device.

    python -m bench.host_tier                     # 100M x 64 f32, the chip
    python -m bench.host_tier --rows=200000 --cache_rows=20000 \\
        --compare_device_rows=20000 --ids=1024 --steps=10   # a CPU, quickly

On one TPU v5e (16 GB of chip memory, 40 GB of host memory) the defaults
are the measurement docs/host_tier.md reports: a 100M x 64 f32 table
(25.6 GB, more than the chip) with row-wise Adagrad, its rows and state in
host memory and a cache of `--cache_rows` rows on the chip, trained by the
pipelined Trainer on Zipf(`--zipf`) ids as `--ids` bags of `--bag` ids
and as `--ids` sequence ids (`--bag=20,0`, one configuration each):

    TPU_PREMAPPED_BUFFER_SIZE=1073741824 python -m bench.host_tier \
        --json_out=host_tier_v5e.json

(the TPU runtime's default transfer buffer leaves too little host memory
for the 100M rows beside it on that VM; `bench/host_tier_check.sh` sets
the smaller one).

Per configuration it prints and records:

  host        the step time of the host-tier table (the median time
              between the losses of `--steps` pipelined steps after
              `--warmup`; a step that compiles a new size of the cache's
              row swap is an outlier, and the mean, `mean_step_s`, keeps
              it; `mean_step_s_without_compiles` is the mean with the
              seconds JAX spent compiling taken out, so it keeps the
              steps that move a group of evicted rows back; `steps_ms`
              each timed step's time between losses, `prefetch_ms`,
              `waited_ms` and `evicted` its prefetch's host time, of it
              the wait for write-backs, and its evictions), the step
              time with each step waited for (no
              overlap of host work and device work), the host seconds of
              the prefetch per step, the cache hit rate (distinct rows and
              ids) and the bytes per step to the device and back; and the
              overlap, from timestamps: for each step t, when the call of
              step t+1 began (its prefetch first) against when step t's
              loss was ready on the device (a thread waits for each), so
              `overlap_s` is how long the next prefetch ran while the
              device still ran the step
  device      the same workload on a table of `--compare_device_rows` rows
              held on the device (ids Zipf over its rows), same Trainer;
              `host_over_device` the ratio of the medians,
              `host_over_device_mean` of the means without compiles (the
              throughput, eviction groups' steps included)
  link        the host -> device and device -> host rates measured by
              `jax.device_put` / `np.asarray` of a `--link_mb` MB buffer
  gathers     the two ways to bring the misses of a step to the device,
              on a `--memory_kinds_rows`-row table: a numpy gather in host
              memory + `device_put` (what the host tier does) against a
              gather inside `jit` from a `pinned_host` array (JAX memory
              kinds), each timed, or the error the platform gives
  host_profile  with `--host_profile_steps=N`: N more pipelined steps of
              the host tier, each call under cProfile; for the steps that
              evict a group and each of the 3 after them, the functions
              whose host time (own, not their callees') grew most over
              the steps far from a group (what the mean holds)

The host table is filled in chunks (`host_memory.init_table`, no second
copy), its initializer a constant (the values do not change the time).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import queue
import statistics
import tempfile
import threading
import time

from absl import app
from absl import flags

from bench import trace
from bench.settings import apply_settings

_ROWS = flags.DEFINE_integer("rows", 100_000_000, "Rows of the host table.")
_WIDTH = flags.DEFINE_integer("width", 64, "Columns (f32).")
_IDS = flags.DEFINE_integer("ids", 16384,
                            "Bags (or sequence ids) per step.")
_BAG = flags.DEFINE_list("bag", ["20", "0"],
                         "Ids per bag, one configuration each (0: a "
                         "sequence feature of --ids ids).")
_CACHE = flags.DEFINE_integer("cache_rows", 12 * 2**20,
                              "Rows of the device cache.")
_POLICY = flags.DEFINE_enum("policy", "lru", ["lru", "lfu"],
                            "Cache policy.")
_ZIPF = flags.DEFINE_float("zipf", 1.05, "Zipf exponent of the ids.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps.")
_WARMUP = flags.DEFINE_integer(
    "warmup", 400,
    "Untimed steps first: they compile and fill the cache (at the defaults "
    "16,384 bags of 20 fill the 12M-row cache in about 330 steps; the "
    "bench says when the timed steps found it still filling).")
_DEVICE_ROWS = flags.DEFINE_integer(
    "compare_device_rows", 10_000_000,
    "Rows of the device-held table of the comparison (0: none).")
_LINK_MB = flags.DEFINE_integer("link_mb", 256,
                                "MB of the buffer the link rate moves.")
_MK_ROWS = flags.DEFINE_integer(
    "memory_kinds_rows", 1_000_000,
    "Rows of the table of the gather comparison (0: none).")
_PROFILE = flags.DEFINE_integer(
    "profile_steps", 0,
    "After the timed steps, this many more pipelined steps of the host "
    "tier under jax.profiler.trace: the device time per step of each "
    "program (the cache's row swap, the step) and of the largest ops.")
_HOST_PROFILE = flags.DEFINE_integer(
    "host_profile_steps", 0,
    "After the timed steps, this many more pipelined steps of the host "
    "tier, each call under cProfile: the host functions whose time grows "
    "in the steps at and after an eviction group (`host_profile`).")
_HOST_DIR = flags.DEFINE_string(
    "host_dir", None, "Keep the host table in memory-mapped files of this "
    "existing directory (`TableSpec.host_dir`), for a table larger than the "
    "host's memory.")
_REPORT_S = flags.DEFINE_float(
    "report_s", 30.0, "Print the steps' progress this often (seconds; 0: "
    "never): what a run stopped by a time limit still tells.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")
_SET = flags.DEFINE_multi_string(
    "set", [], "MODULE.NAME=VALUE: sets a module constant first (a knob, "
    "e.g. pallas_emb.host_memory.MAP_ADVICE=None).")


def _batches(np, datasets, rows, ids, bag, count, zipf, seed):
  """`count` batches `{"f": ids}` of Zipf ids in [0, rows) (one draw: the
  same hot ids in every batch)."""
  rng = np.random.default_rng(seed)
  shape = (ids, bag) if bag else (ids,)
  per = int(np.prod(shape))
  drawn = datasets.zipf_ids(rng, rows, per * count, zipf) - 1
  return [{"f": drawn[i * per:(i + 1) * per].reshape(shape)}
          for i in range(count)]


def _profiled(jax, run, steps: int) -> dict:
  """`run()` traced: device ms per step by program and by op (the ten
  largest), printed and returned. A CPU's trace has no device planes."""
  trace_dir = tempfile.mkdtemp(prefix="pallas_emb_host_tier_profile_")
  with jax.profiler.trace(trace_dir):
    run()
  out = {}
  for what, line in (("programs", "XLA Modules"), ("ops", "XLA Ops")):
    totals = trace.device_op_times(trace_dir, line)
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
    out[what] = {name: ns / 1e6 / steps for name, ns in top}
    print(f"    device {what}, ms a step over {steps} traced steps: "
          + (", ".join(f"{name[:60]} {ms:.2f}"
                       for name, ms in out[what].items()) or "none traced"),
          flush=True)
  return out


def _memory(stage: str, into: dict, since: float) -> None:
  """Records and prints this process's resident and peak host memory (GB,
  Linux /proc) at `stage`, and the seconds since `since`: where a large
  host tier's memory and start-up time go."""
  seconds = time.perf_counter() - since
  try:
    with open("/proc/self/status") as f:
      fields = dict(line.split(":", 1) for line in f if ":" in line)
  except OSError:
    return
  gb = lambda key: int(fields.get(key, "0 kB").split()[0]) / 2**20
  into[stage] = {"rss_gb": gb("VmRSS"), "peak_gb": gb("VmHWM"),
                 "seconds": seconds}
  # A sandboxed kernel may not report the peak (VmHWM): then it is left out.
  peak = (f", {into[stage]['peak_gb']:.2f} GB peak"
          if into[stage]["peak_gb"] else "")
  print(f"    host memory after {stage}, {seconds:.1f} s in: "
        f"{into[stage]['rss_gb']:.2f} GB resident{peak}", flush=True)


_COMPILING = {"seconds": 0.0, "programs": 0}


def _count_compiles(name: str, seconds: float, **_) -> None:
  """A `jax.monitoring` listener: the seconds spent tracing, lowering and
  compiling, and the programs compiled."""
  if name.startswith("/jax/core/compile/"):
    _COMPILING["seconds"] += seconds
    _COMPILING["programs"] += name.endswith("backend_compile_duration")


def _run(pe, jax, jnp, np, optax, rows, bag, batches, host, steps, warmup,
         began):
  """Times `steps` pipelined steps (after `warmup`) of a one-table
  collection: the host tier (`host`: cache rows) or a device table
  (`began`: when its batches began to be drawn)."""
  mesh = jax.make_mesh((1,), ("x",))
  extra = dict(storage="host", cache_rows=host, cache_policy=_POLICY.value,
               host_dir=_HOST_DIR.value) if host else {}
  table = pe.TableSpec("t", rows, _WIDTH.value,
                       optimizer=pe.RowwiseAdagrad(0.01),
                       initializer=jax.nn.initializers.constant(0.01),
                       **extra)
  coll = pe.EmbeddingCollection(
      [table], [pe.FeatureSpec("f", "t", combiner="sum" if bag else None)],
      mesh, "x")

  def loss_fn(params, emb, batch):
    del batch
    return jnp.mean((emb["f"] @ params["w"]) ** 2), ()

  trainer = pe.Trainer(coll, loss_fn, optax.sgd(0.01))
  memory = {}
  _memory("the batches", memory, began)
  emb_state = coll.init(jax.random.key(0))
  _memory("coll.init", memory, began)
  state = trainer.init(emb_state, {"w": jnp.full((_WIDTH.value, 1), 0.1)},
                       batches[0])
  del emb_state
  _memory("trainer.init", memory, began)
  step = trainer.step if host else jax.jit(trainer.step, donate_argnums=0)
  cache, t = [], 0
  times_ms = []  # the last run's time between losses, per step
  calls, ready = [], []  # per step: when its call began; when its loss was

  def watch(losses):
    while (loss := losses.get()) is not None:
      jax.block_until_ready(loss)
      ready.append(time.perf_counter())

  def run(n, wait):
    nonlocal state, t
    jax.block_until_ready(state)
    calls.clear()
    ready.clear()
    losses = queue.Queue()
    watcher = threading.Thread(target=watch, args=(losses,))
    watcher.start()
    start = report = time.perf_counter()
    for i in range(n):
      calls.append(time.perf_counter())
      state, metrics = step(state, batches[t % len(batches)],
                            batches[(t + 1) % len(batches)])
      losses.put(metrics.loss)
      t += 1
      if metrics.cache:
        cache.append(metrics.cache["t"])
      if wait:
        jax.block_until_ready(state)
      if _REPORT_S.value and calls[-1] - report >= _REPORT_S.value:
        report = calls[-1]
        _progress(i + 1, n, calls, cache)
    jax.block_until_ready(state)
    mean = (time.perf_counter() - start) / max(n, 1)
    losses.put(None)
    watcher.join()
    # The median time between losses: a step that compiles (a new size of
    # the cache's row swap, `host_tier._bucket`) is one outlier, not a
    # share of every step.
    steps_s = [b - a for a, b in zip([start] + ready[:-1], ready)]
    times_ms[:] = [round(1e3 * s, 2) for s in steps_s]
    return (statistics.median(steps_s) if steps_s else mean), mean

  run(warmup, False)
  _memory("the warmup steps", memory, began)
  cache.clear()
  out = {"memory_gb": memory}
  before = dict(_COMPILING)
  out["step_s"], out["mean_step_s"] = run(steps, False)
  out["steps_ms"] = list(times_ms)
  if host:  # each timed step's prefetch on the host, and its evictions
    out["prefetch_ms"] = [round(1e3 * c.seconds, 2) for c in cache]
    out["waited_ms"] = [round(1e3 * c.wait_seconds, 2) for c in cache]
    out["evicted"] = [c.evicted for c in cache]
  out["compiled_programs"] = _COMPILING["programs"] - before["programs"]
  out["mean_step_s_without_compiles"] = out["mean_step_s"] - (
      _COMPILING["seconds"] - before["seconds"]) / max(steps, 1)
  _memory("the timed steps", memory, began)
  # How long the call of step t+1 (its prefetch first) ran before step t's
  # loss was ready: host work overlapping the device's (at most the
  # prefetch; all of it for a device table, which has none).
  prefetch = [c.seconds for c in cache[1:]] if host else [float("inf")] * (
      len(calls) - 1)
  overlap = [min(p, max(0.0, r - c))
             for c, r, p in zip(calls[1:], ready[:-1], prefetch)]
  out["overlap_s"] = statistics.median(overlap) if overlap else 0.0
  out["overlapped_steps"] = sum(o > 0 for o in overlap)
  if host and _PROFILE.value:
    out["device_ms_per_step"] = _profiled(jax, lambda: run(_PROFILE.value,
                                                           False),
                                          _PROFILE.value)
  if host and _HOST_PROFILE.value:
    profiles, timed_step = [], step

    def step(*args):  # pylint: disable=function-redefined
      profile = cProfile.Profile()
      profile.enable()
      try:
        return timed_step(*args)
      finally:
        profile.disable()
        profiles.append(_own_seconds(profile))
    first = len(cache)
    run(_HOST_PROFILE.value, False)
    step = timed_step
    out["host_profile"] = _after_evictions(
        profiles, [c.evicted for c in cache[first:]])
    del cache[first:]  # the profiler's time is in their prefetch's
  if host:
    out["step_waited_s"], out["mean_step_waited_s"] = run(steps, True)
    for field, name in (("seconds", "prefetch_s"), ("read_seconds", "read_s"),
                        ("wait_seconds", "write_back_wait_s")):
      out[name] = statistics.median(getattr(c, field) for c in cache)
    for field in ("rows", "fetched", "evicted", "written_back",
                  "bytes_to_device", "bytes_to_host"):
      out[field + "_per_step"] = statistics.mean(getattr(c, field)
                                                 for c in cache)
    # No eviction in the timed steps: the cache was still filling, so its
    # hit rate is below the steady state's.
    out["filling"] = not any(c.evicted for c in cache)
    out["hit_rate"] = (sum(c.hits for c in cache)
                       / max(1, sum(c.rows for c in cache)))
    out["id_hit_rate"] = (sum(c.id_hits for c in cache)
                          / max(1, sum(c.ids for c in cache)))
    out["plan"] = coll.plan.describe()
  del state
  return out


def _progress(done: int, n: int, calls: list, cache: list) -> None:
  """Prints the steps so far: their pace, and the host tier's cache over
  the last ten."""
  pace = (calls[-1] - calls[0]) / max(1, len(calls) - 1)
  line = f"    {done} of {n} steps, {1e3 * pace:.0f} ms a step"
  if cache:
    last = cache[-10:]
    mean = lambda f: statistics.mean(getattr(c, f) for c in last)
    hits = sum(c.hits for c in last) / max(1, sum(c.rows for c in last))
    line += (f"; the last {len(last)}: hit rate {hits:.3f}, "
             f"{mean('fetched'):.0f} fetched, {mean('evicted'):.0f} evicted, "
             f"{mean('written_back'):.0f} written back; prefetch "
             f"{1e3 * mean('seconds'):.0f} ms on the host, reading rows "
             f"{1e3 * mean('read_seconds'):.0f}, waiting for write-backs "
             f"{1e3 * mean('wait_seconds'):.0f}")
  print(line, flush=True)


def _link(jax, np, mb):
  """Host -> device and device -> host GB/s of a `mb` MB buffer."""
  x = np.ones(mb * 2**20 // 4, np.float32)
  device = jax.devices()[0]
  jax.block_until_ready(jax.device_put(x[:1024], device))
  start = time.perf_counter()
  y = jax.block_until_ready(jax.device_put(x, device))
  to_device = x.nbytes / (time.perf_counter() - start) / 1e9
  start = time.perf_counter()
  np.asarray(y)
  to_host = x.nbytes / (time.perf_counter() - start) / 1e9
  return {"bytes": x.nbytes, "to_device_gbps": to_device,
          "to_host_gbps": to_host}


def _gathers(jax, np, rows, misses):
  """Seconds to bring `misses` rows of a `rows`-row table to the device:
  numpy gather + device_put, and a jitted gather from `pinned_host`."""
  table = np.ones((rows, _WIDTH.value), np.float32)
  idx = np.random.default_rng(0).integers(0, rows, misses).astype(np.int32)
  device = jax.devices()[0]
  sharding = jax.sharding.SingleDeviceSharding(device)

  def timed(fn):
    jax.block_until_ready(fn())
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times.append(time.perf_counter() - start)
    return statistics.median(times)

  out = {"rows": rows, "misses": misses,
         "numpy_device_put_s": timed(
             lambda: jax.device_put(table[idx], device))}
  try:
    pinned = sharding.with_memory_kind("pinned_host")
    host_table = jax.device_put(table, pinned)
    host_idx = jax.device_put(idx, pinned)
    gather = jax.jit(lambda t, i: t[i])
    to_device = lambda: jax.device_put(gather(host_table, host_idx),
                                       sharding.with_memory_kind("device"))
    out["pinned_host_gather_s"] = timed(to_device)
  except Exception as e:  # pylint: disable=broad-except
    out["pinned_host_gather_error"] = f"{type(e).__name__}: {e}"[:300]
  return out


def _own_seconds(profile) -> dict:
  """`{"file:function": seconds}` of a cProfile run, each function's own
  time (not its callees')."""
  out = {}
  for (path, _, name), stat in pstats.Stats(profile).stats.items():
    key = f"{os.path.basename(path)}:{name}" if path != "~" else name
    out[key] = out.get(key, 0.0) + stat[2]
  return out


def _after_evictions(profiles: list, evicted: list, after: int = 3,
                     top: int = 6) -> dict:
  """Per `+k` (k = 0 .. `after`): the steps k after one that evicted, and
  the `top` functions whose own time grew most on average over the quiet
  steps (none evicted in the `after` steps before them, nor they): `{"+k":
  {"steps": n, "ms": {function: growth in ms}}}`."""
  evicting = [i for i, e in enumerate(evicted) if e]
  quiet = [i for i in range(len(profiles))
           if not any(evicted[max(0, i - after):i + 1])]
  mean = lambda steps, key: sum(profiles[i].get(key, 0.0)
                                for i in steps) / max(1, len(steps))
  out = {}
  for k in range(after + 1):
    steps = [i + k for i in evicting if i + k < len(profiles)]
    if not steps or not quiet:
      continue
    keys = set().union(*(profiles[i] for i in steps))
    growth = sorted(((1e3 * (mean(steps, key) - mean(quiet, key)), key)
                     for key in keys), reverse=True)[:top]
    out[f"+{k}"] = {"steps": len(steps),
                    "ms": {key: round(ms, 2) for ms, key in growth}}
  return out


def _slow_steps(h) -> str:
  """A line on the timed steps over 1.5x the median (what the mean holds
  that the median does not): their time, and their calls' prefetch on the
  host (a step's call prefetches first and dispatches after it), its wait
  for write-backs and evictions."""
  steps, median = h["steps_ms"], 1e3 * h["step_s"]
  slow = [i for i, t in enumerate(steps) if t > 1.5 * median]
  if not slow:
    return ""
  mean = lambda key: sum(h[key][i] for i in slow) / len(slow)
  return (f"{len(slow)} of {len(steps)} timed steps over 1.5x the median: "
          f"{mean('steps_ms'):.1f} ms on average, their prefetch "
          f"{mean('prefetch_ms'):.1f} ms on the host, of it "
          f"{mean('waited_ms'):.1f} waiting for write-backs; "
          f"{sum(h['evicted'][i] > 0 for i in slow)} of them evicted")


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb import datasets  # pylint: disable=g-import-not-at-top

  apply_settings(_SET.value)
  jax.monitoring.register_event_duration_secs_listener(_count_compiles)
  device = jax.devices()[0]
  doc = {"what": "bench.host_tier", "device": str(device.device_kind),
         "platform": device.platform, "jax": jax.__version__,
         "rows": _ROWS.value, "width": _WIDTH.value, "ids": _IDS.value,
         "cache_rows": _CACHE.value, "policy": _POLICY.value,
         "zipf": _ZIPF.value, "steps": _STEPS.value,
         "compare_device_rows": _DEVICE_ROWS.value,
         "host_dir": _HOST_DIR.value, "settings": _SET.value,
         # The TPU runtime's transfer buffer in host memory, if set.
         "tpu_premapped_buffer_size": os.environ.get(
             "TPU_PREMAPPED_BUFFER_SIZE"), "results": []}
  doc["link"] = _link(jax, np, _LINK_MB.value)
  print(f"{device.platform} {device.device_kind}: host -> device "
        f"{doc['link']['to_device_gbps']:.2f} GB/s, device -> host "
        f"{doc['link']['to_host_gbps']:.2f} GB/s ({_LINK_MB.value} MB)")
  count = _WARMUP.value + 2 * _STEPS.value + 1
  for bag in map(int, _BAG.value):
    what = f"{_IDS.value} bags of {bag}" if bag else (
        f"{_IDS.value} sequence ids")
    began = time.perf_counter()
    batches = _batches(np, datasets, _ROWS.value, _IDS.value, bag, count,
                       _ZIPF.value, 1)
    record = {"bag": bag, "what": what}
    record["host"] = _run(pe, jax, jnp, np, optax, _ROWS.value, bag,
                          batches, _CACHE.value, _STEPS.value, _WARMUP.value,
                          began)
    del batches
    h = record["host"]
    print(f"{what}: host tier [{_ROWS.value}, {_WIDTH.value}] cache "
          f"{_CACHE.value} ({_POLICY.value}): {1e3 * h['step_s']:.1f} ms "
          f"a step (median; mean {1e3 * h['mean_step_s']:.1f}, "
          f"{1e3 * h['mean_step_s_without_compiles']:.1f} without the "
          f"{h['compiled_programs']} programs compiled; "
          f"{1e3 * h['step_waited_s']:.1f} ms waited for, prefetch "
          f"{1e3 * h['prefetch_s']:.1f} ms on the host (reading rows "
          f"{1e3 * h['read_s']:.1f}, waiting for write-backs "
          f"{1e3 * h['write_back_wait_s']:.1f}), of which "
          f"{1e3 * h['overlap_s']:.1f} ms while the previous step ran: "
          f"{h['overlapped_steps']} of {_STEPS.value - 1} steps); hit rate "
          f"{h['hit_rate']:.3f} of distinct rows, {h['id_hit_rate']:.3f} of "
          f"ids; {h['bytes_to_device_per_step'] / 1e6:.2f} MB to the device "
          f"and {h['bytes_to_host_per_step'] / 1e6:.2f} MB back per step"
          + ("; the cache was still filling (no eviction in the timed "
             "steps): a cold cache's hit rate, raise --warmup"
             if h["filling"] else ""))
    slow = _slow_steps(h)
    if slow:
      print(f"    {slow}")
    for k, grown in h.get("host_profile", {}).items():
      print(f"    host time grown in the steps {k} after an eviction "
            f"({grown['steps']}): " + ", ".join(
                f"{key} +{ms:.1f} ms" for key, ms in grown["ms"].items()))
    if _DEVICE_ROWS.value:
      began = time.perf_counter()
      batches = _batches(np, datasets, _DEVICE_ROWS.value, _IDS.value, bag,
                         count, _ZIPF.value, 1)
      record["device"] = _run(pe, jax, jnp, np, optax, _DEVICE_ROWS.value,
                              bag, batches, 0, _STEPS.value, _WARMUP.value,
                              began)
      del batches
      d = record["device"]
      # The median says what a step without an eviction group costs; the
      # mean is the throughput, the groups' steps included.
      record["host_over_device"] = h["step_s"] / d["step_s"]
      record["host_over_device_mean"] = (h["mean_step_s_without_compiles"]
                                         / d["mean_step_s_without_compiles"])
      print(f"{'':>4}device table [{_DEVICE_ROWS.value}, {_WIDTH.value}]: "
            f"{1e3 * d['step_s']:.1f} ms a step (median; mean "
            f"{1e3 * d['mean_step_s_without_compiles']:.1f} without "
            f"compiles); host tier / device "
            f"{record['host_over_device']:.2f}x by the median, "
            f"{record['host_over_device_mean']:.2f}x by the mean")
    if _MK_ROWS.value:
      misses = max(1, int(h["fetched_per_step"]))
      record["gathers"] = _gathers(jax, np, _MK_ROWS.value, misses)
      g = record["gathers"]
      pinned = (f"{1e3 * g['pinned_host_gather_s']:.2f} ms"
                if "pinned_host_gather_s" in g else
                g["pinned_host_gather_error"])
      print(f"{'':>4}{misses} misses from a {_MK_ROWS.value}-row table: "
            f"numpy + device_put {1e3 * g['numpy_device_put_s']:.2f} ms, "
            f"pinned_host gather in jit: {pinned}")
    doc["results"].append(record)
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
  app.run(main)
