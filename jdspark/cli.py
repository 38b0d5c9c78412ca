"""`jdspark` command line. Errors print one line naming the problem and exit with code 2."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _info(args) -> int:
    from jdspark.checkpoint.loader import read_config
    config = read_config(args.checkpoint)
    print(json.dumps(config.to_dict(), indent=2))
    return 0


def _logits(args) -> int:
    from jdspark.checkpoint.loader import load_model
    model = load_model(args.checkpoint, dtype=args.dtype)
    ids = [int(t) for t in args.tokens.split(",")]
    logits = model.logits(ids)
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[: args.top]
        print(pos, ids[pos], " ".join(f"{t}:{row[t]:.4f}" for t in top))
    return 0


def _convert(args) -> int:
    from jdspark.checkpoint.loader import convert
    dst = convert(args.src, args.dst, dtype=args.dtype, dequantize=args.dequantize)
    print(f"wrote {dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jdspark", description="DeepSeek-V4 serving engine (JAX/Pallas)")
    parser.add_argument("--version", action="version", version="jdspark 0.1.0")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print a checkpoint's parsed config (HF vocabulary)")
    p.add_argument("checkpoint")
    p.set_defaults(run=_info)
    p = sub.add_parser("logits", help="full-sequence forward of comma-separated token ids; top-k per position")
    p.add_argument("checkpoint")
    p.add_argument("tokens", help="e.g. 0,17,42")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--top", type=int, default=5)
    p.set_defaults(run=_logits)
    p = sub.add_parser("convert", help="convert a checkpoint to the orbax format of the in-memory layout "
                                       "(faster start; load_model restores it directly)")
    p.add_argument("src", help="checkpoint directory (safetensors, official or transformers names)")
    p.add_argument("dst", help="new output directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dequantize", action="store_true", help="store FP8 / FP4 weights expanded to --dtype")
    p.set_defaults(run=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        print(f"jdspark {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
