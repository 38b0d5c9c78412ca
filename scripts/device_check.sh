#!/usr/bin/env bash
# On a GPU machine: the versions of the main packages, then the whole test suite (the GPU-only tests run
# there; transformers/torch, where installed, stand in for the pinned ones). Results land under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jdspark-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 - <<'PY' | tee "$OUT/versions.txt"
import jax, flax, numpy, sys
print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, "numpy", numpy.__version__)
print("devices", jax.devices())
try:
    import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)
except ImportError as e:
    print("no torch/transformers:", e)
PY
python3 -m pytest -q -W ignore -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log"
