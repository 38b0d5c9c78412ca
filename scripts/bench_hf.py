"""huggingface transformers' DeepseekV4 decoding the same random model as `scripts/bench_decode.py`:
the peer that issue 23's "5x faster than transformers" is measured against (run it in the same
device call as bench_decode, one process after the other: JAX and PyTorch each take the GPU).

Builds `DeepseekV4ForCausalLM` (eager attention, bfloat16, on the GPU) for bench_decode's config
(`--preset --layers --experts`, storage bf16 only: transformers has no FP8 / ds_fp4 path),
prefills `--context` tokens into its cache, then times one-token decode steps (median of `--runs`,
synchronised) and writes JSON.

    python scripts/bench_hf.py --preset flash --layers 8 --experts 64 --context 4096 --json /tmp/hf.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_decode's model options
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.model.hf_oracle

import torch  # noqa: E402

from bench_decode import make_config, model_arguments  # noqa: E402
from tests.model.hf_oracle import hf_config  # noqa: E402


def main(argv=None) -> dict:
    ap = model_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    args = ap.parse_args(argv)
    if args.storage != "bf16":
        ap.error("transformers runs bfloat16 weights only: --storage bf16")
    from transformers import DeepseekV4ForCausalLM
    config = make_config(args.preset, args.layers, args.experts, "bf16")
    torch.set_default_dtype(torch.bfloat16)
    start = time.perf_counter()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.device(args.device):
        model = DeepseekV4ForCausalLM(hf_config(config)).eval()
    init_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.context + args.runs + 3), device=args.device, generator=gen)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "preset": args.preset,
              "layers": config.num_hidden_layers, "experts": config.n_routed_experts, "params": params,
              "context": args.context, "init_s": init_s}
    with torch.no_grad():
        out = None
        for begin in range(0, args.context, args.prefill_chunk):  # chunked prefill into the cache
            chunk = ids[:, begin:min(begin + args.prefill_chunk, args.context)]
            out = model(chunk, past_key_values=None if out is None else out.past_key_values, use_cache=True)
        cache = out.past_key_values
        times = []
        for i in range(args.runs + 3):
            sync()
            t0 = time.perf_counter()
            out = model(ids[:, args.context + i:args.context + i + 1], past_key_values=cache, use_cache=True)
            sync()
            cache = out.past_key_values
            if i >= 3:
                times.append(time.perf_counter() - t0)
    report["ms"] = statistics.median(times) * 1e3
    report["tok_s"] = 1e3 / report["ms"]
    print(f"# transformers {report['device']}: {args.preset} dims, {config.num_hidden_layers} layers, "
          f"{config.n_routed_experts} experts, bf16, {params / 1e9:.2f} B params, context {args.context}: "
          f"decode {report['ms']:.2f} ms/token ({report['tok_s']:.1f} tok/s, median of {args.runs})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
