"""Serving load on the engine itself (no HTTP: the GPU machine has no fastapi / uvicorn), the way
the server's engine thread drives it: `--concurrency` closed-loop clients, each request admitted
with `Engine.admit` (its prompt prefilled over the coming steps while the others decode) and a new
one admitted as soon as one finishes. For each speculation mode, on one compiled engine
(`Engine.set_policy`):

- none:        target-only decoding;
- fixed5:      every request at width 5;
- padded:      adaptive widths, the batch at the widest any request chose (the old engine), clipped
               where the step's pricing finds a narrower width better;
- per_request: adaptive widths, the step's width priced for the whole batch and verified by every
               speculating request (`engine/widths.py`), priced with costs of one call at a time
               (`SpecOptions.profile="synchronised"`); a new request's stale confidences start
               at the engine's recent average (`SpecOptions.first_confidence="recent"`);
- per_request_ones: the same with new requests at confidences of 1 (`first_confidence="ones"`);
- per_request_queued: per_request priced with costs of queued calls (`SpecOptions.profile="queued"`:
               the executables' rate when issued back to back, as overlapped steps run them), no
               prompt riding (the engine's default before `RIDE_PROMPTS`);
- per_request_queued_unpriced: the same with switching executables free (`SpecOptions.price_switches`
               off: the engine before the switch cost was learnt);
- per_request_queued_profiled: per_request_queued with widths priced by the profile's shape where the
               host sets the pace too (`LiveCosts.price_host_paced` off: the engine before it);
- per_request_queued_remembering: per_request_queued whose buckets never forget their verify and
               switched windows however long they only decode, nor their decode windows however long
               they only draft (`LiveCosts.FORGET_AFTER` unreached: the engine before it);
- budget:      Algorithm 1 over stale confidences with the bucket's measured costs;
- fixed3, alternate35 (diagnostics): every request at width 3, or at 3 and 5 on alternate steps (what
               switching executables between steps costs, against fixed3 and fixed5);
- none_eager, fixed5_eager, per_request_queued_eager: those modes with every pending prompt
               prefilled at the next step (`Engine.batch_prefills` off: the engine before
               `batch.prefill_waits` held prefill calls back to share them);
- none_riding, fixed5_riding, per_request_queued_riding: those modes with prompts of at most
               `--ride-prompts` tokens riding in the verify calls beside running requests instead
               of taking prefill calls of their own (`Engine.ride_prompts`; every other mode rides
               none). per_request_queued_riding at the default `--ride-prompts` is the engine's default;
- none_segment, fixed5_segment, per_request_queued_segment: those modes with the oldest pending prompt
               beside running requests in the verify call's prompt segment, `--prompt-segment` tokens a
               call (`Engine(prompt_segment=N)`; needs `--prompt-segment`; every other mode takes none).

`--max-tokens-spread f` draws each request's max_tokens from max_tokens x [1 - f, 1 + f] (seeded by the
request's index, the same in every mode): with one length for all, target-only requests admitted
together also end together and their successors share one prefill call, where a speculating batch's
requests end a step or two apart; served text's lengths differ.

Reports output tokens/s, p50 / p90 / p99 of time to first token and inter-token latency (gaps
between a request's token-bearing steps), and the verify steps that drafted, per (mode,
concurrency), and the engine's start-up.

The model is the embedded one, a checkpoint (`--model`), or with `--synthetic PRESET` a random
model of the 0731 layout (`bench_flash.flash_0731_config`: `--layers` main layers, FP8 linears +
ds_fp4 experts, a 3-stage DSpark drafter) made on the device, every weight on the GPU, prompts of
random ids, one per slot (rows of one prompt would route alike). Random drafts are never accepted,
so such a model needs `--acceptance a`: drafts accepted by script at a per position and confidences
of a (`EngineConfig.scripted_acceptance`), so each mode's calls cost what they would on text that
accepts a. Its requests sample at temperature 1 unless `--temperature` says otherwise: greedy tokens of
random weights repeat, rows alike read fewer experts, and calls cost less than on text (an H200, Flash
dimensions, 24-row verify calls: 21.7 ms greedy, 29.4 ms at temperature 1).

    python scripts/bench_serve_engine.py --concurrency 1 4 16 64 --requests 64 --max-tokens 64
    python scripts/bench_serve_engine.py --synthetic flash --layers 8 --acceptance 0.8 --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import contextlib
import dataclasses
import gc
import io
import itertools
import json
import logging
import pstats
import time
from pathlib import Path

import numpy as np

MODES = ("none", "fixed5", "padded", "per_request", "per_request_ones", "per_request_queued",
         "per_request_queued_unpriced", "per_request_queued_profiled", "per_request_queued_remembering", "budget",
         "fixed3", "alternate35", "none_eager", "fixed5_eager", "per_request_queued_eager", "none_riding",
         "fixed5_riding", "per_request_queued_riding", "none_segment", "fixed5_segment", "per_request_queued_segment")
PROMPT_TEXTS = ["def fibonacci(n):", "import numpy as np\n\n", "class Stack:\n    def __init__(self):",
                "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"", "for i in range(10):", "with open(path) as f:",
                "def parse_args():\n    parser = argparse.ArgumentParser(", "async def fetch(url):"]


def build(args, max_running: int | None = None, buckets: tuple[int, ...] | None = None):
    """(engine, prompts as ids, seconds to load + compile + profile); `max_running` / `buckets`
    override the arguments' (the 1-slot engine of `--versus-slots`)."""
    from jdspark.config import EngineConfig
    from jdspark.engine.engine import Engine
    from jdspark.engine.executables import enable_compile_cache
    from jdspark.engine.options import SpecOptions
    enable_compile_cache()
    start = time.perf_counter()
    model, tokenizer, prompts = synthetic_model(args) if args.synthetic else checkpoint_model(args)
    config = EngineConfig(max_seq_len=args.max_seq_len, gamma=model.config.dspark.block_size,
                          max_batch=max_running or args.max_running,
                          batch_buckets=tuple(args.buckets) if buckets is None else buckets,
                          prefill_batch_buckets=tuple(args.prefill_buckets) if buckets is None else (),
                          scripted_acceptance=args.acceptance, twin_executables=not args.single_executables)
    widths = tuple(args.widths) or None
    fixed_only = set(args.modes) <= {"none", "fixed5", "fixed3", "alternate35"}
    # a subset for fixed widths alone needs no cost profile; adaptive modes price the widths compiled
    options = SpecOptions(width=max(widths)) if widths and fixed_only else SpecOptions()
    engine = Engine(model, config, tokenizer=tokenizer, prefill_chunk=args.prefill_chunk,
                    prefill_budget=args.prefill_budget, options=options, widths=widths, defer_steps=args.defer_steps,
                    prompt_segment=args.prompt_segment)
    gc.collect()  # as the server's Scheduler.start does: start-up's objects leave the garbage collector
    gc.freeze()
    return engine, prompts, time.perf_counter() - start


def checkpoint_model(args):
    """(model, tokenizer, prompts as ids) of `--model` or the embedded checkpoint."""
    from jdspark.assets import default_model_dir
    from jdspark.checkpoint.loader import decode_at_load_by_default, load_model
    from jdspark.tokenizer.tokenizer import Tokenizer
    path = Path(args.model or default_model_dir())
    dequantize = decode_at_load_by_default(path) if args.dequantize == "auto" else args.dequantize == "on"
    model = load_model(path, dtype=args.dtype, dequantize=dequantize)
    tokenizer = Tokenizer(path / "tokenizer.json", model.config.bos_token_id, model.config.eos_token_id)
    return model, tokenizer, [np.asarray(tokenizer.encode(t), np.int32) for t in PROMPT_TEXTS]


def synthetic_model(args):
    """(model, no tokenizer, a prompt of `--prompt-len` random ids per slot, at least 8) of `--synthetic`'s
    0731 layout, its random weights drawn on the device in the checkpoint's storage. Greedy rows of one
    prompt route alike, so fewer prompts than slots would price a batch's routed experts below what
    distinct requests read (with 8 prompts, 16 slots had served pairs)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import STORAGES, random_params
    from bench_flash import flash_0731_config

    from jdspark.model.model import Model
    config = flash_0731_config(args.synthetic, args.layers, args.experts)
    model = Model(*random_params(config, args.dtype, STORAGES["fp8+fp4"], seed=0))
    rng = np.random.default_rng(0)
    count = max(len(PROMPT_TEXTS), args.max_running or max(args.concurrency))
    return model, None, [rng.integers(2, config.vocab_size, args.prompt_len, dtype=np.int32) for _ in range(count)]


def set_mode(engine, mode: str, ride_prompts: int = 0) -> None:
    from jdspark.engine.batch import Arrivals
    engine.batch_prefills = not mode.endswith("_eager")
    engine.arrivals = Arrivals()  # each mode's prefill holds weigh its own prompts' gaps, not the last mode's
    engine.ride_prompts = ride_prompts if mode.endswith("_riding") else 0
    engine.segment_prompts = mode.endswith("_segment")
    mode = mode.removesuffix("_eager").removesuffix("_riding").removesuffix("_segment")
    profile = "queued" if mode.startswith("per_request_queued") else "synchronised"
    if engine.selectors:  # an adaptive engine: its selectors measured under the mode's profile
        engine.set_policy(options=dataclasses.replace(engine.options, profile=profile))
    options = engine.options
    # each mode learns its own steps, as a fresh server would (not the last mode's); the engine's cache of
    # its profiles (`_measured`) keeps the old object, which the next set_mode replaces again
    live = engine.live
    engine.live = type(live)(live.selectors, learn=live.learn, prefill_s=live.prefill_s)
    engine.live.price_host_paced = mode != "per_request_queued_profiled"
    engine.live.FORGET_AFTER = 2 ** 62 if mode == "per_request_queued_remembering" else type(engine.live).FORGET_AFTER
    if mode == "none":
        engine.set_policy(speculative=False)
        return
    batch_widths = {"padded": "padded", "budget": "budget"}.get(mode, "per_request")
    first = "ones" if mode == "per_request_ones" else "recent"
    engine.set_policy(speculative=True, width_policy=fixed_policy(mode) or engine.selector,
                      options=dataclasses.replace(options, batch_widths=batch_widths, first_confidence=first,
                                                  price_switches=mode != "per_request_queued_unpriced"))


def fixed_policy(mode: str):
    """The width policy of a fixed-width mode (None: an adaptive one). alternate35 alternates per call
    of the policy, so with one request, per step."""
    if mode in ("fixed5", "fixed3"):
        return lambda confidence, k=int(mode[-1]): k
    if mode == "alternate35":
        steps = itertools.count()
        return lambda confidence: 3 if next(steps) % 2 else 5
    return None


def run_level(engine, prompts, concurrency: int, args, clock=time.perf_counter) -> dict:
    """Closed loop: `concurrency` requests in flight until `args.requests` have finished."""
    from jdspark.engine.request import SamplingParams
    lengths = np.rint(args.max_tokens * np.random.default_rng(0).uniform(
        1 - args.max_tokens_spread, 1 + args.max_tokens_spread, args.requests)).astype(int).clip(1)
    started, times, done, next_index = {}, {}, [], 0

    def admit(n):
        nonlocal next_index
        batch = [(prompts[(next_index + i) % len(prompts)], SamplingParams(
            max_tokens=int(lengths[next_index + i]), temperature=args.temperature, ignore_eos=True)) for i in range(n)]
        now = clock()
        for rid in engine.admit(batch):
            started[rid], times[rid] = now, []
        next_index += n

    begin = clock()
    admit(min(concurrency, args.requests))
    tokens = 0
    pauses = 0  # the finished requests' pauses (`SpecOptions.pause_steps`): why a step decoded where others drafted
    steady = None  # (seconds, tokens) when the last request was admitted: until then `concurrency` were in flight
    timeline = []  # every step: [ms since the level began, its wall ms, rows of the call it read, that call:
    # its width, "decode", or None (it read no decode / verify call)]
    with engine.record_steps() as records, collections_timed() as gc_pauses:
        while engine.running:
            before = clock()
            deltas = engine.step()
            now = clock()
            read = engine.last_step
            timeline.append([round((before - begin) * 1e3, 3), round((now - before) * 1e3, 3),
                             len(read.rows) if read else 0, (read.width if read.drafted_call else "decode") if read else None])
            finished = 0
            for rid, delta in deltas.items():
                if delta.tokens:
                    times[rid].append(now)
                    tokens += len(delta.tokens)
                if delta.final:
                    done.append(rid)
                    finished += 1
                    pauses += delta.completion.stats.pauses if delta.completion else 0
            admit(min(finished, args.requests - next_index))
            if steady is None and next_index >= args.requests:
                steady = (now - begin, tokens)
    wall = clock() - begin
    ttft = [times[r][0] - started[r] for r in done]
    itl = [gap for r in done for gap in np.diff(times[r]).tolist()]

    def pct(values):
        return {f"p{q}": float(np.percentile(values, q)) * 1e3 for q in (50, 90, 99)} if values else {}

    def mean_ms(values):
        return float(np.mean(values)) * 1e3 if values else None
    # each kind of call's host wall time (choice, call, outputs, emission) beside its profiled cost
    measured = getattr(engine, "selectors", {}) or {}  # bucket -> the AdaptiveWidth of its profiled costs
    calls = {"decode": [r for r in records if not r.drafted_call], "verify": [r for r in records if r.drafted_call]}
    by_width: dict[int, list] = {}  # the verify calls by executable width
    for r in calls["verify"]:
        by_width.setdefault(int(r.width), []).append(r)
    # the verify steps whose executable is the previous step's, and those after another one ran (what
    # switching executables costs; overlapped, a step's wall also holds some of its neighbours' work)
    switch = {"same": [], "switched": []}
    for before, r in zip(records, records[1:]):
        if r.drafted_call:
            same = before.drafted_call and before.width == r.width and before.bucket == r.bucket
            switch["same" if same else "switched"].append(r.seconds)
    return {"concurrency": concurrency, "requests": len(done), "tokens_per_s": tokens / wall,
            # until the last request was admitted (every client had one in flight): without the tail in
            # which the last requests finish with the batch part empty (longer for modes whose requests
            # finish at different steps); None when the first admission held them all
            "steady_tokens_per_s": steady[1] / steady[0] if steady and steady[0] > 0 and steady[1] else None,
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "steps": len(records), "wall_s": wall,
            "drafting_steps": len(calls["verify"]), "pauses": pauses,
            "call_ms": {kind: mean_ms([r.seconds for r in rs]) for kind, rs in calls.items()},
            # of call_ms, the read's wait for the device (near zero: the host paces the steps)
            "waited_ms": {kind: mean_ms([r.waited_s for r in rs]) for kind, rs in calls.items()},
            # steps whose call the device had finished before the read began (the host set the pace)
            "ready_share": float(np.mean([r.ready for r in records])) if records else None,
            "profiled_ms": {kind: mean_ms([_profiled_s(measured.get(r.bucket), r) for r in rs])
                            for kind, rs in calls.items()},
            # the verify calls by executable width: how many, and their wall against the profile's price
            "verify_by_width": {k: {"steps": len(rs), "ms": mean_ms([r.seconds for r in rs]),
                                    "profiled_ms": mean_ms([_profiled_s(measured.get(r.bucket), r) for r in rs])}
                                for k, rs in sorted(by_width.items())},
            "verify_after": {kind: {"steps": len(v), "ms": mean_ms(v)} for kind, v in switch.items()},
            # the rows of the verify calls by the width each verified (0: a row that did not draft there)
            "rows_by_width": {str(k): n for k, n in sorted(collections.Counter(
                row.width for r in calls["verify"] for row in r.rows).items())},
            # what the engine learnt a switch of executables adds to a step, per bucket (`live_costs.LiveCosts`)
            "learnt_switch_ms": {str(b): cost * 1e3 for b, cost in engine.live.switch.items()},
            "tokens_per_step": tokens / max(len(records), 1),
            # running requests a step ran for (against the concurrency: slots left empty while
            # admissions wait for their prefill)
            "rows_per_step": sum(len(r.rows) for r in records) / max(len(records), 1),
            # where the level's wall went besides the verify reads: steps that read only a prefill (or
            # nothing), the garbage collector's pauses, and the slowest steps (stalls)
            "other_steps": {"steps": sum(call is None for *_, call in timeline),
                            "ms": sum(ms for _, ms, _, call in timeline if call is None)},
            "gc": {"collections": len(gc_pauses), "ms": sum(gc_pauses), "max_ms": max(gc_pauses, default=0.0)},
            "slowest_steps_ms": sorted((round(ms, 2) for _, ms, *_ in timeline), reverse=True)[:5],
            "timeline": timeline}


@contextlib.contextmanager
def collections_timed():
    """The garbage collector's pauses (ms) while the block runs (`gc.callbacks`)."""
    pauses, started = [], []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((time.perf_counter() - started.pop()) * 1e3)
    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def _profiled_s(policy, record) -> float:
    """The profiled cost of the call a step record ran: D + V(width), or the decode call's."""
    if policy is None:
        return float("nan")
    if not record.drafted_call:
        return policy.decode_cost if policy.decode_cost is not None else float("nan")
    return float(policy.step_costs[record.width])


def lone_request(args, engine, prompts) -> list[dict]:
    """A lone request (concurrency 1) on `engine` and on an engine of `--versus-slots` slots, both in
    this process, interleaved round by round per mode: how much the slot count costs one request."""
    small, _, _ = build(args, max_running=args.versus_slots, buckets=(args.versus_slots,))
    small.wait_for_steps()  # --defer-steps: both engines speculating before any round
    results = []
    for round_ in range(args.rounds):
        for mode in args.modes:
            for name, e in (("many", engine), ("few", small)):
                set_mode(e, mode, args.ride_prompts)
                if round_ == 0:
                    run_level(e, prompts, 1, argparse.Namespace(**{**vars(args), "requests": 1}))
                level = run_level(e, prompts, 1, args)
                results.append({"mode": mode, "round": round_, "slots": e.config.max_batch, **level})
                print(f"round {round_} {mode:12s} {e.config.max_batch:3d} slots {level['tokens_per_s']:8.1f} tok/s",
                      flush=True)
    print(f"| mode | {engine.config.max_batch} slots, median tok/s (rounds) | {args.versus_slots} slots, median "
          f"tok/s (rounds) | ratio |\n|---|---|---|---:|")
    for mode in args.modes:
        cells = []
        for slots in (engine.config.max_batch, args.versus_slots):
            values = [r["tokens_per_s"] for r in results if r["mode"] == mode and r["slots"] == slots]
            cells.append((float(np.median(values)), ", ".join(f"{v:.1f}" for v in values)))
        print(f"| {mode} | {cells[0][0]:.1f} ({cells[0][1]}) | {cells[1][0]:.1f} ({cells[1][1]}) | "
              f"{cells[0][0] / cells[1][0]:.2f} |")
    return results


def print_medians(results: list[dict]) -> None:
    """Per (concurrency, mode): the median tok/s over the rounds, every round's, and the ratio to the
    better of none and fixed5 at that concurrency; the same for the steady part (until the last
    request was admitted)."""
    runs: dict[tuple[int, str], list[float]] = {}
    steady: dict[tuple[int, str], list[float]] = {}
    for level in results:
        runs.setdefault((level["concurrency"], level["mode"]), []).append(level["tokens_per_s"])
        steady.setdefault((level["concurrency"], level["mode"]), []).append(level["steady_tokens_per_s"] or np.nan)

    def ratio(table, concurrency, label, median):  # against none and fixed5 under the same prefill budget
        suffix = label[label.index(" "):] if " " in label else ""
        return median / max(float(np.median(table.get((concurrency, m + suffix), [np.nan]))) for m in ("none", "fixed5"))

    print("| concurrency | mode | median tok/s | rounds | / max(none, fixed5) | steady tok/s | / max(none, fixed5) |\n"
          "|---:|---|---:|---|---:|---:|---:|")
    for (concurrency, mode), values in runs.items():
        median, median_steady = float(np.median(values)), float(np.median(steady[concurrency, mode]))
        print(f"| {concurrency} | {mode} | {median:.1f} | {', '.join(f'{v:.0f}' for v in values)} | "
              f"{ratio(runs, concurrency, mode, median):.2f} | {median_steady:.1f} | "
              f"{ratio(steady, concurrency, mode, median_steady):.2f} |")


def parser() -> argparse.ArgumentParser:
    """The command line (also what `eval_calibration.py` builds its engine from)."""
    from jdspark.engine.options import RIDE_PROMPTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--synthetic", choices=("tiny", "flash", "pro"),
                   help="a random model of this preset's dimensions in the 0731 layout instead (needs --acceptance)")
    p.add_argument("--layers", type=int, default=8, help="--synthetic: main layers")
    p.add_argument("--experts", type=int, help="--synthetic: routed experts (default the preset's)")
    p.add_argument("--prompt-len", type=int, default=64, help="--synthetic: prompt tokens")
    p.add_argument("--acceptance", type=float,
                   help="scripted acceptance per draft position (benchmarks: EngineConfig.scripted_acceptance)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dequantize", default="auto", choices=["auto", "on", "off"],
                   help="decode FP8 / FP4 weights at load (auto: as `jdspark serve` does, on a CPU backend only)")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--max-running", type=int, help="engine slots (default: the largest concurrency)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--prefill-budget", type=int, help="prompt tokens a step prefills (default: the engine's)")
    p.add_argument("--ride-prompts", type=int, default=RIDE_PROMPTS,
                   help="the *_riding modes: prompts with at most this many tokens left ride in the verify calls "
                        "(default: the engine's)")
    p.add_argument("--prompt-segment", type=int, default=0,
                   help="compile the verify calls with a prompt segment of this many tokens (the *_segment modes)")
    p.add_argument("--prefill-budgets", type=int, nargs="+",
                   help="run every mode under each of these prefill budgets (prompt tokens a step prefills beside "
                   "running requests; 0: --prefill-budget's), interleaved, labelled 'mode bN'")
    p.add_argument("--buckets", type=int, nargs="*", default=[], help="batch buckets (default 1, 4, 16, ... max)")
    p.add_argument("--prefill-buckets", type=int, nargs="*", default=[],
                   help="prefill buckets (default: the batch buckets), e.g. 1 4 16 64 beside --buckets 16 64")
    p.add_argument("--widths", type=int, nargs="*", default=[],
                   help="compile only these step widths (default 0..gamma; adaptive modes choose among them, a "
                   "width between two running in the wider one's executable): fewer programs to compile at Flash dims")
    p.add_argument("--startup-only", action="store_true", help="build the engine, report start-up, exit")
    p.add_argument("--defer-steps", action="store_true", help="build the engine as `jdspark serve` does: serving "
                   "target-only first, the step executables built in the background (Engine(defer_steps=True)); "
                   "start-up then reports both times, and the modes run once speculation is online")
    p.add_argument("--single-executables", action="store_true", help="each executable loaded once, not twice "
                   "and alternated (EngineConfig.twin_executables)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--requests", type=int, default=64, help="requests per (mode, concurrency)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-tokens-spread", type=float, default=0.0,
                   help="each request's max_tokens drawn from max_tokens x [1 - f, 1 + f] (0: all alike)")
    p.add_argument("--temperature", type=float,
                   help="the requests' sampling temperature (default 0; with --synthetic 1: rows route as text's do)")
    p.add_argument("--rounds", type=int, default=1, help="repeats of every (concurrency, mode), interleaved")
    p.add_argument("--versus-slots", type=int,
                   help="instead of the concurrency levels: a lone request here and on an engine of this many slots")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--no-fetch-early", action="store_true", help="read each call's output without starting "
                   "its copy to the host when the call is issued (the engine before `calls.fetch_early`; A/B)")
    p.add_argument("--trace", action="store_true", help="after the rounds, one level of each mode at the first "
                   "concurrency under jax.profiler: device busy a step, kernels, the host's events (graph updates)")
    p.add_argument("--host-profile", help="cProfile each mode's measured levels (the host's part of the steps: "
                   "choice, dispatch, reads) and write each mode's top functions by own time here")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.max_running = args.max_running or max(args.concurrency)
    if args.temperature is None:
        args.temperature = 1.0 if args.synthetic else 0.0
    if any(m.endswith("_segment") for m in args.modes) and not args.prompt_segment:
        p.error("the *_segment modes need --prompt-segment N (the segment executables' tokens)")
    if args.synthetic and (args.model or args.acceptance is None):
        p.error("--synthetic makes its own model and accepts random drafts only by script: pass --acceptance, "
                "not --model")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.no_fetch_early:
        from jdspark.engine import calls
        calls.fetch_early = lambda results: results  # the engine reads `calls.fetch_early` at each call
    engine, prompts, startup = build(args)
    speculating = None
    if args.defer_steps:  # start-up = until target-only serving; then until the step executables are taken
        begun = time.perf_counter()
        engine.wait_for_steps()
        speculating = startup + time.perf_counter() - begun
        print(f"target-only serving after {startup:.1f} s, speculating after {speculating:.1f} s", flush=True)
    longest = int(np.rint(args.max_tokens * (1 + args.max_tokens_spread)))
    if longest > min(engine.room(len(prompt)) for prompt in prompts):
        p.error(f"--max-tokens {args.max_tokens} with --max-tokens-spread {args.max_tokens_spread} asks for up to "
                f"{longest} tokens, more than --max-seq-len {args.max_seq_len} leaves the longest prompt: raise it")
    print(f"start-up (load + compile + costs): {startup:.1f} s, buckets {list(engine.config.buckets)} "
          f"(prefill {list(engine.config.prefill_buckets)}), "
          f"{engine.exe.count} executables, {engine.exe.loaded} loaded from disk", flush=True)
    if args.startup_only:
        if args.out:
            Path(args.out).write_text(json.dumps({"startup_s": startup, "speculating_s": speculating,
                                                  "executables": engine.exe.count, "loaded": engine.exe.loaded},
                                                 indent=1))
        return 0
    if args.versus_slots:
        results = lone_request(args, engine, prompts)
        if args.out:
            Path(args.out).write_text(json.dumps({"startup_s": startup, "lone_request": results}, indent=1))
        return 0
    results, budgets, default_rows = [], args.prefill_budgets or [0], engine.prefill_rows
    profiles = {} if args.host_profile else None  # label -> cProfile.Profile
    for concurrency in args.concurrency:
        for round_ in range(args.rounds):  # rounds interleave the modes, so drift hits them alike
            for mode, budget in itertools.product(args.modes, budgets):
                set_mode(engine, mode, args.ride_prompts)
                engine.prefill_rows = max(1, budget // engine.exe.prefill_chunk) if budget else default_rows
                label = f"{mode} b{budget}" if len(budgets) > 1 else mode
                if round_ == 0:  # a warm-up round first
                    warm_up = argparse.Namespace(**{**vars(args), "requests": concurrency})
                    run_level(engine, prompts, concurrency, warm_up)
                level_args = argparse.Namespace(**{**vars(args), "requests": max(args.requests, concurrency)})
                with profiled(profiles, label):
                    level = {"mode": label, "round": round_, "prefill_rows": engine.prefill_rows,
                             **run_level(engine, prompts, concurrency, level_args)}
                results.append(level)
                print(f"round {round_} c={concurrency:3d} {label:12s} {level['tokens_per_s']:9.1f} tok/s  "
                      f"(steady {level['steady_tokens_per_s'] or float('nan'):.1f})  "
                      f"TTFT p50/p99 {level['ttft_ms'].get('p50', 0):7.1f}/{level['ttft_ms'].get('p99', 0):7.1f} ms  "
                      f"ITL p50/p99 {level['itl_ms'].get('p50', 0):7.1f}/{level['itl_ms'].get('p99', 0):7.1f} ms  "
                      f"drafting steps {level['drafting_steps']}/{level['steps']} (pauses {level['pauses']})  "
                      f"rows a step {level['rows_per_step']:.1f}  call ms (profiled): "
                      + " ".join(f"{k} {v:.2f} ({level['profiled_ms'][k]:.2f})"
                                 for k, v in level["call_ms"].items() if v)
                      + "  waited for the device: "
                      + " ".join(f"{k} {v:.2f}" for k, v in level["waited_ms"].items() if v is not None)
                      + f" (ready at the read: {level['ready_share'] or 0:.0%})"
                      + "  by width: " + " ".join(f"k{k} x{w['steps']} {w['ms']:.2f} ({w['profiled_ms']:.2f})"
                                                  for k, w in level["verify_by_width"].items())
                      + "  after the same / another executable: " + " / ".join(
                          f"x{v['steps']} {v['ms']:.2f}" if v["steps"] else "x0"
                          for v in level["verify_after"].values())
                      + "  learnt switch ms: "
                      + " ".join(f"{b}:{ms:.3f}" for b, ms in level["learnt_switch_ms"].items())
                      + "  rows by width: " + " ".join(f"k{k} x{n}" for k, n in level["rows_by_width"].items())
                      + f"  other steps x{level['other_steps']['steps']} {level['other_steps']['ms']:.1f} ms"
                      + f"  gc x{level['gc']['collections']} {level['gc']['ms']:.1f} ms (max {level['gc']['max_ms']:.1f})"
                      + f"  slowest steps {level['slowest_steps_ms']} ms",
                      flush=True)
            if args.out:  # after every level, so a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps({"startup_s": startup, "temperature": args.temperature,
                                                      "levels": results}, indent=1))
    print_medians(results)
    if args.trace:
        traces = traced_levels(engine, prompts, args)
        if args.out:
            Path(args.out).write_text(json.dumps({"startup_s": startup, "temperature": args.temperature,
                                                  "levels": results, "traces": traces}, indent=1))
    if profiles:
        Path(args.host_profile).write_text("".join(top_functions(label, prof) for label, prof in profiles.items()))
    return 0


def traced_levels(engine, prompts, args) -> list[dict]:
    """One more level of each mode at the first concurrency under `jax.profiler` (no Python frames): the
    device's busy time a step against the step's wall, kernels a step, and the host's events by total time,
    `command_buffer::update` among them (XLA updating a CUDA graph because a buffer moved; the profiler makes
    those far more frequent than untraced: `scripts/cmdbuf_updates.py` counts an untraced run's)."""
    from jdspark.profile import busy_us, gpu_kernel_events, host_summary
    traces, concurrency = [], args.concurrency[0]
    for mode in args.modes:
        set_mode(engine, mode, args.ride_prompts)
        level_args = argparse.Namespace(**{**vars(args), "requests": max(args.requests, concurrency)})
        host, level = [], {}
        kernels = gpu_kernel_events(lambda: level.update(run_level(engine, prompts, concurrency, level_args)),
                                    host, python=False)
        steps = max(level["steps"], 1)
        top = host_summary(host, 40)
        trace = {"mode": mode, "concurrency": concurrency, "steps": level["steps"],
                 "tokens_per_s": level["tokens_per_s"], "wall_ms_per_step": level["wall_s"] * 1e3 / steps,
                 "busy_ms_per_step": busy_us([(k["ts"], k["dur"], k["name"]) for k in kernels]) / 1e3 / steps,
                 "kernels_per_step": len(kernels) / steps,
                 "command_buffer": [e for e in top if e["name"].startswith("command_buffer::")], "host_top": top[:15]}
        traces.append(trace)
        print(f"traced c={concurrency} {mode}: {trace['wall_ms_per_step']:.2f} ms a step, device busy "
              f"{trace['busy_ms_per_step']:.2f}, {trace['kernels_per_step']:.0f} kernels a step; "
              + "; ".join(f"{e['name']} x{e['count']} {e['us'] / steps:.0f} us a step" for e in trace["command_buffer"])
              + "\n  host: " + "; ".join(f"{e['name'][:50]} x{e['count']} {e['us'] / steps:.0f}"
                                        for e in top[:8]), flush=True)
    return traces


@contextlib.contextmanager
def profiled(profiles: dict | None, label: str):
    """cProfile the block into `profiles[label]` (None: no profiling)."""
    if profiles is None:
        yield
        return
    profile = profiles.setdefault(label, cProfile.Profile())
    profile.enable()
    try:
        yield
    finally:
        profile.disable()


def top_functions(label: str, profile: cProfile.Profile, count: int = 35) -> str:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(count)
    return f"===== {label}\n{text.getvalue()}"


if __name__ == "__main__":
    raise SystemExit(main())
