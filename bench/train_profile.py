"""Where a training run's device time goes: an `examples.train` run, traced.

    python -m bench.train_profile --config=configs/movielens_1m_hstu_large.py \
        --epochs=4 --eval_every=101 --train_on_valid          # on a TPU
    python -m bench.train_profile --config=configs/tiny.py    # CPU smoke

Takes every flag of `examples.train`, runs that program whole under
`jax.profiler.trace` and prints the device ops of the run (the "XLA Ops"
lines of the device planes, `bench.trace.device_op_times`: a Pallas
kernel is one op), largest first, each with its total time and share.
The totals cover every step and evaluation of the run, not compiles; divide
by the steps the program reports for a per-step figure; `--json_out`
gets them all. On a CPU the host planes carry no such lines: the run only
checks that the program works.
"""

from __future__ import annotations

import json
import tempfile

from absl import flags

from bench import trace
from examples import train

_TOP = flags.DEFINE_integer("profile_top", 30, "Device ops printed.")
_JSON_OUT = flags.DEFINE_string("json_out", None,
                                "Write the ops' total ms by name here.")


def profiled(config) -> dict[str, float]:
  """Runs `train.train(config)` traced; prints and returns the device ops'
  total ns by name."""
  import jax  # pylint: disable=g-import-not-at-top
  trace_dir = tempfile.mkdtemp(prefix="pallas_emb_train_profile_")
  with jax.profiler.trace(trace_dir):
    train.train(config)
  totals = trace.device_op_times(trace_dir)
  whole = sum(totals.values())
  print(f"device ops of the run: {whole / 1e6:.1f} ms in all, "
        f"{len(totals)} ops")
  for name, ns in sorted(totals.items(), key=lambda kv: -kv[1])[:_TOP.value]:
    print(f"  {ns / 1e6:9.1f} ms {ns / max(whole, 1):6.1%}  {name[:120]}")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"ms": {k: v / 1e6 for k, v in totals.items()}}, f)
  return totals


if __name__ == "__main__":
  train.main(program=profiled)
