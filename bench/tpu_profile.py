"""Where a sparse step's device time goes: the step of `bench.tpu`, traced.

    python -m bench.tpu_profile --rows=1000000 --kinds=pooled  # on a TPU
    python -m bench.tpu_profile --rows=2000 --ids=64 --bag=4 \
        --backends=xla --steps=2                               # CPU smoke

Takes `bench.tpu`'s flags (the first of each list; `--json_out` gets the
ops) and runs the whole
jitted step of that one case a few times under
`jax.profiler.trace`, reads the trace back (`jax.profiler.ProfileData`)
and prints, per device op (the "XLA Ops" lines of the device planes: a
Pallas kernel is one op, named after its kernel), its time per step and
share of the step, largest first. On a CPU the host planes carry no such
lines: the run only checks that the program works.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

from absl import app
from absl import flags

from bench import settings
from bench import tpu as bench_tpu
from bench.trace import device_op_times

_STEPS = flags.DEFINE_integer("steps", 5, "Traced steps.")
_TOP = flags.DEFINE_integer("top", 25, "Ops printed.")

def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  settings.apply_settings(flags.FLAGS.set)
  fl = flags.FLAGS
  config = (int(float(fl.rows[0])), int(fl.widths[0]), fl.dtypes[0],
            fl.kinds[0], fl.dists[0], fl.backends[0])
  rows, width, dtype, kind, dist, backend = config
  cases, batches = bench_tpu._cases(  # pylint: disable=protected-access
      rows, width, dtype, kind, fl.ids, fl.bag, [backend], False, fl.zipf,
      dist)
  step, state = cases[backend]
  for i in range(3):
    state = jax.block_until_ready(step(state, batches[i % len(batches)]))
  trace_dir = tempfile.mkdtemp(prefix="pallas_emb_profile_")
  with jax.profiler.trace(trace_dir):
    for i in range(_STEPS.value):
      state = jax.block_until_ready(step(state, batches[i % len(batches)]))
  totals = device_op_times(trace_dir)
  if not totals:  # say what the trace holds instead
    from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                          recursive=True):
      for plane in ProfileData.from_file(path).planes:
        print(f"  plane {plane.name}: lines "
              f"{sorted({line.name for line in plane.lines})[:12]}")
  steps = _STEPS.value
  whole = sum(totals.values()) / steps
  print(f"{rows:,} x {width} {dtype} {kind} {dist} on {backend}"
        f"{''.join(' ' + x for x in flags.FLAGS.set)}: device ops {whole / 1e6:.3f} ms "
        f"per step ({len(totals)} ops)")
  ranked = sorted(totals.items(), key=lambda kv: -kv[1])
  for name, ns in ranked[:_TOP.value]:
    print(f"  {ns / steps / 1e6:8.3f} ms {ns / steps / max(whole, 1):6.1%}  "
          f"{name[:110]}")
  if fl.json_out:
    with open(fl.json_out, "w") as f:
      json.dump({"config": config,
                 "ms_per_step": {k: v / steps / 1e6 for k, v in ranked}},
                f, indent=1)


if __name__ == "__main__":
  app.run(main)
