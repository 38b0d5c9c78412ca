#!/usr/bin/env bash
# On the GPU machine: the named parts, each under its own time limit, logs and JSON under $OUT, so a
# part that runs long still leaves the others' results. Environment: CORPUS (build/corpus_device),
# TARGET_MINUTES (3.2), DRAFTER_MINUTES (1.8), MODEL (the model `eval` measures; default: the embedded one
# or, after `train`/`drafter`, the one they wrote).
#   bash scripts/device_bench.sh train            (target + drafter from scratch -> $OUT/tiny-code)
#   bash scripts/device_bench.sh corpus-large target   (the shipped target trained further on the larger
#       corpus: carry build/corpus_large/train.jsonl.xz, build/corpus_device; TARGET_ARGS="--init jdspark/assets/tiny-code")
#   bash scripts/device_bench.sh drafter eval     (train the embedded drafter further, then measure it)
#   bash scripts/device_bench.sh sampler adaptive serve      (serve: carry .whl, see the part)
#   bash scripts/device_bench.sh step             (D, V(k), step wall vs device busy time, kernel counts)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jdspark-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JDSPARK_CACHE=$OUT/cache
CORPUS=${CORPUS:-build/corpus_device}; MODEL=${MODEL:-}
python3 -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())"  # stdout only: $OUT holds 8 files
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case $part in
    train)
      python3 scripts/train_target.py --corpus "$CORPUS" --minutes "${TARGET_MINUTES:-3.2}" --out /tmp/target 2>&1 \
        | grep -v Warning | tee "$OUT/train.log"
      python3 scripts/train_drafter.py --target /tmp/target --corpus "$CORPUS" --minutes "${DRAFTER_MINUTES:-1.8}" \
        --out "$OUT/tiny-code" 2>&1 | grep -v Warning | tee -a "$OUT/train.log"
      cp /tmp/target/train_target.json "$OUT/tiny-code/"; MODEL=$OUT/tiny-code ;;
    corpus-large)  # the stdlib plus site-packages text (scripts/build_corpus.py --extra-root), tokenized here
      mkdir -p /tmp/corpus_large && xz -dc build/corpus_large/train.jsonl.xz > /tmp/corpus_large/train.jsonl \
        && cp "$CORPUS/heldout.jsonl" /tmp/corpus_large/ \
        && python3 scripts/train_tokenizer.py --corpus /tmp/corpus_large --existing jdspark/assets/tiny-code/tokenizer.json \
        && CORPUS=/tmp/corpus_large ;;
    target)
      python3 scripts/train_target.py --corpus "$CORPUS" --minutes "${TARGET_MINUTES:-3.2}" ${TARGET_ARGS:-} --out "$OUT/tiny-code" \
        2>&1 | grep -v Warning | tee "$OUT/target.log"
      MODEL=$OUT/tiny-code ;;
    drafter)
      python3 scripts/train_drafter.py --target jdspark/assets/tiny-code --corpus "$CORPUS" \
        --minutes "${DRAFTER_MINUTES:-4.5}" ${DRAFTER_ARGS:-} --out "$OUT/tiny-code" 2>&1 | grep -v Warning | tee "$OUT/drafter.log"
      rm -f "$OUT/tiny-code/tokenizer.json"; MODEL=$OUT/tiny-code ;;  # in the repo already: $OUT holds 8 files
    eval)
      [ -n "$MODEL" ] && cp jdspark/assets/tiny-code/tokenizer.json "$MODEL/"
      timeout 330 python3 scripts/eval_acceptance.py ${MODEL:+--model "$MODEL"} --corpus "$CORPUS" ${EVAL_ARGS:-} \
        --json "$OUT/eval_acceptance.json" 2>&1 | grep -v Warning | tee "$OUT/eval.log"
      [ -n "$MODEL" ] && rm -f "$MODEL/tokenizer.json" ;;  # in the repo already; keeps $OUT under its file limit
    sampler-tests)
      timeout 170 python3 -m pytest -q -W ignore -p no:cacheprovider tests/pallas_kernels 2>&1 | tail -5 | tee "$OUT/sampler_gpu_tests.log" ;;
    sampler)
      timeout 280 python3 scripts/bench_rejection_sampler.py --profile 2>&1 | grep -v Warning | tee "$OUT/bench_sampler.log" ;;
    load)
      timeout 150 python3 scripts/bench_load.py --preset flash --layers 2 --experts 32 --json "$OUT/bench_load.json" 2>&1 \
        | grep -v -E "Warning|it/s|B/s" | tee "$OUT/bench_load.log" ;;
    adaptive)
      timeout 400 python3 scripts/bench_adaptive.py --tokens 128 --repeats 7 2>&1 | grep -v Warning | tee "$OUT/bench_adaptive.log" ;;
    serve)  # FastAPI / uvicorn are not on the GPU image: wheels carried in .whl (see the device README)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
      PYTHONPATH=$PWD:/tmp/site timeout 170 python3 scripts/bench_serve.py --requests 16 --max-tokens 64 --max-seconds 25 \
        --out "$OUT/bench_serve.json" 2>&1 | grep -v Warning | tee "$OUT/bench_serve.log" ;;
    step)
      timeout 300 python3 scripts/bench_step.py --variants ${STEP_VARIANTS:-kernel} 2>&1 \
        | grep -v Warning | tee "$OUT/bench_step.log" ;;
    engine)
      timeout 420 python3 -m pytest -q -W ignore -p no:cacheprovider tests/engine/test_engine.py tests/engine/test_lossless.py \
        -k "greedy or lossless" 2>&1 | tail -5 | tee "$OUT/engine_gpu_tests.log" ;;
  esac
done
rm -rf "$OUT/cache"
