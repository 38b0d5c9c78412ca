"""Train the embedded model's DSV4 target on the code corpus, time-bounded (one GPU, minutes).

    python scripts/train_target.py --corpus build/corpus --minutes 3.5 --out build/tiny-code-target

Every DSV4 feature is on (`tiny_code_config`): mHC, SWA, CSA + indexer, HCA, hash layers, MoE with
a shared expert. Hand-written AdamW, cosine schedule fitted to the time budget. At the end the
held-out loss is measured for the float weights and for the official storage formats (FP8 linears
with ds_fp4 or FP8 experts, values quantized and dequantized); the checkpoint is written in the
official layout with ds_fp4 experts when they cost at most --fp4-tolerance nats/token, else FP8.
Writes <out>/ (config.json, model.safetensors) and <out>/train_target.json. With --init DIR training
continues from that checkpoint (its config; its drafter stages are saved unchanged), e.g. the
shipped model on a larger corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.checkpoint.export import save_model
from jdspark.checkpoint.loader import load_model, read_config
from jdspark.checkpoint.quantize import roundtrip
from jdspark.config import QuantConfig, tiny_code_config
from jdspark.model.dsv4 import DSV4
from jdspark.model.layers import Keys
from jdspark.model.model import Model
from jdspark.model.quantized import Storage
from jdspark.train import adamw, loop, target
from jdspark.train.data import Batches, heldout_windows


def quantized_values(state: nnx.State, storage: Storage) -> nnx.State:
    """A copy of `state` whose parameters hold what `storage` would store (quantized, dequantized)."""
    pure = nnx.to_pure_dict(state)
    flat = jax.tree_util.tree_flatten_with_path(pure)
    leaves = [jnp.asarray(roundtrip(tuple(k.key for k in kp), np.asarray(v), storage), v.dtype)
              if jnp.issubdtype(v.dtype, jnp.floating) else v for kp, v in flat[0]]
    copy = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(copy, jax.tree_util.tree_unflatten(flat[1], leaves))
    return copy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="build/corpus")
    p.add_argument("--out", default="build/tiny-code-target")
    p.add_argument("--minutes", type=float, default=3.5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-windows", type=int, default=384)
    p.add_argument("--fp4-tolerance", type=float, default=0.03, help="nats/token ds_fp4 experts may cost")
    p.add_argument("--init", default=None, help="continue from this checkpoint instead of a fresh tiny_code_config")
    args = p.parse_args(argv)
    corpus = Path(args.corpus)
    if args.init:
        config = read_config(args.init)
        module = load_model(args.init, dtype="float32", dequantize=True, progress=False).module()
    else:
        config = tiny_code_config()
        module = DSV4(config, dtype=jnp.float32, rngs=Keys(args.seed))
    graphdef, trainable, frozen = target.split(module)
    opt_config = adamw.AdamWConfig(lr=args.lr, warmup_steps=args.warmup)
    opt = adamw.init(trainable, total_steps=10 ** 6)
    batches = Batches(np.load(corpus / "train.npy"), args.batch, args.seq_len, seed=args.seed)
    held = heldout_windows(np.load(corpus / "heldout.npy"), args.seq_len, args.heldout_windows)
    state = {"params": trainable, "opt": opt}

    def step(i):
        state["params"], state["opt"], info = target.train_step(state["params"], frozen, state["opt"],
                                                                batches.next(), graphdef=graphdef, config=opt_config)
        return info

    def set_total(total):
        state["opt"] = state["opt"].replace(total_steps=jnp.asarray(total, jnp.int32))

    def evaluate():
        return {"loss": round(target.heldout_loss(state["params"], frozen, graphdef, held[:args.batch], args.batch), 4)}

    record = loop.run(step, args.minutes * 60, set_total, evaluate=evaluate, eval_every=500)
    trainable = state["params"]
    start = time.perf_counter()
    losses = {"float32": target.heldout_loss(trainable, frozen, graphdef, held, args.batch)}
    for experts in ("fp4", "fp8"):
        quantized = quantized_values(trainable, Storage(linears="fp8", experts=experts))
        losses[f"fp8_linears_{experts}_experts"] = target.heldout_loss(quantized, frozen, graphdef, held, args.batch)
    experts = "fp4" if losses["fp8_linears_fp4_experts"] - losses["float32"] <= args.fp4_tolerance else "fp8"
    stored = config.replace(quantization=QuantConfig(), expert_dtype=experts)
    path = save_model(Model(*nnx.split(nnx.merge(graphdef, trainable, frozen))), args.out, stored)
    record.update(config=stored.to_dict(), heldout_loss=losses, heldout_perplexity={k: float(np.exp(v)) for k, v in losses.items()},
                  heldout_tokens=int(held.size - len(held)), expert_format=experts, train_tokens_seen=record["steps"] * args.batch * args.seq_len,
                  eval_s=time.perf_counter() - start, args=vars(args), device=str(jax.devices()[0].device_kind))
    (path / "train_target.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("steps", "heldout_loss", "heldout_perplexity", "expert_format")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
