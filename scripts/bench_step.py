"""Where a decode step's time goes: D, V(k) and the kernels per executable, for the embedded model.

The tiny model's steps are launch-bound, so the number of kernels (and of device loops: at least
one launch per iteration) matters more than bytes. This compares the two forms of the mHC Sinkhorn
projection inside the real executables: `kernel` (the Pallas kernel `jdspark.model.hyper.sinkhorn`
uses on the GPU, one launch per mHC site) and `loop` (the jnp reference, a device loop of 19
iterations per site), each compiled into a fresh engine with widths 0 and gamma. For each: D and
V(0), V(gamma) (medians of synchronised calls) and the counts of fusions / custom calls / while
loops in the optimised HLO of the draft and verify[gamma] executables. Prints a table, writes JSON.

    PYTHONPATH=$PWD python scripts/bench_step.py [--variants kernel loop] [--runs 21]
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
import numpy as np

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import load_model
from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine, SpecOptions
from jdspark.model import hyper
from pallas_kernels import sinkhorn as pallas_sinkhorn

PACKAGE = hyper.sinkhorn
VARIANTS = {"kernel": pallas_sinkhorn.sinkhorn, "loop": pallas_sinkhorn.ref_sinkhorn}


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
        engine = Engine(model, EngineConfig(max_seq_len=512, gamma=5, max_batch=1), prefill_chunk=64, widths=(0, 5),
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
    print(f"{'variant':>13} {'D ms':>6} {'V(0), V(5) ms':>14} {'draft fus/cc/while':>19} {'verify5 fus/cc/while':>21}")
    for r in result["rows"]:
        d, v = r["draft_kernels"], r["verify5_kernels"]
        print(f"{r['variant']:>13} {r['draft_ms']:6.2f} {' '.join(f'{x:5.2f}' for x in r['verify_ms']):>14} "
              f"{d['fusions']:>9}/{d['custom_calls']}/{d['whiles']:<5} {v['fusions']:>11}/{v['custom_calls']}/{v['whiles']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
