#!/usr/bin/env bash
# The host tier's check on a machine with an accelerator (e.g. a TPU VM),
# in one run of under 10 minutes (BUDGET seconds, default 570), no network:
#
#   bash bench/host_tier_check.sh                 # 100M x 64 f32 rows
#   FILES=1 bash bench/host_tier_check.sh         # in files in DIR
#   SMOKE=1 bash bench/host_tier_check.sh         # on a CPU: the same, tiny
#   MOVES=20000000 bash ...    # bench.host_rows on a smaller table (faster)
#   PROFILE=10 bash ...        # then 10 steps traced: device ms by program/op
#   HOST_PROFILE=40 bash ...   # then 40 steps under cProfile: the host time
#                              # grown at and after each eviction group
#   STEPS=64 WARMUP=600 bash ...  # more timed / warm-up steps (20; 400,
#                                 # or 3000 for sequence ids)
#
# On a TPU VM the runtime's transfer buffer is set to 1 GiB unless
# TPU_PREMAPPED_BUFFER_SIZE is set (its default leaves too little host
# memory for 100M rows beside it; docs/host_tier.md).
#
# 1. prints what the host is: its memory, cores and kernel, and the file
#    system of DIR (default: the current directory), with a warning where
#    /proc/vmstat is missing (not an ordinary Linux page cache: files may
#    be held in memory, and then `host_dir` frees none);
# 2. `bench.host_rows`: what moving a step's misses (50,000 random rows
#    read, then written back) costs on this host, in memory and in a file
#    in DIR, first touch and later;
# 3. `bench.host_tier` at ROWS rows, 16,384 bags of 20 (BAG=0: sequence
#    ids) with a cache of CACHE rows (default 12M: at 100M Zipf rows it
#    holds 0.90 of the ids once full, after about 330 steps of bags; 8M
#    holds 0.88), in host memory (FILES=1:
#    in files in DIR), beside a 10M-row device table; it prints its pace every 30 s
#    and is stopped when the budget runs out, so a slow host still reports.
#
# Dependencies as `bench/tpu_check.sh` installs them (its .tpu_check_site
# is used when present). Logs and JSON go to $LOG (default
# host_tier_check_logs/).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${LOG:-host_tier_check_logs}"
mkdir -p "$LOG"
PYTHON="${PYTHON:-python3}"
BUDGET="${BUDGET:-570}"
DIR="${DIR:-$PWD}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .tpu_check_site ] && export PYTHONPATH="$PYTHONPATH:$PWD/.tpu_check_site"
export PYTHONUNBUFFERED=1
export TPU_PREMAPPED_BUFFER_SIZE="${TPU_PREMAPPED_BUFFER_SIZE-1073741824}"

if [ "${SMOKE:-0}" = 1 ]; then
  rows=(--rows=20000)
  tier=(--cache_rows=2048 --ids=64 --bag="${BAG:-4}" --steps=2 --warmup=2
        --compare_device_rows=2000 --link_mb=1 --report_s=0.01)
  row_flags=(--rows=20000 --misses=100 --repeats=2)
else
  rows=(--rows="${ROWS:-100000000}")
  row_flags=(--rows="${MOVES:-${ROWS:-100000000}}")
  tier=(--cache_rows="${CACHE:-12582912}" --bag="${BAG:-20}"
        --steps="${STEPS:-20}" --compare_device_rows=10000000 --link_mb=16)
  if [ "${BAG:-20}" = 0 ]; then warmup=3000; else warmup=400; fi
  tier+=(--warmup="${WARMUP:-$warmup}")
fi
[ -n "${PROFILE:-}" ] && tier+=(--profile_steps="$PROFILE")
[ -n "${HOST_PROFILE:-}" ] && tier+=(--host_profile_steps="$HOST_PROFILE")

echo "host_tier_check: the host"
grep -E "^(MemTotal|MemAvailable):" /proc/meminfo 2>/dev/null
echo "cores: $(nproc 2>/dev/null), kernel: $(uname -r)"
df -hT "$DIR" 2>/dev/null | tail -1
[ -e /proc/vmstat ] || echo "host_tier_check: no /proc/vmstat: this is not" \
  "an ordinary Linux page cache; files may be held in memory"
files=()
mkdir -p "$DIR/host_tier_check_files" || exit 1
[ "${FILES:-0}" = 1 ] && files=(--host_dir="$DIR/host_tier_check_files")

echo "host_tier_check: rows moved on the host"
timeout $((BUDGET - SECONDS)) "$PYTHON" -m bench.host_rows "${row_flags[@]}" \
  --dir="$DIR" --json_out="$LOG/host_rows.json" 2>&1 \
  | tee "$LOG/host_rows.txt"

echo "host_tier_check: the host tier's steps"
# SIGINT first: the bench's JSON holds every configuration it finished.
timeout -s INT $((BUDGET - SECONDS)) "$PYTHON" -m bench.host_tier \
  "${rows[@]}" "${tier[@]}" "${files[@]}" --memory_kinds_rows=0 \
  --json_out="$LOG/host_tier.json" 2>&1 | tee "$LOG/host_tier.txt"
rm -rf "$DIR/host_tier_check_files"
echo "host_tier_check: done in $SECONDS s; logs in $LOG/"
