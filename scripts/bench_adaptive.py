"""Adaptive verification vs every fixed width, on a random-weight DSV4 + DSpark drafter.

A random drafter is never accepted, so the acceptance regime is synthetic: the verifier is
replaced by one that accepts each draft with probability `a` (the drafted tokens are emitted) and
the drafter's confidences are set to `a` (perfectly calibrated). Costs are real: the same
executables, shapes and state traffic as exact verification. Output is NOT the model's
distribution; this measures only the width choice. Prints a table and writes JSON.

    python scripts/bench_adaptive.py [--tokens 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.config import EngineConfig, tiny_dspark_config
from jdspark.engine import programs
from jdspark.engine.engine import Engine
from jdspark.engine.request import SamplingParams
from jdspark.model.model import Model
from jdspark.speculative.verify import Verdict

REGIMES = {"high": 0.85, "low": 0.35}


def bench_config():
    """A small random model with the real structure (window, CSA + indexer, HCA, hash, MoE, 2 stages)."""
    return tiny_dspark_config(
        vocab_size=32768, hidden_size=1024, num_attention_heads=8, head_dim=128, q_lora_rank=512, o_groups=2,
        o_lora_rank=256, sliding_window=128, compress_ratios=(0, 0, 4, 128, 4, 128, 0, 0), index_n_heads=8,
        index_head_dim=64, index_topk=64, n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
        max_position_embeddings=8192,
        extra=dict(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[3, 5], dspark_markov_rank=64))


def synthetic_acceptor(rate: float):
    def accept(target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p,
               implementation="auto"):
        k = draft_tokens.shape[1]
        accepted = jnp.cumprod((uniforms < rate).astype(jnp.int32), axis=1).sum(axis=1) if k else \
            jnp.zeros(target_logits.shape[0], jnp.int32)
        token = jnp.argmax(target_logits[:, -1] / exponentials, axis=-1).astype(jnp.int32)
        return Verdict(accepted.astype(jnp.int32), token, jnp.zeros(token.shape, bool))
    return accept


def run(engine, prompt, tokens, width) -> dict:
    """Decode `tokens` tokens; width None = adaptive, -1 = target only. Times the decode steps only."""
    engine.set_policy(speculative=width != -1)
    if width is None:
        engine.set_policy(width_policy=engine.selector)
    elif width >= 0:
        engine.set_policy(width_policy=lambda confidence, k=width: k)
    # One seed for every mode: the synthetic acceptance draws are then the same sequence, so modes
    # that choose the same widths accept the same drafts and differ only in what they cost.
    first = engine.add(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, seed=1234, ignore_eos=True))
    gc.collect()
    gc.disable()  # a collection inside one mode's timed loop would be charged to that mode alone
    try:
        start = time.perf_counter()
        [completion] = engine.complete([first])
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    stats = completion.stats
    return {"tok_s": (len(completion.token_ids) - 1) / seconds, "tau": stats.tau, "widths": stats.widths}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--tiny", action="store_true", help="the CPU test config (a smoke test of this script)")
    args = parser.parse_args()
    config = tiny_dspark_config() if args.tiny else bench_config()
    model = Model.random(config, "bfloat16", seed=0)
    prompt = np.random.default_rng(0).integers(4, config.vocab_size, 64)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tokens": args.tokens, "regimes": {}}
    original_propose = programs.dspark.propose
    for name, rate in REGIMES.items():
        programs.rejection_sample = synthetic_acceptor(rate)
        programs.dspark.propose = lambda *a, r=rate, **k: (lambda p: p.replace(
            confidence=jnp.full_like(p.confidence, r)))(original_propose(*a, **k))
        start = time.perf_counter()
        engine = Engine(model, EngineConfig(max_seq_len=1024, gamma=5, max_batch=1), prefill_chunk=64)
        compile_s = time.perf_counter() - start
        print(f"regime {name}: engine compiled and profiled in {compile_s:.0f} s", flush=True)
        run(engine, prompt, 16, None)  # warm-up: measures D over its first 5 steps
        modes = [("target-only", -1), *[(f"k={k}", k) for k in range(6)], ("adaptive", None)]
        samples = {label: [] for label, _ in modes}
        # Round robin, each round starting one mode later: drift in clocks or caches, and whatever a
        # place in the round costs, hits every mode alike.
        for r in range(args.repeats):
            for label, width in modes[r % len(modes):] + modes[:r % len(modes)]:
                samples[label].append(run(engine, prompt, args.tokens, width))
        rows = {label: {"tok_s": statistics.median(s["tok_s"] for s in runs), "tau": runs[-1]["tau"],
                        "widths": runs[-1]["widths"]} for label, runs in samples.items()}
        best = max(v["tok_s"] for k, v in rows.items() if k.startswith("k="))
        results["regimes"][name] = {"acceptance": rate, "engine_start_s": compile_s, **engine.cost_summary(),
                                    "rows": rows, "adaptive_vs_best_fixed": rows["adaptive"]["tok_s"] / best}
        print(f"\nregime {name} (acceptance {rate}): D = {engine.selector.draft_cost * 1e3:.2f} ms, "
              f"V(k) = {[round(float(v) * 1e3, 2) for v in engine.selector.verify_costs]} ms, start {compile_s:.0f} s")
        print(f"{'mode':>12} {'tok/s':>8} {'tau':>5}  widths")
        for label, row in rows.items():
            print(f"{label:>12} {row['tok_s']:8.1f} {row['tau']:5.2f}  {row['widths']}")
        print(f"adaptive / best fixed = {results['regimes'][name]['adaptive_vs_best_fixed']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_adaptive.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
