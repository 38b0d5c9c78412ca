"""Where a decode step's time goes: D, V(k) and the kernels per executable, for the embedded model.

The tiny model's steps are launch-bound, so the number of kernels (and of device loops, which
cost a host round trip per iteration unless their trip count is known) matters more than bytes.
This compares formulations of the mHC Sinkhorn projection inside the real executables:
`package` (what `jdspark.model.hyper.sinkhorn` does now: a device loop over the iterations) against
unrolled alternatives, each
compiled into a fresh engine. For each: D and V(0..gamma) (medians of synchronised calls), and the
counts of fusions / custom calls / while loops in the optimised HLO of the draft and verify[gamma]
executables. Prints a table, writes JSON. Compilation dominates: ~2 min per variant on the H200
for the package form; an unrolled form took much longer there, compile or run not known (2026-11-30:
the adaptive bench, built with the sliced form, did not finish one regime in 6 min), so give each
variant its own call.

    PYTHONPATH=$PWD python scripts/bench_step.py [--variants package loop] [--runs 21]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import load_model
from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine, SpecOptions
from jdspark.model import hyper

PACKAGE = hyper.sinkhorn


def sinkhorn_unrolled_sum(logits, iters, eps):
    """Unrolled in Python with jnp.sum reductions (one reduction per normalisation)."""
    p = jax.nn.softmax(logits, axis=-1) + eps
    p = p / (jnp.sum(p, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        p = p / (jnp.sum(p, axis=-1, keepdims=True) + eps)
        p = p / (jnp.sum(p, axis=-2, keepdims=True) + eps)
    return p


def sinkhorn_sliced(logits, iters, eps):
    """Unrolled, each sum over the C = 4 streams written as C - 1 adds of slices: only elementwise
    operations, which XLA can fuse into one kernel."""
    c = logits.shape[-1]

    def total(p, axis):
        parts = jnp.split(p, c, axis=axis)
        out = parts[0]
        for part in parts[1:]:
            out = out + part
        return out

    p = jax.nn.softmax(logits, axis=-1) + eps
    p = p / (total(p, -2) + eps)
    for _ in range(iters - 1):
        p = p / (total(p, -1) + eps)
        p = p / (total(p, -2) + eps)
    return p


VARIANTS = {"package": PACKAGE, "unrolled_sum": sinkhorn_unrolled_sum, "sliced": sinkhorn_sliced}


def kernel_counts(compiled) -> dict:
    text = compiled.as_text()
    return {"fusions": len(re.findall(r"= \S+ fusion\(", text)),
            "custom_calls": len(re.findall(r"custom-call\(", text)),
            "whiles": len(re.findall(r" while\(", text))}


def median_time(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, variant: str, runs: int, cache_dir: str) -> dict:
    hyper.sinkhorn = VARIANTS[variant]  # looked up when the executables are traced
    try:
        start = time.perf_counter()
        engine = Engine(model, EngineConfig(max_seq_len=512, gamma=5, max_batch=1), prefill_chunk=64,
                        options=SpecOptions(width=5, reprofile=True, cost_cache_dir=cache_dir, profile_runs=runs))
        compile_s = time.perf_counter() - start
    finally:
        hyper.sinkhorn = PACKAGE
    verify = engine._verify_costs()
    anchor = np.zeros(1, np.int32)
    sampling = engine._sampling()
    draft = median_time(lambda: jax.block_until_ready(
        engine.exe.draft(model.params, engine.draft, anchor, sampling).tokens), runs)
    return {"variant": variant, "compile_s": compile_s, "draft_ms": draft * 1e3,
            "verify_ms": [v * 1e3 for v in verify],
            "draft_kernels": kernel_counts(engine.exe.draft), "verify5_kernels": kernel_counts(engine.exe.verify[5])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    model = load_model(default_model_dir(), dtype=args.dtype, progress=False)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as cache_dir:
        for variant in args.variants:
            result["rows"].append(measure(model, variant, args.runs, cache_dir))
            print(result["rows"][-1], flush=True)
    print(f"{'variant':>13} {'D ms':>6} {'V(0..5) ms':>40} {'draft fus/cc/while':>19} {'verify5 fus/cc/while':>21}")
    for r in result["rows"]:
        d, v = r["draft_kernels"], r["verify5_kernels"]
        print(f"{r['variant']:>13} {r['draft_ms']:6.2f} {' '.join(f'{x:5.2f}' for x in r['verify_ms']):>40} "
              f"{d['fusions']:>9}/{d['custom_calls']}/{d['whiles']:<5} {v['fusions']:>11}/{v['custom_calls']}/{v['whiles']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
