#!/usr/bin/env bash
# The TPU check, in one run on a TPU VM (JAX with TPU support installed):
#
#   bash bench/tpu_check.sh             # on the chip: tests, then the table
#   SMOKE=1 bash bench/tpu_check.sh     # on a CPU: the same steps, tiny
#
# 1. installs pallas_emb and what its tests need (not jax: the VM's own);
# 2. runs the Mosaic kernels' tests on the chip (backend "mosaic_tpu": the
#    kernels against their twins, a whole step against the xla backend),
#    in one process (one program at a time holds the chip);
# 3. prints the step table of bench/tpu.py: our step on the Mosaic kernels
#    and on XLA's gather/scatter beside a dense optax step, 1M and 10M rows,
#    widths 64 and 128, f32 and bf16, sequence ids and bags of 20, with
#    each step's peak temporaries.
# Logs go to $LOG (default tpu_check_logs/); each stage has a timeout, so
# a stage that hangs leaves time to rerun the check.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG="${LOG:-tpu_check_logs}"
mkdir -p "$LOG"
SMOKE="${SMOKE:-0}"

python -c 'import jax; print("jax", jax.__version__, jax.devices())'
python -m pip install -q --no-deps -e .
python -m pip install -q chex absl-py pytest ml_dtypes optax \
  || echo "tpu_check: could not install every test dependency; continuing"

if [ "$SMOKE" = 1 ]; then
  backend_env=()  # the interpreter
  bench_flags=(--rows=2000 --widths=64 --dtypes=float32 --ids=128 --bag=4
               --backends=mosaic_tpu_interpret,xla --repeats=1 --warmup=1)
  tests=(tests/mosaic_tpu_test.py -k "Lowering or Resolution or gather")
else
  backend_env=(PALLAS_EMB_TEST_BACKEND=mosaic_tpu)
  bench_flags=()
  tests=(tests/mosaic_tpu_test.py)
fi

echo "tpu_check: tests"
env "${backend_env[@]}" timeout 1200 python -m pytest -q -o addopts="" -p no:xdist \
  "${tests[@]}" 2>&1 | tee "$LOG/tests.txt"
echo "tpu_check: step table"
timeout 1800 python -m bench.tpu "${bench_flags[@]}" \
  --json_out="$LOG/tpu.json" 2>&1 | tee "$LOG/tpu.txt"
echo "tpu_check: done; logs in $LOG/"
