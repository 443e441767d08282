"""Per-op time of the compiled sparse step on XLA:CPU, from a jax.profiler trace.

    python bench/profile_step.py --dtype=bfloat16 --variant=lib
    python bench/profile_step.py --dtype=bfloat16 --variant=plain_scatter

Runs the step of `pallas_emb.bench --what=step` (xla backend, 1 device by
default) under `jax.profiler` with `--xla_cpu_enable_xprof_traceme`, so each
XLA:CPU thunk (fusion, sort, scatter, ...) is a trace event, and prints the
ops that take the most time per step, with their result shapes from the
compiled HLO. Variants: lib (the library), plain_scatter (bench/prototypes:
plain bf16 scatter, compiled with float-normalization-bf16 off). --lazy
profiles lazy Adagrad.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from pallas_emb import bench  # pylint: disable=g-import-not-at-top

_VARIANT = flags.DEFINE_enum("variant", "lib", ["lib", "plain_scatter"],
                             "What to profile.")
_STEPS = flags.DEFINE_integer("steps", 20, "Profiled steps.")
_TOP = flags.DEFINE_integer("top", 15, "Ops to print.")


def main(argv):
  del argv
  bench.configure_jax(bench._NUM_DEVICES.value,  # pylint: disable=protected-access
                      "--xla_cpu_enable_xprof_traceme=true")
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pallas_emb as pe  # pylint: disable=g-import-not-at-top
  import prototypes  # pylint: disable=g-import-not-at-top

  dtype = bench._DTYPE.value[0]  # pylint: disable=protected-access
  v, e, n = bench._VOCAB.value, bench._WIDTH.value, bench._TOKENS.value  # pylint: disable=protected-access
  devices = jax.devices()[:bench._NUM_DEVICES.value]  # pylint: disable=protected-access
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))
  ctx = pe.make_context(mesh, "x", tokens_per_batch=n, emb_width=e,
                        num_unique=pe.default_num_unique(n, v))
  opt = pe.RowwiseAdagrad(0.01, half_life_steps=100.0 if bench._LAZY.value  # pylint: disable=protected-access
                          else None, lazy=bench._LAZY.value)  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  ids = jax.device_put(bench.zipf_ids(rng, n, v, bench._ZIPF.value, True),  # pylint: disable=protected-access
                       pe.token_sharding(ctx))
  table = bench._put_table((v, e), dtype, pe.table_sharding(ctx), 0)  # pylint: disable=protected-access
  state = opt.init(ctx, table)

  def step(t, s, i):
    emb = pe.lookup(ctx, t, i, backend="xla")
    g = jax.grad(bench._loss)(emb)  # pylint: disable=protected-access
    d = pe.dedup(ctx, i, vocab_rows=v)
    t, s, stats = pe.apply_gradients(ctx, opt, t, s, g, d, backend="xla")
    return t, s, stats.norm

  options = None
  if _VARIANT.value != "lib":
    prototypes.install(_VARIANT.value)
  if _VARIANT.value == "plain_scatter":
    options = {"xla_disable_hlo_passes": "float-normalization-bf16"}
  try:
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(table, state, ids)
  finally:
    prototypes.uninstall()
  compiled = (lowered.compile(compiler_options=options) if options
              else lowered.compile())
  shapes = {}
  for comp in bench.parse_hlo(compiled.as_text()).values():
    for ins in comp:
      shapes[ins.name] = (ins.opcode, ins.shape)
  for _ in range(3):
    table, state, _ = compiled(table, state, ids)
  jax.block_until_ready(table)
  tmp = tempfile.mkdtemp()
  jax.profiler.start_trace(tmp, create_perfetto_trace=True)
  for _ in range(_STEPS.value):
    table, state, norm = compiled(table, state, ids)
    jax.block_until_ready(norm)
  jax.profiler.stop_trace()
  path = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"),
                   recursive=True)[0]
  with gzip.open(path) as f:
    events = json.load(f)
  events = events.get("traceEvents", events)
  total = collections.Counter()
  count = collections.Counter()
  for ev in events:
    name = ev.get("name", "")
    if ev.get("ph") == "X" and name in shapes:
      total[name] += ev.get("dur", 0)
      count[name] += 1
  per_step = {k: t / _STEPS.value for k, t in total.items()}
  whole = sum(per_step.values())
  print(f"{dtype} variant={_VARIANT.value} lazy={bench._LAZY.value}: "  # pylint: disable=protected-access
        f"{whole / 1e3:.3f} ms of traced ops per step (all threads)")
  for name, us in sorted(per_step.items(), key=lambda kv: -kv[1])[:_TOP.value]:
    opcode, shape = shapes[name]
    print(f"  {us / 1e3:8.3f} ms  {100 * us / whole:5.1f}%  {opcode:10s} "
          f"{name:40s} {shape[:60]}")


if __name__ == "__main__":
  app.run(main)
