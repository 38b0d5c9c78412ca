#!/usr/bin/env bash
# On the GPU machine: the named parts (sampler, load, adaptive, engine), each under its own time
# limit, logs and JSON under $OUT, so a part that runs long still leaves the others' results.
#   bash scripts/device_bench.sh sampler load      |      bash scripts/device_bench.sh adaptive engine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jdspark-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD JDSPARK_CACHE=$OUT/cache
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/versions.txt"
for part in "$@"; do
  echo "=== $part ($(date +%T))"
  case $part in
    sampler)
      timeout 170 python3 -m pytest -q -W ignore -p no:cacheprovider tests/pallas_kernels 2>&1 | tail -5 | tee "$OUT/sampler_gpu_tests.log"
      timeout 220 python3 scripts/bench_rejection_sampler.py 2>&1 | grep -v Warning | tee "$OUT/bench_sampler.log" ;;
    load)
      timeout 150 python3 scripts/bench_load.py --preset flash --layers 2 --experts 32 --json "$OUT/bench_load.json" 2>&1 \
        | grep -v -E "Warning|it/s|B/s" | tee "$OUT/bench_load.log" ;;
    adaptive)
      timeout 300 python3 scripts/bench_adaptive.py --tokens 96 --repeats 5 2>&1 | grep -v Warning | tee "$OUT/bench_adaptive.log" ;;
    engine)
      timeout 230 python3 -m pytest -q -W ignore -p no:cacheprovider tests/engine/test_engine.py \
        -k "greedy or lossless" 2>&1 | tail -5 | tee "$OUT/engine_gpu_tests.log" ;;
  esac
done
rm -rf "$OUT/cache"
