"""`jdspark profile`: one generation under `jax.profiler`, plus the selector's view of it.

Writes into the output directory: `trace/` (a jax.profiler trace for TensorBoard / Perfetto),
`profile.json` (V(k), D, every step's width, stale confidences and acceptances, the completion
stats) and `profile.png` (V(k) and D, E(k)/(D+V(k)) for the observed mean confidence profile, and
acceptance by draft position).

`gpu_kernels` / `gpu_kernel_events` / `busy_us` / `idle_gaps` / `host_summary` read a trace for the
benchmark scripts.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jdspark.engine.request import SamplingParams
from jdspark.generator import Generator


def profile(generator: Generator, prompt, params: SamplingParams, out_dir: str | Path) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    engine = generator.engine
    with engine.record_steps() as records, jax.profiler.trace(str(out / "trace")):
        completion = generator.generate(prompt, params)
    report = {"costs": engine.cost_summary(), "stats": completion.stats.as_dict(),
              "steps": [r.as_dict() for r in records], "text": completion.text, "token_ids": completion.token_ids}
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "profile.png")
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats, costs = report["stats"], report["costs"]
    fig, (ax_cost, ax_tput, ax_acc) = plt.subplots(1, 3, figsize=(15, 4))
    widths = np.arange(len(stats["widths"]))
    v, d = costs["verify_costs_s"], costs["draft_cost_s"]
    if v is not None:
        ax_cost.plot(widths, np.array(v) * 1e3, "o-", label="V(k) verify")
        if d is not None:
            ax_cost.axhline(d * 1e3, color="tab:orange", label="D draft")
            stale = [row["stale_confidence"] for step in report["steps"] for row in step["rows"]]
            c = np.mean(stale, axis=0) if stale else np.ones(len(widths) - 1)
            expected = 1 + np.concatenate([[0.0], np.cumsum(np.cumprod(c))])
            ax_tput.plot(widths, expected / (d + np.array(v)) / 1e3, "o-")
        ax_cost.legend()
    else:  # a fixed width or a caller's policy: the engine measured no costs
        ax_cost.text(0.5, 0.5, "no measured costs\n(the width policy is not adaptive)", ha="center", va="center",
                     transform=ax_cost.transAxes)
    ax_cost.set(xlabel="width k", ylabel="ms", title="measured costs")
    ax_tput.set(xlabel="width k", ylabel="E(k) / (D + V(k))  [tokens / ms]", title="selector objective (mean conf.)")
    ax_acc.bar(np.arange(1, len(stats["acceptance"]) + 1), stats["acceptance"], label="acceptance")
    ax_acc.bar(widths + 0.3, np.array(stats["widths"]) / max(1, sum(stats["widths"])), width=0.3,
               label="share of steps at width k")
    ax_acc.set(xlabel="draft position / width", title=f"tau = {stats['tau']:.2f}, {stats['tokens_per_s']:.1f} tok/s")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_kernels(fn: Callable[[], object]) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every kernel on the GPU streams while fn() runs under
    jax.profiler, sorted by start; empty without a GPU. fn must block until its work is done."""
    return [(k["ts"], k["dur"], k["name"]) for k in gpu_kernel_events(fn)]


def gpu_kernel_events(fn: Callable[[], object], host: list | None = None, python: bool = True) -> list[dict]:
    """`gpu_kernels` as trace events: ts, dur (us), name and args (e.g. the HLO op a kernel runs).
    host: a list that receives the host threads' events of the same trace (see `host_summary`);
    python=False leaves Python's frames out of the trace (the tracer slows a Python-heavy loop)."""
    options = jax.profiler.ProfileOptions()
    if not python:
        options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
            fn()
        path = next(Path(trace_dir).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e["args"].get("name", "")}
    if host is not None:
        host.extend({"ts": e["ts"], "dur": e["dur"], "name": e["name"]} for e in events
                    if e.get("ph") == "X" and e["pid"] not in gpu)
    return sorted(({"ts": e["ts"], "dur": e["dur"], "name": e["name"], "args": e.get("args", {})} for e in events
                   if e.get("ph") == "X" and e["pid"] in gpu
                   and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")), key=lambda k: k["ts"])


def host_summary(events: list[dict], top: int = 15) -> list[dict]:
    """The host events of a trace by total time (us) and count, longest first: what the host did while
    the GPU waited (a name's total includes the events nested in it)."""
    totals: dict[str, list] = {}
    for e in events:
        total = totals.setdefault(e["name"][:100], [0.0, 0])
        total[0] += e["dur"]
        total[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name, "us": round(us, 1), "count": n} for name, (us, n) in ranked]


GAP_BUCKETS_US = (2.0, 4.0, 10.0, 50.0)


def idle_gaps(kernels: list[dict], top: int = 8) -> dict:
    """Where the GPU idles between `gpu_kernel_events` kernels: the idle time in gap-size buckets
    (uniform few-us gaps are launch latency, inside a CUDA graph too; a few long ones are a sync, a
    host callback or a command buffer split), the longest gaps with the kernels around them, and the
    CUDA graphs the kernels ran in (kernels outside any graph were launched one by one)."""
    buckets = {f"<{b:g}": [0, 0.0] for b in GAP_BUCKETS_US} | {f">={GAP_BUCKETS_US[-1]:g}": [0, 0.0]}
    gaps, end, before = [], float("-inf"), None
    for k in kernels:  # sorted by start
        gap = k["ts"] - end
        if before is not None and gap > 0:
            label = next((f"<{b:g}" for b in GAP_BUCKETS_US if gap < b), f">={GAP_BUCKETS_US[-1]:g}")
            buckets[label][0] += 1
            buckets[label][1] += gap
            gaps.append((gap, _kernel_label(before), _kernel_label(k)))
        if k["ts"] + k["dur"] > end:
            end, before = k["ts"] + k["dur"], k
    graphs = {k["args"].get("cuda_graph_id") for k in kernels} - {None}
    return {"idle_us": {label: {"gaps": n, "us": round(us, 1)} for label, (n, us) in buckets.items()},
            "longest": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:top]],
            "cuda_graphs": len(graphs),
            "outside_graphs": sum("cuda_graph_id" not in k["args"] for k in kernels)}


def gap_lines(gaps: dict, longest: int = 5) -> list[str]:
    """`idle_gaps` as printable lines: the buckets and graphs, then the longest gaps."""
    return ([f"idle by gap size (us, count): {gaps['idle_us']}; CUDA graphs {gaps['cuda_graphs']}, "
             f"kernels outside them {gaps['outside_graphs']}"]
            + [f"  gap {g['us']:8.1f} us after {g['after']} before {g['before']}" for g in gaps["longest"][:longest]])


def _kernel_label(kernel: dict) -> str:
    op = str(kernel["args"].get("hlo_op", ""))
    return kernel["name"][:70] + ("" if not op or op.startswith("command_buffer") else f" [{op[:40]}]")


def busy_us(kernels: list[tuple[float, float, str]]) -> float:
    """Time at least one kernel was running: the union of the kernels' intervals, in us."""
    busy, end = 0.0, float("-inf")
    for start, duration, _ in kernels:  # sorted by start
        if start + duration > end:
            busy += start + duration - max(start, end)
            end = start + duration
    return busy
