"""The engine's own host time per step: every executable replaced by an instant stand-in that hands
back one fixed result, so what is timed is `Engine.step` itself (choosing widths, building the
call's inputs, reading its output, emitting tokens, statistics, live costs), not the device.

On the H200 the embedded model's step is ~2 ms and the host sets the pace, so each microsecond
here is one there. The stand-ins return, for every row, `--accepted` accepted drafts of
`--confidence` each; the adaptive policy prices with the costs given (`--costs`: decode, then
step[0..gamma] in ms; default the H200's queued profile of the 8-slot engine's bucket 1,
docs/BENCHMARKS.md) and live costs that learn nothing (the stand-ins' microsecond steps would
teach the engine that decoding is free). Modes: none (target-only), fixed5, per_request (adaptive).
Prints microseconds per step per mode and concurrency (rounds interleaved; median), writes JSON.

    python scripts/bench_engine_host.py --concurrency 1 4 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax.numpy as jnp
import numpy as np

MODES = ("none", "fixed5", "per_request")


def instant(out):
    """An executable's stand-in: the state passes through, the result is always `out`."""
    def call(params, state, draft_cache, *inputs):
        return out, state, draft_cache
    return call


def fixed_output(rows: int, gamma: int, drafted: bool, accepted: int, confidence: float):
    """A call's packed result (`calls.pack_output`'s layout) for `rows` rows."""
    columns = [np.full((rows, 1), accepted if drafted else 0), np.full((rows, 1), 7), np.zeros((rows, 1))]
    if drafted:
        columns += [np.arange(8, 8 + gamma)[None].repeat(rows, 0),
                    np.full((rows, gamma), confidence, np.float32).view(np.int32)]
    return jnp.asarray(np.concatenate(columns, axis=1).astype(np.int32))


def build(args):
    from jdspark.assets import default_model_dir
    from jdspark.checkpoint.loader import load_model
    from jdspark.config import EngineConfig
    from jdspark.engine.live_costs import LiveCosts
    from jdspark.engine.engine import Engine
    from jdspark.engine.options import SpecOptions
    from jdspark.speculative.selector import AdaptiveWidth
    model = load_model(default_model_dir(), dtype="float32")
    config = EngineConfig(max_seq_len=args.max_seq_len, gamma=5, max_batch=args.max_running,
                          batch_buckets=tuple(args.buckets))
    engine = Engine(model, config, prefill_chunk=32, options=SpecOptions(width=5))  # no start-up profile
    for n, bucket in engine.exe.buckets.items():
        bucket.decode = instant(fixed_output(n, 5, False, 0, 0.0))
        if bucket.prefill is not None:
            bucket.prefill = instant(fixed_output(n, 5, False, 0, 0.0))
        bucket.step = {k: instant(fixed_output(n, 5, True, min(args.accepted, k), args.confidence))
                       for k in bucket.step}
    decode, *steps = (c / 1e3 for c in args.costs)
    draft = steps[0] - decode
    selector = AdaptiveWidth([s - draft for s in steps], draft, 5, decode_cost=decode)
    engine.selectors = dict.fromkeys(config.buckets, selector)
    engine.selector, engine.live = selector, LiveCosts(engine.selectors, learn=False)
    return engine


def per_step(engine, mode: str, concurrency: int, steps: int) -> float:
    """Seconds per Engine.step with `concurrency` requests kept running."""
    from jdspark.engine.request import SamplingParams
    policy = {"fixed5": lambda confidence: 5, "per_request": engine.selector}.get(mode)
    engine.set_policy(speculative=mode != "none", **({"width_policy": policy} if policy else {}))
    params = SamplingParams(max_tokens=engine.config.max_seq_len // 2, temperature=1.0, seed=1)

    def keep_running():
        missing = concurrency - len(engine.running)
        if missing > 0:
            engine.admit([(np.arange(2, 12), params)] * missing)

    for _ in range(50):  # prompts prefilled, pauses and averages settled
        keep_running()
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        keep_running()
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    for rid in engine.running:
        engine.cancel(rid)
    engine.step()
    engine.step()
    return seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-running", type=int, default=4)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--accepted", type=int, default=3, help="drafts each row accepts per step")
    p.add_argument("--confidence", type=float, default=0.85, help="each draft's stated confidence")
    p.add_argument("--costs", type=float, nargs=7, default=[0.96, 1.75, 1.61, 1.78, 1.69, 1.73, 1.75],
                   metavar="MS", help="decode, step0..step5 in ms (the adaptive policy's prices)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--json")
    args = p.parse_args()
    engine = build(args)
    times = {(m, c): [] for c in args.concurrency for m in args.modes}
    for _ in range(args.rounds):
        for (mode, c), samples in times.items():
            samples.append(per_step(engine, mode, c, args.steps))
    print(f"{'mode':12s} {'c':>3s} {'us/step':>8s}  rounds")
    rows = []
    for (mode, c), samples in times.items():
        median = statistics.median(samples) * 1e6
        print(f"{mode:12s} {c:3d} {median:8.1f}  {', '.join(f'{s * 1e6:.1f}' for s in samples)}")
        rows.append({"mode": mode, "concurrency": c, "us_per_step": median, "rounds_us": [s * 1e6 for s in samples]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
