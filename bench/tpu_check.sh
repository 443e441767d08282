#!/usr/bin/env bash
# The TPU check, in one run on a TPU VM with JAX installed (no network
# needed), in under 8 minutes (FULL=1: at most 14):
#
#   bash bench/tpu_check.sh                       # on the chip
#   WHEELS=/path/to/wheels bash bench/tpu_check.sh  # test deps from there
#   SMOKE=1 bash bench/tpu_check.sh               # on a CPU: the same, tiny
#   PROFILE=1 bash bench/tpu_check.sh             # + ms per op of a step
#   FULL=1 bash bench/tpu_check.sh                # every case; 10M rows too
#
# 1. puts pallas_emb on PYTHONPATH (nothing is built or installed) and
#    installs what its tests need that is missing (chex, absl-py, pytest,
#    optax, ml_dtypes; never jax): from $WHEELS (a folder of wheels) or
#    $INDEX (a package index URL) if set, else pip's default; a failed
#    install is reported and the check goes on;
# 2. runs the Mosaic kernels' tests on the chip (backend "mosaic_tpu": the
#    kernels against numpy models and their twins, whole steps against the
#    xla backend), in one process (one program at a time holds the chip):
#    each test's names and cases taken in turn, as in CI, or with FULL=1
#    every pair of them (half as long again);
# 3. prints the step table of bench/tpu.py: the step on the default
#    backend (mosaic_tpu) beside a dense optax step, 1M rows (with FULL=1
#    also 10M rows, and the xla backend at 1M), f32 and bf16, sequence ids
#    and bags of 20, with each step's temporaries; BENCH_FLAGS adds or
#    overrides flags (e.g. "--widths=32,64,128,256 --kinds=sequence");
# 4. with PROFILE=1, prints where the 1M-row pooled step's device time goes
#    (bench/tpu_profile.py: ms per op, about 40 s more).
# Logs go to $LOG (default tpu_check_logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${LOG:-tpu_check_logs}"
mkdir -p "$LOG"
SMOKE="${SMOKE:-0}"
FULL="${FULL:-0}"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())' \
  || exit 1
missing=$("$PYTHON" - <<'EOF'
import importlib.util
need = {"chex": "chex", "absl": "absl-py", "pytest": "pytest",
        "optax": "optax", "ml_dtypes": "ml_dtypes", "toolz": "toolz",
        "typing_extensions": "typing_extensions"}
print(" ".join(p for m, p in need.items() if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "tpu_check: installing $missing"
  source=()
  if [ -n "${WHEELS:-}" ]; then
    source=(--no-index --find-links "$WHEELS")
  elif [ -n "${INDEX:-}" ]; then
    source=(--index-url "$INDEX")
  fi
  target="${TARGET:-$PWD/.tpu_check_site}"
  # --no-deps: never replace the VM's jax; --target + PYTHONPATH: no root.
  "$PYTHON" -m pip install -q --no-deps --target "$target" "${source[@]}" \
    $missing || echo "tpu_check: could not install $missing; continuing"
  export PYTHONPATH="$PYTHONPATH:$target"
fi

if [ "$SMOKE" = 1 ]; then
  backend_env=()  # the interpreter
  bench_flags=(--rows=2000 --widths=64 --dtypes=float32 --ids=128 --bag=4
               --backends=mosaic_tpu_interpret,xla --repeats=1 --warmup=1)
  tests=(tests/mosaic_tpu_test.py -k "Lowering or Resolution or stored")
else
  pairs=turn
  [ "$FULL" = 1 ] && pairs=all
  backend_env=(PALLAS_EMB_TEST_BACKEND=mosaic_tpu PALLAS_EMB_TEST_PAIRS=$pairs)
  bench_flags=(--widths=64 --repeats=5 --warmup=1)
  tests=(tests/mosaic_tpu_test.py)
fi
# FULL=1: 1M rows with the xla backend beside; 10M rows without it (three
# 10M-row states and their steps do not fit one 16 GB chip together).
if [ "$SMOKE" = 1 ]; then
  runs=("")
elif [ "$FULL" = 1 ]; then
  runs=("--rows=1000000" "--rows=10000000 --backends=mosaic_tpu")
else
  runs=("--rows=1000000 --backends=mosaic_tpu")
fi

echo "tpu_check: tests"
test_limit=300
[ "$FULL" = 1 ] && test_limit=450
env "${backend_env[@]}" timeout "$test_limit" "$PYTHON" -m pytest -q -o addopts="" \
  -p no:xdist -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$LOG/tests.txt"
echo "tpu_check: step table"
i=0
for run in "${runs[@]}"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  timeout 200 "$PYTHON" -m bench.tpu "${bench_flags[@]}" $run \
    ${BENCH_FLAGS:-} --json_out="$LOG/tpu$i.json" 2>&1 \
    | tee "$LOG/tpu$i.txt"
done
if [ "${PROFILE:-0}" = 1 ] && [ "$SMOKE" != 1 ]; then
  echo "tpu_check: where the pooled step's time goes"
  timeout 120 "$PYTHON" -m bench.tpu_profile --rows=1000000 --widths=64 \
    --kinds=pooled --json_out="$LOG/profile.json" 2>&1 \
    | tee "$LOG/profile.txt"
fi
echo "tpu_check: done; logs in $LOG/"
