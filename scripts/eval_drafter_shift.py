"""Does the drafter meet a different distribution when serving? Teacher-forced acceptance on held-out
code vs on the target's own samples after the same prompts.

    python scripts/eval_drafter_shift.py [--model DIR] --corpus build/corpus [--windows 8]

For each of --windows held-out windows: the first --prompt-tokens tokens are the prompt; the rest
is (a) the real code and (b) the target's continuation sampled through the engine at T = 1. The
drafter is then scored teacher-forced (`jdspark.train.drafter.evaluate`: 1 - TV per position at
T = 1, tau_prob) with --anchors blocks per row in the continuation only. Equal numbers mean the
drafter transfers to what it meets when serving; lower numbers on (b) would call for training on
target samples (`scripts/train_drafter.py --selfgen-sequences`). Prints both, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.assets import default_model_dir
from jdspark.checkpoint.loader import load_model
from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine
from jdspark.train import drafter, selfgen
from jdspark.train.data import heldout_windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--corpus", default="build/corpus")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="drafter_shift.json")
    args = p.parse_args(argv)
    model = load_model(Path(args.model) if args.model else default_model_dir(), dtype="float32", dequantize=True,
                       progress=False)
    gamma = model.config.dspark.block_size
    real = heldout_windows(np.load(Path(args.corpus) / "heldout.npy"), args.seq_len, args.windows)[:, :-1]
    engine = Engine(model, EngineConfig(max_seq_len=args.seq_len + gamma + 1, gamma=gamma, max_batch=len(real)),
                    speculative=False, prefill_chunk=args.prompt_tokens)
    sampled = selfgen.sample_continuations(engine, real[:, :args.prompt_tokens], args.seq_len - args.prompt_tokens,
                                           1.0, seed=args.seed)
    graphdef, params, frozen = nnx.split(model.module(), drafter.DRAFTER, ...)
    anchors = drafter.sample_anchors(np.random.default_rng(args.seed), len(real), args.seq_len, gamma, args.anchors,
                                     low=args.prompt_tokens)
    result = {"args": vars(args)}
    for name, ids in (("held-out code", real), ("target samples (T=1)", sampled)):
        info = drafter.evaluate(params, frozen, jnp.asarray(ids), jnp.asarray(anchors), graphdef=graphdef)
        result[name] = {"accept": np.asarray(info["accept"]).round(4).tolist(), "tau_prob": round(float(info["tau"]), 4)}
        print(f"{name:22s} tau_prob {result[name]['tau_prob']:.3f}  accept {result[name]['accept']}")
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
