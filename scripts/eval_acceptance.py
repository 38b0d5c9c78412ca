"""Acceptance and speed of speculative decoding on held-out code, through the engine.

    python scripts/eval_acceptance.py [--model DIR] --corpus build/corpus --prompts 16 --max-tokens 128

Prompts are the last --prompt-tokens tokens before a cut point in held-out files (deterministic).
For T = 0 and T = 1: per-position acceptance and tau (tokens per verification, bonus included) at
the full block width; greedy speculative tokens compared with greedy target-only tokens (per
prompt: equal, or the index of the first differing token); and tokens/s
target-only vs speculative (fixed full width and adaptive), median over --repeats passes over the
same prompts, the engines' passes interleaved (EOS ignored, so every request generates --max-tokens).
Prints a table, writes JSON. --temperatures and --engines run a subset (e.g. `--temperatures 1
--engines fixed` compares the tau of two drafters on the CPU, where the speed means little).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import load_model
from jdspark.engine.engine import SpecOptions
from jdspark.engine.executables import enable_compile_cache
from jdspark.engine.request import SamplingParams
from jdspark.generator import Generator
from jdspark.tokenizer.tokenizer import Tokenizer
from jdspark.train.data import heldout_prompts


ENGINES = ("target-only", "fixed", "adaptive")  # --engines keys: target-only, speculative at width gamma, adaptive


def run_all(gen: Generator, prompts, temperature: float, max_tokens: int, seed: int) -> dict:
    """Every prompt once (single request at a time); totals and per-request stats."""
    outs, stats = [], []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
        c = gen.generate(prompt, params)
        outs.append(c.token_ids)
        stats.append(c.stats)
    seconds = time.perf_counter() - start
    steps = sum(s.steps for s in stats)
    accepted = np.sum([s.accepted_at for s in stats], axis=0)
    verified = np.sum([s.verified_at for s in stats], axis=0)
    return {"tokens": outs, "tok_s": sum(len(o) for o in outs) / seconds, "seconds": seconds,
            "tau": sum(s.emitted_by_steps for s in stats) / steps,
            "acceptance": (accepted / np.maximum(verified, 1)).round(4).tolist(),
            "widths": np.sum([s.widths for s in stats], axis=0).tolist()}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (or one ends), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--corpus", default="build/corpus")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--json", default="eval_acceptance.json")
    args = p.parse_args(argv)
    enable_compile_cache()  # the fixed-width engine's executables are the adaptive engine's
    path = Path(args.model) if args.model else default_model_dir()
    model = load_model(path, dtype=args.dtype, progress=False)
    tokenizer = Tokenizer(path / "tokenizer.json")
    texts = [json.loads(line)["text"] for line in open(Path(args.corpus) / "heldout.jsonl")]
    prompts = heldout_prompts(texts, tokenizer.encode, args.prompts, args.prompt_tokens, args.seed)
    max_seq_len = args.prompt_tokens + args.max_tokens + 64
    gamma = model.config.dspark.block_size
    build = {  # --engines key: (name in the results, engine)
        "target-only": ("target-only", lambda: Generator.from_model(model, tokenizer, speculative=False,
                                                                     max_seq_len=max_seq_len)),
        "fixed": (f"speculative k={gamma}", lambda: Generator.from_model(
            model, tokenizer, max_seq_len=max_seq_len, options=SpecOptions(width=gamma), widths=(gamma,))),
        "adaptive": ("speculative adaptive", lambda: Generator.from_model(model, tokenizer, max_seq_len=max_seq_len)),
    }
    engines = {}
    for key, (name, make) in build.items():
        if key in args.engines:
            start = time.perf_counter()
            engines[name] = make()
            print(f"built {name} in {time.perf_counter() - start:.0f} s", flush=True)
    result = {"device": str(jax.devices()[0].device_kind), "model": str(path), "args": vars(args), "runs": {}}
    for temperature in args.temperatures:
        by_engine = {name: [] for name in engines}
        for _ in range(args.repeats):  # engines interleaved, so drifting machine speed hits each alike
            for name, gen in engines.items():
                by_engine[name].append(run := run_all(gen, prompts, temperature, args.max_tokens, args.seed))
                print(f"pass T={temperature:g} {name}: {run['tok_s']:.1f} tok/s, tau {run['tau']:.2f}", flush=True)
        for name, passes in by_engine.items():
            first = passes[0]
            result["runs"][f"T={temperature:g} {name}"] = {
                "tok_s_median": statistics.median(r["tok_s"] for r in passes), "tok_s": [r["tok_s"] for r in passes],
                "tau": first["tau"], "acceptance": first["acceptance"], "widths": first["widths"],
                "tokens": first["tokens"]}
    runs = result["runs"]
    for temperature in args.temperatures:
        base = runs.get(f"T={temperature:g} target-only", {}).get("tok_s_median")
        for name in engines:
            run = runs[f"T={temperature:g} {name}"]
            run["speedup"] = run["tok_s_median"] / base if base else None
    if 0.0 in args.temperatures and "target-only" in engines:
        reference = runs["T=0 target-only"]["tokens"]
        result["greedy_first_difference"] = {  # per prompt: None, or the index of the first differing token
            name: [first_difference(a, b) for a, b in zip(runs[f"T=0 {name}"]["tokens"], reference)]
            for name in engines if name != "target-only"}
        result["greedy_equal"] = all(i is None for d in result["greedy_first_difference"].values() for i in d)
    print(f"{'run':34s} {'tok/s':>8s} {'speedup':>8s} {'tau':>6s}  acceptance by position")
    for name, r in runs.items():
        speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"{name:34s} {r['tok_s_median']:8.1f} {speedup:>8s} {r['tau']:6.2f}  {r['acceptance']}")
    if "greedy_equal" in result:
        print(f"greedy speculative == greedy target-only ({args.dtype}): {result['greedy_equal']}")
        for name, differences in result["greedy_first_difference"].items():
            diverged = [i for i in differences if i is not None]
            print(f"  {name}: {len(differences) - len(diverged)} of {len(differences)} prompts equal; "
                  f"first differing token of the others: {diverged}")
    for r in runs.values():
        r.pop("tokens")
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
