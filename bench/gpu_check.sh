#!/usr/bin/env bash
# One unattended GPU check of pallas_emb, within 8 minutes, everything under
# $OUT (default ./out):
#
#   gpu_check.log    everything printed, with stage timings; starts with the
#                    environment (nvidia-smi, versions, jax.devices())
#   kernels.json     gather / segment-sum / adagrad kernels vs their xla twins
#                    (the twin of gather is jnp.take) and an elementwise copy
#                    of the same size, shard widths 8..128, f32 + bf16
#   step.json        full sparse step on one GPU, pallas vs xla vs dense,
#                    f32 + bf16, 1M and 10M rows at 16k ids (same rounds)
#   step_10m.json    the same at 10M rows / 64k ids (FBGEMM's big case)
#   lookup.json      lookup alone, pallas vs xla vs dense (jnp.take)
#   update.json      dedup + apply_gradients, pallas vs xla vs dense
#   pytest.txt       PALLAS_EMB_TEST_BACKEND=pallas python -m pytest -q on
#                    every tests/*_test.py (kernel tests first)
#   summary.json     per stage: return code, seconds, timed out or not
#
# Usage (from anywhere; it cds to the repository root):
#   bash bench/gpu_check.sh                  # on the GPU machine
#   DRY_RUN=1 bash bench/gpu_check.sh        # CPU dry run: Pallas interpret
#                                            # mode, tiny sizes, no install
# Knobs: OUT, TOTAL_BUDGET_S (default 470), PYTEST_FIRST / PYTEST_REST (the
# test files run before / after the benchmarks), SKIP_INSTALL=1, SKIP_TESTS=1.
#
# Installs nothing except `pip install -e .[test]` (skipped when DRY_RUN=1 or
# SKIP_INSTALL=1; if it fails -- e.g. offline -- the run goes on from the
# checkout through PYTHONPATH). The GPU machine's preinstalled jax is used.
# Order: the kernel / lookup / optimizer / HLO tests (<= 170 s), the
# benchmarks (<= 320 s together), then the rest of the suite with whatever
# time is left; every stage has a timeout, so the script ends in time.

set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DRY_RUN=${DRY_RUN:-0}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-470}
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.json"
START=$(date +%s)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

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
  budget=$(left)
  budget=$(( budget - 5 ))
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
  # The summary: a JSON list of stages (drop the trailing comma).
  sed '$ s/,$//' "$SUMMARY.tmp" >"$SUMMARY"
  echo "]" >>"$SUMMARY"
  rm -f "$SUMMARY.tmp"
  echo "=== done in $(elapsed)s; files in $OUT:"
  ls -la "$OUT"
}
trap finish EXIT

if [[ "$DRY_RUN" == 1 ]]; then
  echo "=== DRY RUN (CPU, interpret backend, tiny sizes)"
  BACKEND=interpret
  KERNELS_ARGS=(--vocab_rows=4096 --kernel_widths=8,64 --kernel_tokens=256
                --dtype=float32,bfloat16 --repeats=2 --burst=2 --warmup=1
                --copy_mb=8 --inner=2)
  STEP_ARGS=(--vocab_rows=4096 --tokens_per_batch=256 --repeats=2 --burst=2
             --warmup=1 --copy_mb=8)
  ALSO_VOCAB=8192
  STEP_BIG_ARGS=(--vocab_rows=8192 --tokens_per_batch=512 --repeats=2
                 --burst=2 --warmup=1 --copy_mb=8)
  : "${PYTEST_FIRST:=tests/hlo_test.py}"
  : "${PYTEST_REST:=tests/bench_test.py}"
else
  BACKEND=pallas
  KERNELS_ARGS=(--vocab_rows=1000000 --kernel_widths=8,16,64,128
                --kernel_tokens=16384,262144 --dtype=float32,bfloat16
                --repeats=5 --burst=4 --warmup=1 --inner=20)
  STEP_ARGS=(--vocab_rows=1000000 --tokens_per_batch=16384 --repeats=8
             --burst=5 --warmup=2)
  ALSO_VOCAB=10000000
  STEP_BIG_ARGS=(--vocab_rows=10000000 --tokens_per_batch=65536 --repeats=6
                 --burst=5 --warmup=2)
  # The kernel and layout tests first (they say whether the Triton kernels
  # are right on this GPU); then every other test file.
  : "${PYTEST_FIRST:=tests/kernels_test.py tests/lookup_test.py
    tests/optim_test.py tests/hlo_test.py}"
  PYTEST_REST=${PYTEST_REST:-}
  if [[ -z "$PYTEST_REST" ]]; then
    for f in tests/*_test.py; do
      [[ " $(echo $PYTEST_FIRST) " == *" $f "* ]] || PYTEST_REST+=" $f"
    done
  fi
fi
FIRST_FILES=(); for f in $PYTEST_FIRST; do [[ -e "$f" ]] && FIRST_FILES+=("$f"); done
REST_FILES=(); for f in $PYTEST_REST; do [[ -e "$f" ]] && REST_FILES+=("$f"); done

{
  echo "=== environment"
  echo "date: $(date -u)"; echo "host: $(hostname)"; echo "dry_run: $DRY_RUN"
  command -v nvidia-smi >/dev/null && nvidia-smi
  python - <<'EOF'
import platform, sys
print("python", sys.version.replace("\n", " "), platform.machine())
try:
  import jax, jaxlib
  print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
  print("devices", jax.devices())
  d = jax.devices()[0]
  print("device_kind", d.device_kind, "platform", d.platform)
  print("memory_stats", getattr(d, "memory_stats", lambda: None)())
except Exception as e:  # report, do not die
  print("jax failed:", repr(e))
for mod in ("optax", "flax", "haiku", "orbax.checkpoint", "chex", "pytest",
            "matplotlib", "numpy", "ml_dtypes"):
  try:
    m = __import__(mod, fromlist=["_"])
    print(mod, getattr(m, "__version__", "?"))
  except Exception as e:
    print(mod, "MISSING", repr(e))
EOF
} 2>&1

if [[ "$DRY_RUN" != 1 && "${SKIP_INSTALL:-0}" != 1 ]]; then
  # Offline machine: no build isolation (it would fetch setuptools), no
  # retries; if the extras are not preinstalled this fails fast and the run
  # goes on from the checkout (PYTHONPATH).
  stage install 90 python -m pip install -q --no-build-isolation \
    --retries 0 --timeout 5 -e ".[test]"
fi

run_pytest() {  # run_pytest NAME MAX_SECONDS FILES...
  local name=$1 max=$2
  shift 2
  (( $# )) || return 0
  [[ "${SKIP_TESTS:-0}" == 1 ]] && return 0
  # --maxfail keeps a broken install from spending the whole budget.
  stage "$name" "$max" env PALLAS_EMB_TEST_BACKEND=$BACKEND \
    python -m pytest -q -rfE --maxfail=25 "$@" > >(tee -a "$OUT/pytest.txt") 2>&1
}
: >"$OUT/pytest.txt"

run_pytest pytest_kernels 170 "${FIRST_FILES[@]}"

BENCH=(python -m pallas_emb.bench)
stage kernels 110 "${BENCH[@]}" --what=kernels --backends=$BACKEND,xla \
  "${KERNELS_ARGS[@]}" --json_out="$OUT/kernels.json"
# 1M and 10M rows at 16k ids in the same rounds (rows scaling), f32 + bf16.
stage step 90 "${BENCH[@]}" --what=step --num_devices=1 \
  --backends=$BACKEND,xla --baselines=dense,xla --dtype=float32,bfloat16 \
  "${STEP_ARGS[@]}" --also_vocab_rows=$ALSO_VOCAB --json_out="$OUT/step.json"
stage step_10m 50 "${BENCH[@]}" --what=step --num_devices=1 \
  --backends=$BACKEND,xla --baselines=dense,xla --dtype=float32,bfloat16 \
  "${STEP_BIG_ARGS[@]}" --json_out="$OUT/step_10m.json"
stage lookup 35 "${BENCH[@]}" --what=lookup --num_devices=1 \
  --backends=$BACKEND,xla --dtype=float32,bfloat16 "${STEP_ARGS[@]}" \
  --json_out="$OUT/lookup.json"
stage update 35 "${BENCH[@]}" --what=update --num_devices=1 \
  --backends=$BACKEND,xla --dtype=float32,bfloat16 "${STEP_ARGS[@]}" \
  --json_out="$OUT/update.json"

run_pytest pytest_rest 400 "${REST_FILES[@]}"
