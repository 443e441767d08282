#!/usr/bin/env bash
# One unattended check of pallas_emb on ONE GPU, in at most 6 minutes of run
# time (TOTAL_BUDGET_S=360; every stage has a timeout), 4 files under $OUT
# (default ./out):
#
#   gpu_check.log  everything printed, with stage timings; starts with the
#                  environment (nvidia-smi, versions, jax.devices())
#   pytest.txt     the test stages' output
#   bench.json     bench/kernels.py: gather / segment-sum / sparse update
#                  (lazy row-wise Adagrad) / full step, pallas vs the xla
#                  twins vs a device copy, 10M-row
#                  tables, Zipf and uniform ids, bf16 first, each output
#                  checked against the twin at benchmark size
#   summary.json   per stage: return code, seconds, timed out or skipped
#
# Order: the kernel tests (tests/{gather,pool,segment_sum,adagrad,
# optimizer_kernels,ptx}_test.py:
# xla, interpret and the Triton kernels on this GPU; ptx_test skips without
# the `triton` package), then the benchmarks, then the rest of the suite on
# the pallas backend with whatever time is left.
#
# Usage (from anywhere; it cds to the repository root):
#   bash bench/gpu_check.sh                  # on the GPU machine
#   DRY_RUN=1 bash bench/gpu_check.sh        # CPU dry run: interpret
#                                            # backend, tiny sizes
# Knobs: OUT, PYTHON (default python3), TOTAL_BUDGET_S, PYTEST_KERNELS /
# PYTEST_REST (test files of the first / last stage), SKIP_TESTS=1,
# SKIP_BENCH=1. Installs nothing: the machine's jax (0.11.x with CUDA), chex,
# flax, optax, orbax and pytest are used, the checkout through PYTHONPATH.
#
# One GPU: a pytest plugin (written to a temporary directory) skips tests
# whose test_util.mesh needs more devices than there are; test files that
# import haiku are left out when dm-haiku is not installed.

set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-360}
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.json"
START=$(date +%s)
PLUGIN_DIR=$(mktemp -d)
export PYTHONPATH="$ROOT:$PLUGIN_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
echo "[" >"$SUMMARY.tmp"

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL_BUDGET_S - $(elapsed) )); }

# stage NAME MAX_SECONDS CMD...: runs CMD with a timeout of
# min(MAX_SECONDS, time left - 5), logs and records the result.
stage() {
  local name=$1 max=$2
  shift 2
  local budget
  budget=$(( $(left) - 5 ))
  if (( budget > max )); then budget=$max; fi
  if (( budget < 10 )); then
    echo "=== [$(elapsed)s] $name: skipped (no time left)"
    printf '{"stage": "%s", "rc": null, "seconds": 0, "skipped": true},\n' \
      "$name" >>"$SUMMARY.tmp"
    return 0
  fi
  echo "=== [$(elapsed)s] $name (timeout ${budget}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout -k 10 -s INT "$budget" "$@"
  rc=$?
  local secs=$(( $(date +%s) - t0 ))
  local to=false
  if (( rc == 124 || rc == 130 || rc == 137 )); then to=true; fi
  echo "=== [$(elapsed)s] $name: rc=$rc in ${secs}s (timed out: $to)"
  printf '{"stage": "%s", "rc": %d, "seconds": %d, "timed_out": %s},\n' \
    "$name" "$rc" "$secs" "$to" >>"$SUMMARY.tmp"
  return 0
}

finish() {
  sed '$ s/,$//' "$SUMMARY.tmp" >"$SUMMARY"
  echo "]" >>"$SUMMARY"
  rm -f "$SUMMARY.tmp"
  rm -rf "$PLUGIN_DIR"
  echo "=== done in $(elapsed)s; files in $OUT:"
  ls -la "$OUT"
}
trap finish EXIT

cat >"$PLUGIN_DIR/gpu_check_plugin.py" <<'EOF'
"""pytest plugin of bench/gpu_check.sh: skip tests needing more devices."""
import os
import sys

import pytest


def pytest_configure(config):
  del config
  sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
  try:
    import test_util  # the tests' shared set-up (fakes 8 CPU devices)
  except Exception:  # pylint: disable=broad-except
    return
  import jax
  import numpy as np
  original = test_util.mesh

  def mesh(shape, *args, **kwargs):
    need, have = int(np.prod(list(shape.values()))), len(jax.devices())
    if need > have:
      pytest.skip(f"needs a {need}-device mesh; this machine has {have} "
                  f"{jax.devices()[0].platform} device(s)")
    return original(shape, *args, **kwargs)

  test_util.mesh = mesh
EOF

if [[ "$DRY_RUN" == 1 ]]; then
  echo "=== DRY RUN (CPU, interpret backend, tiny sizes)"
  BACKEND=interpret
  BENCH_ARGS=(--dry_run)
  : "${PYTEST_KERNELS:=tests/gather_test.py tests/ptx_test.py}"
  : "${PYTEST_REST:=tests/segment_sum_test.py}"
else
  BACKEND=triton
  BENCH_ARGS=()
  : "${PYTEST_KERNELS:=tests/gather_test.py tests/pool_test.py
    tests/segment_sum_test.py tests/adagrad_test.py
    tests/optimizer_kernels_test.py tests/ptx_test.py}"
  if [[ -z "${PYTEST_REST:-}" ]]; then
    PYTEST_REST=""
    for f in tests/*_test.py; do
      [[ " $(echo $PYTEST_KERNELS) " == *" $f "* ]] || PYTEST_REST+=" $f"
    done
  fi
fi

{
  echo "=== environment"
  echo "date: $(date -u)"; echo "host: $(hostname)"; echo "dry_run: $DRY_RUN"
  echo "python: $PYTHON"; echo "git: $(git rev-parse --short HEAD 2>/dev/null)"
  command -v nvidia-smi >/dev/null && nvidia-smi
  "$PYTHON" - <<'EOF'
import platform, sys
print("python", sys.version.replace("\n", " "), platform.machine())
try:
  import jax, jaxlib
  print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
  print("devices", jax.devices())
  d = jax.devices()[0]
  print("device_kind", d.device_kind, "platform", d.platform)
except Exception as e:  # report, do not die
  print("jax failed:", repr(e))
for mod in ("optax", "flax", "haiku", "orbax.checkpoint", "chex", "pytest",
            "numpy", "ml_dtypes", "triton"):
  try:
    m = __import__(mod, fromlist=["_"])
    print(mod, getattr(m, "__version__", "?"))
  except Exception as e:
    print(mod, "MISSING", repr(e))
EOF
} 2>&1

# Test files that import haiku are left out when dm-haiku is missing.
runnable() {
  local f
  for f in "$@"; do
    [[ -e "$f" ]] || continue
    if grep -qE "^\s*(import haiku|from haiku|import pallas_emb\.haiku|from pallas_emb(\.layers)? import haiku)" "$f" \
        && ! "$PYTHON" -c "import haiku" 2>/dev/null; then
      echo "=== leaving out $f (imports haiku; dm-haiku is not installed)" >&2
      continue
    fi
    echo "$f"
  done
}

run_pytest() {  # run_pytest NAME MAX_SECONDS FILES...
  local name=$1 max=$2
  shift 2
  [[ "${SKIP_TESTS:-0}" == 1 ]] && return 0
  local files
  mapfile -t files < <(runnable "$@")
  (( ${#files[@]} )) || return 0
  # --maxfail keeps a broken install from spending the whole budget.
  stage "$name" "$max" env PALLAS_EMB_TEST_BACKEND=$BACKEND \
    "$PYTHON" -m pytest -q -rfEs --maxfail=25 -p gpu_check_plugin \
    "${files[@]}" > >(tee -a "$OUT/pytest.txt") 2>&1
}
: >"$OUT/pytest.txt"

# shellcheck disable=SC2086
run_pytest pytest_kernels 150 $PYTEST_KERNELS

if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  # The benchmark stops starting cases 40 s before its timeout and rewrites
  # bench.json after every case, so a slow machine still leaves results.
  bench_max=$(( $(left) - 30 ))
  if (( bench_max > 180 )); then bench_max=180; fi
  stage bench "$bench_max" "$PYTHON" -m bench.kernels "${BENCH_ARGS[@]}" \
    --budget_s=$(( bench_max > 60 ? bench_max - 40 : 10 )) \
    --json_out="$OUT/bench.json"
fi

# shellcheck disable=SC2086
run_pytest pytest_rest 400 $PYTEST_REST
