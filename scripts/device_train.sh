#!/usr/bin/env bash
# On the GPU machine: train the embedded model (target, then drafter + STS) in one call; the
# checkpoint and the training records come back under $OUT/tiny-code, the log as $OUT/train.log.
#   bash scripts/device_train.sh CORPUS_DIR TARGET_MINUTES DRAFTER_MINUTES
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jdspark-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
corpus=${1:-build/corpus}; target_minutes=${2:-3}; drafter_minutes=${3:-1.5}
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" 2>&1 | tee "$OUT/train.log"
python3 scripts/train_target.py --corpus "$corpus" --minutes "$target_minutes" --out /tmp/tiny-code-target 2>&1 \
  | grep -v Warning | tee -a "$OUT/train.log"
python3 scripts/train_drafter.py --target /tmp/tiny-code-target --corpus "$corpus" --minutes "$drafter_minutes" \
  --out "$OUT/tiny-code" 2>&1 | grep -v Warning | tee -a "$OUT/train.log"
cp /tmp/tiny-code-target/train_target.json "$OUT/tiny-code/"
rm -f "$OUT/tiny-code/tokenizer.json"  # it is in the repo already; keeps the files under the return limit
ls -la "$OUT/tiny-code" | tee -a "$OUT/train.log"
