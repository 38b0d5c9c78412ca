"""DeepSeek-V4-Flash-0731 at full size on one GPU and its host, served by the engine (issue 24).

A synthetic Flash with the 0731 layout: 43 main layers, 256 routed experts, FP8 linears + ds_fp4
experts, and a DSpark drafter of 3 stages (each a window-only block with its own 256 ds_fp4 experts;
target layers 40-42; Markov rank 256): 167 GB of weights against the ~139 GiB of one H200. Random
weights are made in memory, no disk: the GPU part drawn on the device, the host experts as random
host banks (`jdspark.experts.banks.random_bank`). `--gpu-memory` GB of weights stay on the GPU; the
placement (`jdspark.experts.hybrid.plan_for`, uniform routing) moves the rest of the main layers'
experts to host banks, grouped into few layers; the drafter and every non-expert weight stay on the
GPU. The engine (batch 1, widths `--widths`) is then built on it, and the run reports:

- the placement report; seconds to make the weights, and the engine's start-up (lowering, compiling);
- the engine's own synchronised call costs: decode, and step[k] = D + V(k), so D = step[0] - decode
  and V(k) = step[k] - D (`Engine.measure_call_costs`, empty state);
- target-only tok/s at batch 1: Engine.step() overlapped and one call at a time, a T = 1 request
  after a 64-token prompt (median wall of `--steps` steps);
- the wall of an overlapped Engine.step() per width: target-only, and speculative at each width k
  (random weights accept ~nothing: their tokens per step are not the point, their cost is);
- the host part of a target-only step: the host calls' own time (plan + CPU GEMV) and the
  distinct host experts they read, against those bytes at the host read bandwidth measured in the
  same run (the issue's <= 1.3x);
- projected DSpark tok/s = max over k of E(k) / S(k) with E(k) = sum_{i<=k} a^i, for per-position
  acceptance a = 0.85, 0.80 (the reference's code profile) and 0.59 (prose); S(k) the overlapped
  step wall of width k (and, beside it, the synchronised call cost); k = 0 is a target-only step;
- `--trace`: the GPU's busy time per target-only step, its idle gaps and the host's events;
- `--acceptance a`: drafts accepted by script at a per position, confidences a
  (`EngineConfig.scripted_acceptance`, benchmarks only), the engine's adaptive widths over its measured
  costs (every width of `--widths` profiled at start-up), and the DSpark tok/s of a served T = 1
  request (tokens over the wall of `--steps` overlapped steps) beside the projection at that a.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 PYTHONPATH=$PWD python scripts/bench_flash.py --json /tmp/flash.json
    PYTHONPATH=$PWD python scripts/bench_flash.py --preset tiny --layers 4 --gpu-memory 0.008 --steps 3  # CPU smoke
    PYTHONPATH=$PWD python scripts/bench_flash.py --acceptance 0.8 --json /tmp/flash_dspark.json  # DSpark served at 0.8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import PRESETS, STORAGES, nbytes, random_params  # noqa: E402
from bench_load import mappings  # noqa: E402
from bench_step import start_request, step_times  # noqa: E402

from jdspark.config import EngineConfig, QuantConfig  # noqa: E402
from jdspark.engine.engine import Engine, SpecOptions  # noqa: E402
from jdspark.engine.executables import enable_compile_cache  # noqa: E402
from jdspark.experts import cpu_gemv, host_probes, mapped  # noqa: E402
from jdspark.experts.banks import random_bank  # noqa: E402
from jdspark.experts.hybrid import HybridExperts, is_main_expert, plan_for, with_host_experts  # noqa: E402
from jdspark.model.model import Model  # noqa: E402
from jdspark.model.quantized import abstract_model  # noqa: E402
from jdspark.profile import busy_us, gap_lines, gpu_kernel_events, host_summary, idle_gaps  # noqa: E402

ACCEPTANCE = {"code 0.85": 0.85, "code 0.80": 0.80, "prose 0.59": 0.59}
DRAFT_STAGES = 3


def flash_0731_config(preset: str, layers: int | None, experts: int | None):
    """The 0731 layout at `preset`'s sizes: main layers, then 3 DSpark stages reading the last three."""
    base = PRESETS[preset]()
    n = min(layers or base.num_hidden_layers, base.num_hidden_layers)
    over = dict(num_hidden_layers=n, num_nextn_predict_layers=DRAFT_STAGES,
                num_hash_layers=min(base.num_hash_layers, n),
                compress_ratios=tuple(base.compress_ratios[:n]) + (0,) * DRAFT_STAGES,
                expert_dtype="fp4", quantization=QuantConfig(),
                extra=dict(dspark_block_size=5, dspark_noise_token_id=min(128799, base.vocab_size - 1),
                           dspark_target_layer_ids=[n - 3, n - 2, n - 1], dspark_markov_rank=256))
    if experts:
        over.update(n_routed_experts=experts, num_experts_per_tok=min(base.num_experts_per_tok, experts))
    return PRESETS[preset](**over)


def build(config, dtype, gpu_memory: float, seed: int = 0, via: str = "ffi", threads: int | None = None,
          pcie_share: float | None = None):
    """(model with host experts, placement report, seconds to make it). The experts of layers wholly on
    the host are never drawn on the device: random host banks take their place."""
    storage = STORAGES["fp8+fp4"]
    _, abstract = abstract_model(config, dtype, storage)
    leaves = {tuple(k.key for k in kp): leaf
              for kp, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))[0]}
    placement, report = plan_for(leaves, gpu_memory, top_k=config.num_experts_per_tok)
    host = placement.host_map()
    whole = {layer for layer, ids in host.items() if len(ids) == config.n_routed_experts}
    start = time.perf_counter()
    graphdef, params = random_params(config, dtype, storage, seed,
                                     skip=lambda path: is_main_expert(path) and path[1] in whole)
    banks = {layer: random_bank("fp4", config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                                seed=seed + layer) for layer in sorted(whole)}
    model = with_host_experts(Model(graphdef, params), host, banks=banks, via=via, threads=threads,
                              pcie_share=pcie_share)
    del params, banks
    gc.collect()
    jax.block_until_ready(model.params)
    return model, report, time.perf_counter() - start


def gpu_budget(config, dtype, args) -> float:
    """Bytes of weights on the GPU: `--gpu-memory` GB, or with `--host-layers N` all but N layers'
    routed experts (a smaller model then has host experts too)."""
    if args.host_layers is None:
        return args.gpu_memory * 1e9
    _, abstract = abstract_model(config, dtype, STORAGES["fp8+fp4"])
    sizes = [(tuple(k.key for k in kp), nbytes(x))
             for kp, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))[0]]
    layer_experts = sum(b for path, b in sizes if is_main_expert(path) and path[1] == 0)
    return sum(b for _, b in sizes) - args.host_layers * layer_experts


def device_bytes(model: Model) -> int:
    """Bytes of the model's parameters in device memory (views of host banks left out)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(model.params))[0]
    return sum(nbytes(x) for kp, x in leaves if not mapped.is_mapped(tuple(k.key for k in kp)))


def hybrid_layers(model: Model) -> list[HybridExperts]:
    """The hybrid MoE layers of `model` (each counts its host calls, seconds and experts read)."""
    return [node for _, node in nnx.iter_graph(model.module()) if isinstance(node, HybridExperts)]


def host_part(engine: Engine, layers, steps: int, read_GBps: float, read_bytes: int, threads: int) -> dict:
    """Target-only Engine.step() (overlapped, median ms) and its host part: the CPU calls' own
    seconds and distinct host experts per call, one call per hybrid layer a step. With a PCIe share q
    the GPU reads round(q n) of a call's n distinct host experts at the same time, so the step's host
    bytes are about the CPU's / (1 - q), all read while the CPU computes (`host_GBps`). The floor is
    taken twice: at the run's host read (`read_GBps`, measured before the weights were made) and at
    the mean of reads right before and after these steps (`host_vs_read_beside`): the host's speed
    varied ~1.5x within a session, and a floor measured minutes apart mixes that in."""
    def reset():
        for layer in layers:
            layer.host_stats(reset=True)

    before = host_probes.host_read(read_bytes, threads, 3)["GBps"]
    ticks = host_probes.cpu_ticks()
    out = {"wall_ms": step_times(engine, False, steps, on_start=reset), "host_layers": len(layers), "host_ms": 0.0}
    out |= host_probes.interference(ticks, host_probes.cpu_ticks())  # the machine's other guests and processes
    counts = [layer.host_stats() for layer in layers]
    calls = sum(c["calls"] for c in counts)
    if calls:
        per_call = sum(c["seconds"] for c in counts) / calls
        host_bytes = sum(c["experts"] for c in counts) / calls * layers[0].bank.weight_nbytes * len(layers)
        share = layers[0].pcie_share
        total = host_bytes / (1.0 - share) if share < 1 else float("nan")
        out |= {"host_ms": per_call * 1e3 * len(layers), "cpu_MB": host_bytes / 1e6, "host_MB": total / 1e6,
                "pcie_share": share, "host_floor_ms": total / (read_GBps * 1e9) * 1e3}
        out["host_GBps"] = total / (out["host_ms"] * 1e6)
        out["host_vs_read"] = out["host_ms"] / out["host_floor_ms"]
    out["read_beside_GBps"] = (before + host_probes.host_read(read_bytes, threads, 3)["GBps"]) / 2
    if calls:
        out["host_vs_read_beside"] = out["host_vs_read"] * out["read_beside_GBps"] / read_GBps
    return out


def huge_page_share(layers) -> float | None:
    """Share of the host banks' bytes backed by transparent huge pages (the huge bytes of the
    mappings they lie in, pro rata): a GEMV streaming 4 KiB pages pays TLB misses, and the kernel may
    back a bank with huge pages only later (khugepaged). None off Linux."""
    spans = [(b.data.ctypes.data, b.data.ctypes.data + b.data.nbytes) for b in (layer.bank for layer in layers)]
    found = mappings()
    if not spans or not found:
        return None
    huge = sum(m["huge"] * max(0, min(hi, m["end"]) - max(lo, m["start"])) / (m["end"] - m["start"])
               for m in found for lo, hi in spans)
    return huge / sum(hi - lo for lo, hi in spans)


def host_speed() -> dict:
    """The host's state beside a host-bound figure: mean core clock (MHz, /proc/cpuinfo) and load
    average (the machine's speed varied ~1.5x within one session). Empty off Linux."""
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        return {"cpu_MHz": sum(mhz) / len(mhz), "loadavg_1min": os.getloadavg()[0]}
    except (OSError, ValueError, ZeroDivisionError):
        return {}


def step_walls(engine: Engine, widths, steps: int) -> dict:
    """Median wall ms of an overlapped Engine.step() per width k (k = 0: a target-only decode step;
    else a speculative step verifying k drafts): what a served request's steps cost, where the
    synchronised costs of `measure_call_costs` also wait for every call's host part alone."""
    walls = {"decode": step_times(engine, False, steps)}
    for k in widths:
        engine.set_policy(width_policy=lambda confidence, k=k: k)
        walls[f"step{k}"] = step_times(engine, True, steps)
    return walls


def served(engine: Engine, steps: int) -> dict:
    """A T = 1 request served by the adaptive engine (its selector over the measured costs) for
    `steps` overlapped steps: tokens per second of wall, tokens per step and the widths it verified."""
    engine.set_policy(width_policy=engine.selector)
    rid = start_request(engine, True)
    tokens, widths = 0, {}
    start = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(delta.tokens) for delta in engine.step().values())
        record = engine.last_step
        if record is not None:
            key = record.width if record.drafted_call else "decode"
            widths[key] = widths.get(key, 0) + 1
    wall = time.perf_counter() - start
    engine.cancel(rid)
    return {"tok_s": tokens / wall, "tokens_per_step": tokens / steps, "widths": widths, "steps": steps}


def trace(engine: Engine, steps: int) -> dict:
    """A jax.profiler trace of `steps` target-only Engine.step() calls: the GPU's busy ms per step,
    where it idles, and the host's C++ events by total time (XLA's thunks, command buffers, the
    host experts' custom calls; Python's frames are not traced, so the steps keep their pace)."""
    rid = start_request(engine, False)
    host: list[dict] = []
    wall = {}

    def run():
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        jax.block_until_ready(engine.state)
        wall["s"] = time.perf_counter() - start

    events = gpu_kernel_events(run, host, python=False)
    engine.cancel(rid)
    gaps = idle_gaps(events)
    busy = busy_us([(k["ts"], k["dur"], k["name"]) for k in events]) / steps / 1e3
    print(f"traced target-only: wall {wall['s'] / steps * 1e3:.2f} ms/step, GPU busy {busy:.2f} ms/step, "
          f"{len(events) / steps:.0f} kernels/step")
    for line in gap_lines(gaps):
        print(f"  {line}")
    top = host_summary(host, 40)
    for e in top:
        print(f"  host {e['us'] / steps / 1e3:8.3f} ms/step x {e['count'] / steps:5.1f}  {e['name']}")
    return {"wall_ms": wall["s"] / steps * 1e3, "busy_ms": busy, "gaps": gaps, "host": top}


def projected(costs: dict, widths) -> dict:
    """Projected DSpark tok/s per acceptance profile: max over k of E(k) / S(k), with S(k) the step's
    cost in seconds (k = 0: "decode", a target-only step; else "step{k}")."""
    out = {}
    for name, a in ACCEPTANCE.items():
        options = {0: 1.0 / costs["decode"]}
        options |= {k: sum(a ** i for i in range(k + 1)) / costs[f"step{k}"] for k in widths if k > 0}
        best = max(options, key=options.get)
        out[name] = {"tok_s": options[best], "k": best}
    return out


def measure(args) -> dict:
    dtype = jnp.dtype(args.dtype)
    config = flash_0731_config(args.preset, args.layers, args.experts)
    threads = args.threads or cpu_gemv.default_threads()
    read = host_probes.host_read(args.read_mb << 20, threads, 5)
    print(f"host read {read['GBps']:.1f} GB/s ({threads} threads)", flush=True)
    budget = gpu_budget(config, dtype, args)
    model, report, build_s = build(config, dtype, budget, args.seed, args.via, threads, args.pcie_share)
    print(f"{report}\nweights made in {build_s:.1f} s", flush=True)
    layers = hybrid_layers(model)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:
        adaptive = args.acceptance is not None  # else every width fixed in turn: no start-up profile
        engine = Engine(model, EngineConfig(max_seq_len=args.max_seq_len, gamma=5, max_batch=1,
                                            scripted_acceptance=args.acceptance),
                        prefill_chunk=64, widths=tuple(args.widths),
                        options=SpecOptions(width=None if adaptive else max(args.widths), profile_runs=args.runs,
                                            reprofile=True, cost_cache_dir=cache_dir, profile="synchronised"))
        startup_s = time.perf_counter() - start
        print(f"engine start-up {startup_s:.1f} s ({engine.exe.lower_seconds:.1f} s loading, tracing and lowering, "
              f"{engine.exe.count} executables)", flush=True)
        costs = engine.measure_call_costs()
    draft = costs["step0"] - costs["decode"]
    out = {"config": dict(preset=args.preset, layers=config.num_hidden_layers, experts=config.n_routed_experts,
                          draft_stages=DRAFT_STAGES, gpu_memory_GB=budget / 1e9, host_layers=args.host_layers,
                          widths=list(args.widths), acceptance=args.acceptance, via=args.via,
                          pcie_share=layers[0].pcie_share if layers else 0.0,
                          device=str(jax.devices()[0].device_kind), jax=jax.__version__, threads=threads),
           "placement": report, "host_read_GBps": read["GBps"], "build_s": build_s, "startup_s": startup_s,
           "lower_s": engine.exe.lower_seconds, "costs_ms": {k: v * 1e3 for k, v in costs.items()},
           "D_ms": draft * 1e3, "V_ms": {k: (costs[f"step{k}"] - draft) * 1e3 for k in args.widths},
           "device_weights_GB": device_bytes(model) / 1e9}
    print(f"costs (ms): {out['costs_ms']}; D {out['D_ms']:.2f}; V {out['V_ms']}", flush=True)
    out["banks_huge_page_share"] = huge_page_share(layers)
    out["target_only"] = host_part(engine, layers, args.steps, read["GBps"], read["bytes"], threads) | host_speed()
    out["target_only"]["sync_ms"] = step_times(engine, False, args.steps, overlap=False)
    out["target_only"]["tok_s"] = 1e3 / out["target_only"]["wall_ms"]
    if args.acceptance is not None:
        out["served"] = served(engine, args.steps)
        print(f"served DSpark at scripted acceptance {args.acceptance}: {out['served']['tok_s']:.1f} tok/s "
              f"({out['served']['tokens_per_step']:.2f} tokens a step, widths {out['served']['widths']})", flush=True)
    walls = step_walls(engine, args.widths, args.steps)
    out["step_wall_ms"] = walls
    print(f"overlapped Engine.step walls (ms): {walls}", flush=True)
    out["projected"] = projected(costs, args.widths)
    out["projected_from_walls"] = projected({k: v / 1e3 for k, v in walls.items()}, args.widths)
    out["trace"] = trace(engine, min(args.steps, 10)) if args.trace and jax.default_backend() == "gpu" else None
    if layers:  # the host part again, minutes later: does it drift (huge pages, the host's other load)?
        out["banks_huge_page_share_last"] = huge_page_share(layers)
        out["target_only_last"] = host_part(engine, layers, args.steps, read["GBps"], read["bytes"], threads) | host_speed()
    return out


def print_table(res: dict) -> None:
    t = res["target_only"]
    print(f"\n{res['placement']}\nweights {res['build_s']:.1f} s, engine start-up {res['startup_s']:.1f} s "
          f"(lowering {res['lower_s']:.1f} s); device weights {res['device_weights_GB']:.2f} GB")
    print("call      ms  (synchronised, empty state)")
    for name, ms in res["costs_ms"].items():
        print(f"{name:>7} {ms:7.2f}")
    print(f"D {res['D_ms']:.2f} ms; V(k): " + ", ".join(f"{k}: {v:.2f}" for k, v in res["V_ms"].items()))
    print(f"target-only Engine.step: {t['wall_ms']:.2f} ms overlapped ({t['tok_s']:.1f} tok/s), "
          f"{t['sync_ms']:.2f} ms one call at a time")
    if t["host_layers"]:
        print(f"host part: {t['host_layers']} host layers/step, CPU {t['host_ms']:.2f} ms for {t['cpu_MB']:.0f} MB; "
              f"with the GPU's PCIe share ({t['pcie_share']:.2f}) ~{t['host_MB']:.0f} MB read while the CPU "
              f"computes ({t['host_GBps']:.1f} GB/s); floor {t['host_floor_ms']:.2f} ms at "
              f"{res['host_read_GBps']:.1f} GB/s: {t['host_vs_read']:.2f}x; at the host read beside it "
              f"({t['read_beside_GBps']:.1f} GB/s): {t['host_vs_read_beside']:.2f}x")
        last, huge = res["target_only_last"], (res["banks_huge_page_share"], res["banks_huge_page_share_last"])
        print(f"host part at the end: CPU {last['host_ms']:.2f} ms, {last['host_vs_read']:.2f}x; beside it "
              f"{last['read_beside_GBps']:.1f} GB/s, {last['host_vs_read_beside']:.2f}x; banks in huge "
              f"pages {'n/a' if huge[0] is None else f'{huge[0]:.0%} first, {huge[1]:.0%} at the end'}")
        if "cpu_MHz" in t and "cpu_MHz" in last:
            print(f"host cores: {t['cpu_MHz']:.0f} MHz, load {t['loadavg_1min']:.1f} first; "
                  f"{last['cpu_MHz']:.0f} MHz, load {last['loadavg_1min']:.1f} at the end")
        if t.get("steal") is not None and last.get("steal") is not None:
            print(f"CPU time taken meanwhile by other guests (steal) / other processes: {t['steal']:.1%} / "
                  f"{t['others']:.1%} first, {last['steal']:.1%} / {last['others']:.1%} at the end")
    walls = res["step_wall_ms"]
    print("overlapped Engine.step (ms): decode " + f"{walls['decode']:.2f}, "
          + ", ".join(f"k = {k[4:]}: {v:.2f}" for k, v in walls.items() if k != "decode"))
    if "served" in res:
        v = res["served"]
        print(f"served DSpark, scripted acceptance {res['config']['acceptance']}: {v['tok_s']:.1f} tok/s, "
              f"{v['tokens_per_step']:.2f} tokens a step, widths {v['widths']}")
    for name in res["projected"]:
        p, w = res["projected"][name], res["projected_from_walls"][name]
        print(f"projected DSpark, acceptance {name}: {w['tok_s']:.1f} tok/s at k = {w['k']} (overlapped steps); "
              f"{p['tok_s']:.1f} at k = {p['k']} (synchronised calls)")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="flash")
    ap.add_argument("--layers", type=int, default=None, help="main layers (default: the preset's, 43 for flash)")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory", type=float, default=136.0, help="GB of weights on the GPU")
    ap.add_argument("--host-layers", type=int, default=None,
                    help="instead of --gpu-memory: every weight on the GPU but this many layers' routed experts")
    ap.add_argument("--widths", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=5, help="synchronised calls per executable cost (fastest kept)")
    ap.add_argument("--read-mb", type=int, default=1024)
    ap.add_argument("--via", choices=["ffi", "callback"], default="ffi", help="how a step reaches the host GEMV")
    ap.add_argument("--pcie-share", type=float, default=None,
                    help="share of a call's host experts the GPU reads over PCIe (default: the engine's, 1/3 on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="host GEMV threads (default: the CPUs of this process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-cache", action="store_true",
                    help="keep the executables on disk ($JDSPARK_CACHE): a second run skips compiling")
    ap.add_argument("--trace", action="store_true", help="also trace target-only steps (GPU busy, gaps, host events)")
    ap.add_argument("--acceptance", type=float, default=None,
                    help="drafts accepted by script at this rate a position; the engine's adaptive widths serve")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if 0 not in args.widths:
        ap.error("--widths must include 0 (D = step[0] - decode)")
    if args.acceptance is not None and 5 not in args.widths:
        ap.error("--acceptance serves with adaptive widths, which need width 5 (gamma) compiled")
    if args.compile_cache:
        enable_compile_cache()
    res = measure(args)
    print_table(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
