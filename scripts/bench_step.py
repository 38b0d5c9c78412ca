"""Where a decode step's time goes: D, V(k) and the kernels per executable, for the embedded model.

The tiny model's steps are launch-bound, so the number of kernels (and of device loops: at least
one launch per iteration) matters more than bytes. This compares the two forms of the mHC Sinkhorn
projection inside the real executables: `kernel` (the Pallas kernel `jdspark.model.hyper.sinkhorn`
uses on the GPU, one launch per mHC site) and `loop` (the jnp reference, a device loop of 19
iterations per site), each compiled into a fresh engine with widths 0 and gamma. For each: D and
V(0), V(gamma) (medians of synchronised calls), the wall time of a whole Engine.step() at width gamma
with the host functions that fill it (cProfile), and the counts of fusions / custom calls / while
loops in the optimised HLO of the draft and verify[gamma] executables. Prints a table, writes JSON.

    PYTHONPATH=$PWD python scripts/bench_step.py [--variants kernel loop] [--runs 21]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
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
from jdspark.engine.request import SamplingParams
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


def engine_steps(engine: Engine, steps: int) -> dict:
    """Wall time of Engine.step() at width 5 on one T = 1 request (median), and the host functions
    that take the time (cProfile, top 25 by own time, printed)."""
    engine.add(list(range(4, 68)), SamplingParams(max_tokens=400, temperature=1.0, seed=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    profiler, times = cProfile.Profile(), []
    for _ in range(steps):
        if not engine.active:
            break
        start = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        times.append(time.perf_counter() - start)
    engine.release(0)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue(), flush=True)
    return {"step_ms": statistics.median(times) * 1e3, "steps": len(times)}


def measure(model, variant: str, runs: int, cache_dir: str, steps: int) -> dict:
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
        engine.exe.draft(engine.exe.params.arrays, engine.draft, anchor, sampling).tokens), runs)
    return {"variant": variant, "compile_s": compile_s, "draft_ms": draft * 1e3,
            "verify_ms": [v * 1e3 for v in verify], **engine_steps(engine, steps),
            "draft_kernels": kernel_counts(engine.exe.draft), "verify5_kernels": kernel_counts(engine.exe.verify[5])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--steps", type=int, default=50, help="Engine.step() calls timed and profiled")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    model = load_model(default_model_dir(), dtype=args.dtype, progress=False)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as cache_dir:
        for variant in args.variants:
            result["rows"].append(measure(model, variant, args.runs, cache_dir, args.steps))
            print(result["rows"][-1], flush=True)
    print(f"{'variant':>13} {'D ms':>6} {'V(0), V(5) ms':>14} {'step ms':>8} {'draft fus/cc/while':>19} {'verify5 fus/cc/while':>21}")
    for r in result["rows"]:
        d, v = r["draft_kernels"], r["verify5_kernels"]
        print(f"{r['variant']:>13} {r['draft_ms']:6.2f} {' '.join(f'{x:5.2f}' for x in r['verify_ms']):>14} {r['step_ms']:8.2f} "
              f"{d['fusions']:>9}/{d['custom_calls']}/{d['whiles']:<5} {v['fusions']:>11}/{v['custom_calls']}/{v['whiles']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
