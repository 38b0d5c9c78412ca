"""Where a decode step's time goes: D, V(k) and the kernels per executable, for the embedded model.

The tiny model's steps are launch-bound, so the number of kernels (and of device loops: at least
one launch per iteration) and of executable calls matters more than bytes. For each kernel
variant — `auto` (the engine's default, what `jdspark serve` runs: on the GPU the Pallas Sinkhorn
and race, the routed-expert and FP8 linear kernels only for weights of real size, so the embedded
model keeps their XLA forms), `kernel` (`implementation="pallas"`: every Pallas kernel wherever its
sizes allow, the embedded model's 67 small FP8 linears and its experts too) or `loop`
(`implementation="xla"`: the jnp references, a device loop of 19 iterations per Sinkhorn site) or
`single` (`auto` with each executable loaded once, not twice: `EngineConfig.twin_executables`) — a
fresh engine with widths 0 and gamma is compiled and measured:
- the synchronised cost of its `decode` and step[0], step[gamma] executables (medians), hence
  D = S(0) - decode and V(gamma) = S(gamma) - D as the engine's selector sees them;
- the wall time of a whole Engine.step() on a T = 1 request at width gamma and target-only
  (median, no profiler), overlapped (the engine's default: a step issues its call before reading
  the previous one's) and one call at a time; then the host functions that fill a speculative
  step (cProfile);
- with a GPU, the device's busy time per Engine.step() from a jax.profiler trace (the union of
  the kernels' intervals on the GPU streams): busy much below the step's wall time means the
  host, not the device, sets the pace;
- the counts of fusions / custom calls / while loops in the optimised HLO of decode and step[gamma].
Prints a table, writes JSON.

    PYTHONPATH=$PWD python scripts/bench_step.py [--variants auto kernel loop] [--runs 21]
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

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import load_model
from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine, SpecOptions
from jdspark.profile import busy_us, gap_lines, gpu_kernel_events, host_summary, idle_gaps
from jdspark.engine.request import SamplingParams

# the engine's implementation setting, and whether it twins its executables (`EngineConfig.twin_executables`)
VARIANTS = {"auto": ("auto", True), "kernel": ("pallas", True), "loop": ("xla", True), "single": ("auto", False)}


def kernel_counts(compiled) -> dict:
    text = compiled.as_text()
    return {"fusions": len(re.findall(r"= \S+ fusion\(", text)),
            "custom_calls": len(re.findall(r"custom-call\(", text)),
            "whiles": len(re.findall(r" while\(", text))}


def start_request(engine: Engine, speculative: bool, overlap: bool = True) -> int:
    """A long T = 1 request, 3 steps in; its request id (cancel it when done)."""
    engine.set_policy(speculative=speculative, overlap=overlap)
    rid = engine.add(list(range(4, 68)), SamplingParams(max_tokens=400, temperature=1.0, seed=0,
                                                        ignore_eos=True)).request_id
    for _ in range(3):
        engine.step()
    return rid


def step_times(engine: Engine, speculative: bool, steps: int, overlap: bool = True, on_start=None) -> float:
    """Median wall ms of Engine.step() on one T = 1 request, no profiler attached; `on_start()` runs
    once the request is 3 steps in, before the timed steps."""
    rid = start_request(engine, speculative, overlap)
    if on_start is not None:
        on_start()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.cancel(rid)
    return statistics.median(times) * 1e3


def host_profile(engine: Engine, steps: int) -> None:
    """The host functions that fill a speculative Engine.step() (cProfile, top 25 by own time)."""
    rid = start_request(engine, True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    engine.cancel(rid)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue(), flush=True)


def device_busy(engine: Engine, speculative: bool, steps: int) -> dict | None:
    """Device busy ms per Engine.step() (union of kernel intervals on the GPU streams of a
    jax.profiler trace) and the steps' wall ms in the same traced run; None without a GPU."""
    if jax.default_backend() != "gpu":
        return None
    rid = start_request(engine, speculative)
    timing = {}

    def run_steps():
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        jax.block_until_ready(engine.state)  # the last step's call, issued and not yet read (overlap)
        timing["wall"] = time.perf_counter() - start

    host: list[dict] = []
    events = gpu_kernel_events(run_steps, host)
    engine.cancel(rid)
    updates = {e["name"]: e for e in host_summary(host, 80) if e["name"].startswith("command_buffer::")}
    print(f"  {'speculative' if speculative else 'target-only'} command buffers per step (us, count): "
          + ", ".join(f"{n} {e['us'] / steps:.0f} us x {e['count'] / steps:.1f}" for n, e in updates.items()))
    gaps = idle_gaps(events)
    for line in gap_lines(gaps):
        print(f"  {'speculative' if speculative else 'target-only'} {line}")
    kernels = [(k["ts"], k["dur"], k["name"]) for k in events]
    return {"busy_ms": busy_us(kernels) / steps / 1e3, "kernels_per_step": len(kernels) / steps,
            "wall_ms": timing["wall"] / steps * 1e3, "gaps": gaps, "command_buffers": updates}


def measure(model, variant: str, runs: int, steps: int, cache_dir: str) -> dict:
    start = time.perf_counter()
    implementation, twins = VARIANTS[variant]
    engine = Engine(model, EngineConfig(max_seq_len=512, gamma=5, max_batch=1, twin_executables=twins),
                    prefill_chunk=64, widths=(0, 5), implementation=implementation,
                    options=SpecOptions(width=5, profile_runs=runs, reprofile=True, cost_cache_dir=cache_dir,
                                        profile="synchronised"))
    compile_s = time.perf_counter() - start
    cost = engine.measure_call_costs()
    draft = cost["step0"] - cost["decode"]
    row = {"variant": variant, "compile_s": compile_s, "decode_ms": cost["decode"] * 1e3,
           "step_exe_ms": [cost["step0"] * 1e3, cost["step5"] * 1e3], "draft_ms": draft * 1e3,
           "verify5_ms": (cost["step5"] - draft) * 1e3,
           "engine_step_ms": step_times(engine, True, steps), "engine_decode_ms": step_times(engine, False, steps),
           "engine_step_sync_ms": step_times(engine, True, steps, overlap=False),
           "engine_decode_sync_ms": step_times(engine, False, steps, overlap=False),
           "decode_kernels": kernel_counts(engine.exe.decode), "step5_kernels": kernel_counts(engine.exe.step[5])}
    row["trace_step"] = device_busy(engine, True, steps)
    row["trace_decode"] = device_busy(engine, False, steps)
    host_profile(engine, steps)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["auto"], choices=list(VARIANTS))
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--steps", type=int, default=50, help="Engine.step() calls per timing, profile and trace")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    model = load_model(default_model_dir(), dtype=args.dtype, progress=False)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as cache_dir:
        for variant in args.variants:
            result["rows"].append(measure(model, variant, args.runs, args.steps, cache_dir))
            print(result["rows"][-1], flush=True)
    print(f"{'variant':>8} {'decode':>7} {'S(0)':>6} {'S(5)':>6} {'D':>6} {'V(5)':>6} {'step':>6} {'t-only':>6} "
          f"{'ratio':>6} {'sync step/t-only':>16} {'busy step/t-only':>16} {'decode fus/cc/while':>19} "
          f"{'step5 fus/cc/while':>19}   (ms)")
    for r in result["rows"]:
        d, v = r["decode_kernels"], r["step5_kernels"]
        traced = r["trace_step"] is not None
        busy = f"{r['trace_step']['busy_ms']:.2f}/{r['trace_decode']['busy_ms']:.2f}" if traced else "—"
        print(f"{r['variant']:>8} {r['decode_ms']:7.2f} {r['step_exe_ms'][0]:6.2f} {r['step_exe_ms'][1]:6.2f} "
              f"{r['draft_ms']:6.2f} {r['verify5_ms']:6.2f} {r['engine_step_ms']:6.2f} {r['engine_decode_ms']:6.2f} "
              f"{r['engine_step_ms'] / r['engine_decode_ms']:6.2f} "
              f"{r['engine_step_sync_ms']:>8.2f}/{r['engine_decode_sync_ms']:<7.2f} {busy:>16} "
              f"{d['fusions']:>9}/{d['custom_calls']}/{d['whiles']:<5} "
              f"{v['fusions']:>9}/{v['custom_calls']}/{v['whiles']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
