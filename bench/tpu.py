"""The sparse step per backend beside a dense optax step, for the TPU check.

    python -m bench.tpu                       # on a TPU: bench/tpu_check.sh
    python -m bench.tpu --rows=1000 --ids=256 --backends=mosaic_tpu_interpret,xla \
        --repeats=2                           # a CPU smoke run

One table (row-wise Adagrad) read by one feature: a sequence of ids, or
bags of `--bag` ids pooled by sum. Each case is a whole jitted step with its
state donated (lookup -> gradient of a small loss -> exchange -> dedup ->
update): the collection on each `--backends` entry, and `dense`, plain jnp
`take` of the table with `optax.adagrad` over all of it. Cases of one
configuration are timed in interleaved rounds in this process. Prints the
median step time, the speed-up over dense, and each step's peak temporaries
from the compiled memory analysis, a table-sized one flagged.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time

from absl import app
from absl import flags

from bench.settings import apply_settings

_ROWS = flags.DEFINE_list("rows", ["1000000", "10000000"], "Table rows.")
_WIDTHS = flags.DEFINE_list("widths", ["64", "128"], "Table widths.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"],
                            "Table dtypes.")
_KINDS = flags.DEFINE_list("kinds", ["sequence", "pooled"],
                           "Feature kinds: sequence, pooled.")
_IDS = flags.DEFINE_integer("ids", 16384, "Ids (sequence) or bags (pooled) "
                            "per step.")
_BAG = flags.DEFINE_integer("bag", 20, "Ids per bag of a pooled feature.")
_BACKENDS = flags.DEFINE_list("backends", ["mosaic_tpu", "xla"],
                              "Library backends to time.")
_DENSE = flags.DEFINE_bool("dense", True, "Time the dense optax step too.")
_ZIPF = flags.DEFINE_float("zipf", 1.05, "Zipf exponent of the ids.")
_DISTS = flags.DEFINE_list(
    "dists", ["zipf"], "Id distributions: zipf (Zipf, hot rows spread over "
    "the table), hot_low (Zipf, the lowest ids the hottest), uniform.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed rounds.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed rounds first.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")
_SET = flags.DEFINE_multi_string(
    "set", [], "MODULE.NAME=VALUE: sets a module constant first (a knob, "
    "e.g. pallas_emb.kernels.mosaic_tpu.lookup.POOL_METHOD='xla').")


def _loss(emb):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return jnp.sum(jnp.square(emb.astype(jnp.float32))) * 1e-3


def _cases(rows, width, dtype, kind, num_ids, bag, backends, dense, zipf,
           dist="zipf"):
  """{name: (jitted step, state)} and the id batches of one configuration."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  from pallas_emb.datasets import zipf_ids  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
  shape = (num_ids,) if kind == "sequence" else (num_ids, bag)
  rng = np.random.default_rng(0)
  size = int(np.prod(shape))

  def ids():
    if dist == "uniform":
      return rng.integers(0, rows, size)
    return zipf_ids(rng, rows - 1, size, zipf, permute=dist == "zipf")

  batches = [jnp.asarray(ids().reshape(shape), jnp.int32) for _ in range(4)]
  combiner = None if kind == "sequence" else "sum"
  cases = {}
  for backend in backends:
    coll = pe.EmbeddingCollection(
        [pe.TableSpec("t", rows, width, optimizer=pe.RowwiseAdagrad(0.01),
                      dtype=dtype)],
        [pe.FeatureSpec("f", "t", combiner=combiner)], mesh, "x",
        backend=backend)

    def step(state, ids, coll=coll):
      emb, routing = coll.lookup_and_route(state, {"f": ids})
      grads = jax.grad(lambda e: _loss(e["f"]))(emb)
      return coll.apply_gradients(state, routing, grads)[0]

    cases[backend] = (jax.jit(step, donate_argnums=0),
                      coll.init(jax.random.key(0)))
  if dense:
    import optax  # pylint: disable=g-import-not-at-top
    opt = optax.adagrad(0.01)
    table = jax.random.normal(jax.random.key(0), (rows, width), dtype)

    def dense_step(state, ids):
      table, opt_state = state
      def loss(t):
        emb = jnp.take(t, ids, axis=0)
        return _loss(emb if kind == "sequence" else emb.sum(axis=1))
      grad = jax.grad(loss)(table)
      updates, opt_state = opt.update(grad, opt_state, table)
      return optax.apply_updates(table, updates), opt_state

    cases["dense"] = (jax.jit(dense_step, donate_argnums=0),
                      (table, opt.init(table)))
  return cases, batches


def _temporaries(step, state, ids) -> int:
  analysis = step.lower(state, ids).compile().memory_analysis()
  return int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis else -1


def run_configuration(rows, width, dtype, kind, failures, dist="zipf"):
  """Median ms, speed-up over dense and temporaries of every case that
  compiles and runs; a case that fails is named in `failures` and left
  out (one run on a chip should measure everything that works)."""
  import jax  # pylint: disable=g-import-not-at-top
  # Each phase's seconds are printed as it ends, so a run cut short by a
  # time limit still says where its time went.
  clock = [time.perf_counter()]

  def phase(what):
    now = time.perf_counter()
    print(f"  {rows:,} x {width} {dtype} {kind} {dist}: {what} "
          f"{now - clock[0]:.1f} s", flush=True)
    clock[0] = now

  cases, batches = _cases(rows, width, dtype, kind, _IDS.value, _BAG.value,
                          _BACKENDS.value, _DENSE.value, _ZIPF.value, dist)
  phase("ids and states")
  states, temps = {}, {}
  for name, (step, state) in list(cases.items()):
    try:
      temps[name] = _temporaries(step, state, batches[0])
      phase(f"{name} compiled")
      states[name] = jax.block_until_ready(step(state, batches[0]))
      phase(f"{name} first step")
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"{rows} x {width} {dtype} {kind} {name}: "
                      f"{type(e).__name__}: {e}")
      print(f"FAILED {failures[-1][:2000]}", flush=True)
      del cases[name]
  times = {name: [] for name in cases}
  calls = itertools.count()
  for round_ in range(_WARMUP.value + _REPEATS.value):
    for name, (step, _) in cases.items():
      ids = batches[next(calls) % len(batches)]
      jax.block_until_ready(states[name])
      start = time.perf_counter()
      states[name] = jax.block_until_ready(step(states[name], ids))
      if round_ >= _WARMUP.value:
        times[name].append(time.perf_counter() - start)
  table_bytes = rows * width * jax.numpy.dtype(dtype).itemsize
  records = []
  for name in cases:
    ms = 1e3 * statistics.median(times[name])
    records.append({"rows": rows, "width": width, "dtype": dtype,
                    "kind": kind, "dist": dist, "case": name, "ms": ms,
                    "temp_bytes": temps[name],
                    "temp_of_table": temps[name] / table_bytes,
                    "table_sized_temp": temps[name] >= table_bytes})
  dense = next((r["ms"] for r in records if r["case"] == "dense"), None)
  for r in records:
    r["vs_dense"] = dense / r["ms"] if dense else None
  return records


def format_table(records) -> str:
  lines = ["| rows | width | dtype | feature | ids | case | step ms | "
           "x dense | temporaries |", "|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    vs = f"{r['vs_dense']:.2f}x" if r["vs_dense"] else "-"
    flag = f" ({r['temp_of_table']:.0%} of the table)"
    lines.append(
        f"| {r['rows']:,} | {r['width']} | {r['dtype']} | {r['kind']} | "
        f"{r['dist']} | {r['case']} | {r['ms']:.3f} | {vs} | "
        f"{r['temp_bytes'] / 2**20:.1f} MiB{flag} |")
  return "\n".join(lines)


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  apply_settings(_SET.value)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{_IDS.value} ids, bags of {_BAG.value}"
        f"{''.join(', ' + x for x in _SET.value)}")
  records, failures = [], []
  for rows, width, dtype, kind, dist in itertools.product(
      _ROWS.value, _WIDTHS.value, _DTYPES.value, _KINDS.value, _DISTS.value):
    new = run_configuration(int(float(rows)), int(width), dtype, kind,
                            failures, dist)
    records += new
    print(format_table(new), flush=True)
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "w") as f:
        json.dump(records, f, indent=1)
  print("\nAll configurations:\n" + format_table(records))
  for failure in failures:
    print(f"FAILED {failure[:300]}")


if __name__ == "__main__":
  app.run(main)
