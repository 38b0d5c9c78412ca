"""Train the DSpark drafter on the frozen target (spec dspark.md §12-13), then calibrate its
confidences with sequential temperature scaling (§10) on held-out code.

    python scripts/train_drafter.py --target build/tiny-code-target --corpus build/corpus \
        --minutes 2 --out jdspark/assets/tiny-code [--selfgen-sequences 2048 --selfgen-fraction 0.5]

With --selfgen-sequences N, N corpus prompts of --prompt-tokens tokens are first continued by the
target itself through the engine (T = --selfgen-temperature) to --seq-len + 1 tokens (§12.1);
that share of every batch then comes from these rows, with anchors only in the sampled part.
With --markov-rank R the checkpoint's Markov head is first widened to rank R without changing
what it computes (`drafter.widen_markov_head`), so a trained drafter continues with more rank;
--add-stages N likewise inserts N identity stages before the last (`drafter.add_stages`).

Held-out figures: teacher-forced acceptance (1 - TV per position, tau_prob) on --heldout-windows
windows of held-out code, and the tau generation gets, replayed (`jdspark.train.replay`) on
--replay-rows prompts cut from random held-out files (`data.heldout_prompts`, as
eval_acceptance.py picks them) continued by the target at T = 1 (what speculative decoding meets).

The target is loaded from its checkpoint with the stored (quantized) values, so the drafter learns
the distribution that is served. Anchors, block layout and losses as `jdspark.train.drafter`
(0.1 CE + 0.9 L1 + 1.0 BCE(confidence), decay 4). Writes <out>/ (config.json with
dspark_confidence_temperatures, sharded safetensors, tokenizer.json) and <out>/train_drafter.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.checkpoint.export import save_model
from jdspark.checkpoint.loader import load_model, read_config
from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine
from jdspark.model.model import Model
from jdspark.tokenizer.tokenizer import Tokenizer
from jdspark.train import adamw, drafter, loop, replay, selfgen, sts
from jdspark.train.data import Batches, heldout_prompts, heldout_windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="build/tiny-code-target")
    p.add_argument("--corpus", default="build/corpus")
    p.add_argument("--tokenizer", default="jdspark/assets/tiny-code/tokenizer.json")
    p.add_argument("--out", default="jdspark/assets/tiny-code")
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--decay", type=float, default=4.0, help="loss weight exp(-(k-1)/decay) per position")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-windows", type=int, default=256)
    p.add_argument("--selfgen-sequences", type=int, default=0, help="target-sampled rows to train on (0: corpus only)")
    p.add_argument("--selfgen-fraction", type=float, default=0.5, help="share of each batch from those rows")
    p.add_argument("--selfgen-temperature", type=float, default=1.0)
    p.add_argument("--selfgen-batch", type=int, default=256, help="engine slots while sampling")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--markov-rank", type=int, default=0,
                   help="widen the checkpoint's Markov head to this rank first (0: keep it)")
    p.add_argument("--add-stages", type=int, default=0, help="insert this many identity drafter stages first")
    p.add_argument("--replay-rows", type=int, default=64,
                   help="held-out prompts continued by the target for the replayed tau (0: none)")
    p.add_argument("--eval-every", type=int, default=500)
    args = p.parse_args(argv)
    stored = read_config(args.target)
    model = load_model(args.target, dtype="float32", dequantize=True, progress=False)
    if args.markov_rank:
        model = drafter.widen_markov_head(model, args.markov_rank, seed=args.seed)
        stored = stored.replace(extra={**stored.extra, "dspark_markov_rank": args.markov_rank})
    if args.add_stages:
        model = drafter.add_stages(model, args.add_stages, seed=args.seed)
        stored = stored.replace(num_nextn_predict_layers=model.config.num_nextn_predict_layers,
                                compress_ratios=model.config.compress_ratios)
    gamma = stored.dspark.block_size
    graphdef, params, frozen = nnx.split(model.module(), drafter.DRAFTER, ...)
    opt_config = adamw.AdamWConfig(lr=args.lr, warmup_steps=args.warmup)
    corpus = np.load(Path(args.corpus) / "train.npy")
    batches = Batches(corpus, args.batch, args.seq_len, seed=args.seed + 1)
    held = heldout_windows(np.load(Path(args.corpus) / "heldout.npy"), args.seq_len, args.heldout_windows)[:, :-1]
    texts = [json.loads(line)["text"] for line in open(Path(args.corpus) / "heldout.jsonl")]
    replay_prompts = np.asarray(heldout_prompts(texts, Tokenizer(args.tokenizer).encode, args.replay_rows,
                                                args.prompt_tokens, seed=0), np.int32)
    if args.replay_rows and not len(replay_prompts):
        p.error(f"no held-out file has more than --prompt-tokens {args.prompt_tokens} + 64 tokens to cut a replay "
                "prompt from; lower --prompt-tokens or pass --replay-rows 0")
    engine = None  # the target through the serving engine, compiled only when something samples from it
    if args.replay_rows or args.selfgen_sequences:
        engine = Engine(model, EngineConfig(max_seq_len=args.seq_len + 1 + gamma + 1, gamma=gamma,
                                            max_batch=args.selfgen_batch),
                        speculative=False, prefill_chunk=args.prompt_tokens)
    replay_rows = selfgen.sample_continuations(engine, replay_prompts, args.seq_len - args.prompt_tokens, 1.0,
                                               seed=10 ** 6) if args.replay_rows else None
    replay_anchors = np.broadcast_to(np.arange(args.prompt_tokens - 1, args.seq_len - gamma - 1),
                                     (args.batch, args.seq_len - gamma - args.prompt_tokens)).astype(np.int32)
    generated, n_generated, selfgen_s = None, 0, 0.0
    if args.selfgen_sequences:
        start = time.perf_counter()
        prompts = Batches(corpus, args.selfgen_sequences, args.prompt_tokens - 1, seed=args.seed + 2).next()
        rows = selfgen.sample_continuations(engine, prompts, args.seq_len + 1 - args.prompt_tokens,
                                            args.selfgen_temperature, seed=args.seed)
        selfgen_s = time.perf_counter() - start
        print(f"sampled {rows.shape} from the target in {selfgen_s:.0f} s", flush=True)
        n_generated = round(args.selfgen_fraction * args.batch)
        generated = selfgen.GeneratedBatches(rows, n_generated, seed=args.seed + 3)
    del engine
    low = np.where(np.arange(args.batch) < n_generated, args.prompt_tokens, 1)  # generated rows come first
    rng = np.random.default_rng(args.seed)
    held_anchors = drafter.sample_anchors(rng, len(held), args.seq_len, gamma, args.anchors)
    state = {"params": params, "opt": adamw.init(params, total_steps=10 ** 6)}

    def step(i):
        ids = batches.next()[:, :-1]
        if generated is not None:
            ids[:n_generated] = generated.next()[:, :-1]
        anchors = drafter.sample_anchors(rng, args.batch, args.seq_len, gamma, args.anchors, low)
        state["params"], state["opt"], info = drafter.train_step(state["params"], frozen, state["opt"], ids, anchors,
                                                                 graphdef=graphdef, config=opt_config, decay=args.decay)
        return info

    def set_total(total):
        state["opt"] = state["opt"].replace(total_steps=jnp.asarray(total, jnp.int32))

    def evaluate(limit=args.batch):
        rows = [drafter.evaluate(state["params"], frozen, held[i:i + args.batch], held_anchors[i:i + args.batch],
                                 graphdef=graphdef, decay=args.decay) for i in range(0, limit - args.batch + 1, args.batch)]
        result = {k: np.mean([np.asarray(r[k]) for r in rows], axis=0).round(4).tolist() for k in ("accept", "tau", "l1")}
        if replay_rows is None:
            return result
        alpha = np.concatenate([replay.sample_acceptance(state["params"], frozen, replay_rows[i:i + args.batch],
                                                         replay_anchors[:len(replay_rows[i:i + args.batch])],
                                                         graphdef=graphdef)
                                for i in range(0, len(replay_rows), args.batch)])
        generation = replay.replayed_generation(jnp.asarray(alpha))
        return {**result, "replay_tau": round(float(generation["tau"]), 4),
                "replay_accept": np.asarray(generation["acceptance"]).round(4).tolist()}

    record = loop.run(step, args.minutes * 60, set_total, evaluate=evaluate, eval_every=args.eval_every)
    heldout = evaluate(len(held))
    z, accept = [], []
    for i in range(0, len(held) - args.batch + 1, args.batch):
        zi, ai = drafter.calibration_data(state["params"], frozen, held[i:i + args.batch],
                                          held_anchors[i:i + args.batch], graphdef=graphdef)
        z.append(np.asarray(zi))
        accept.append(np.asarray(ai))
    z, accept = np.concatenate(z).astype(np.float64), np.concatenate(accept).astype(np.float64)
    temperatures, ece_before, ece_after = sts.fit(z, sts.prefix_accepted(accept, np.random.default_rng(args.seed)))
    config = stored.replace(extra={**stored.extra, "dspark_confidence_temperatures": temperatures})
    out = save_model(Model(*nnx.split(nnx.merge(graphdef, state["params"], frozen))), args.out, config)
    if Path(args.tokenizer).resolve() != (out / "tokenizer.json").resolve():
        shutil.copy(args.tokenizer, out / "tokenizer.json")
    record.update(heldout=heldout, sts={"temperatures": temperatures, "ece_before": ece_before, "ece_after": ece_after},
                  args=vars(args), device=str(jax.devices()[0].device_kind), selfgen_seconds=selfgen_s)
    (out / "train_drafter.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({"heldout": heldout, "sts": record["sts"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
