"""`jdspark` command line. Errors print one line naming the problem and exit with code 2."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from jdspark.engine.options import BATCH_WIDTHS, RIDE_PROMPTS


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


def _model_dir(args) -> str:
    """--model, or the embedded default model (FileNotFoundError, naming --model, if it is missing)."""
    from jdspark.assets import default_model_dir
    return args.model if args.model is not None else str(default_model_dir())


def _int_list(text: str) -> tuple[int, ...]:
    """An option's comma-separated integers (argparse names the option when they are not)."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,4,16") from None


def _generator(args, max_batch: int = 1, defer_steps: bool = False):
    from jdspark.engine.engine import SpecOptions
    from jdspark.engine.executables import enable_compile_cache
    from jdspark.generator import Generator
    from jdspark.parallel import distributed
    distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    model = _model_dir(args)
    enable_compile_cache()
    width = None if args.width == "adaptive" else int(args.width)
    options = SpecOptions(width=width, fallback_threshold=args.fallback_acceptance,
                          fallback_min_drafted=args.fallback_min_drafted, fallback_cooldown=args.fallback_steps,
                          reprofile=args.reprofile, log_every=args.log_every, batch_widths=args.batch_widths,
                          pause_steps=args.pause_steps)
    generator = Generator.from_pretrained(model, speculative=args.speculative, gamma=args.gamma, dtype=args.dtype,
                                          max_seq_len=args.max_seq_len, max_batch=max_batch, options=options,
                                          widths=args.widths, batch_buckets=args.batch_buckets or (),
                                          prefill_buckets=args.prefill_buckets or (), defer_steps=defer_steps,
                                          prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                                          tensor_parallel_size=args.tensor_parallel_size,
                                          expert_parallel_size=args.expert_parallel_size,
                                          gpu_memory=None if args.gpu_memory is None else args.gpu_memory * 1e9,
                                          pcie_share=args.pcie_share, prompt_segment=args.prompt_segment)
    generator.engine.batch_prefills, generator.engine.ride_prompts = args.prefill_wait, args.ride_prompts
    return generator


def _prompt_and_params(args):
    from jdspark.engine.request import SamplingParams
    prompt = [int(t) for t in args.prompt.split(",")] if args.ids else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
    return prompt, params


def _generate(args) -> int:
    import jax
    prompt, params = _prompt_and_params(args)
    generator = _generator(args)
    show = jax.process_index() == 0  # every process runs the same steps; process 0 prints them
    run = generator.run(prompt, params)
    for delta in run:
        if show:
            print(delta, end="", flush=True)
    completion = run.completion
    if not show:
        return 0
    print("" if completion.text is not None else ",".join(map(str, completion.token_ids)))
    if args.stats:
        print(json.dumps(completion.stats.as_dict(), indent=1), file=sys.stderr)
    return 0


def _profile(args) -> int:
    from jdspark.profile import profile
    prompt, params = _prompt_and_params(args)
    generator = _generator(args)
    report = profile(generator, prompt, params, args.out)
    stats = report["stats"]
    print(f"{stats['generated_tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, tau {stats['tau']:.2f}; "
          f"wrote {args.out}/trace, profile.json, profile.png")
    return 0


def _serve(args) -> int:
    import logging
    from pathlib import Path

    import jax
    import uvicorn

    from jdspark.server.app import create_app
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    generator = _generator(args, max_batch=args.max_running, defer_steps=args.defer_speculation)
    if jax.process_count() > 1:
        raise ValueError("serve runs in one process (it can use every GPU of its host: --tp / --ep); across "
                         "processes the other processes would need the scheduler's requests, which is not built")
    if generator.tokenizer is None:
        raise ValueError(f"{_model_dir(args)} has no tokenizer.json; the server needs one to read and write text")
    name = args.served_model_name or Path(_model_dir(args)).name
    app = create_app(generator.engine, generator.tokenizer, name, api_key=args.api_key, max_queue=args.max_queue)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="text, or comma-separated token ids with --ids")
    p.add_argument("--ids", action="store_true", help="the prompt is comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    _add_engine_options(p)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=True,
                   help="DSpark speculative decoding (--no-speculative: target only)")
    p.add_argument("--gamma", type=int, help="draft block size (default: the drafter's)")
    p.add_argument("--width", default="adaptive", help="verify width 0..gamma, or 'adaptive' (default)")
    p.add_argument("--widths", type=_int_list, help="comma-separated widths to compile, e.g. 0,2,5 (default: 0..gamma for the "
                                    "adaptive width, the fixed --width alone; a row's width rounds up to one)")
    p.add_argument("--batch-widths", default="per_request", choices=BATCH_WIDTHS,
                   help="how a batch's rows get widths: their own (per_request), the batch's largest (padded), "
                        "or within the step's token budget (budget)")
    p.add_argument("--batch-buckets", type=_int_list, help="comma-separated batch sizes to compile, the largest the slot count "
                                           "(default: powers of 4 below it, and it)")
    p.add_argument("--prefill-buckets", type=_int_list,
                   help="comma-separated batch sizes of the prefill executables, the largest the slot count (default: "
                        "--batch-buckets'); small ones make prompts that come a few at a time cheap to prefill")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens one prefill row takes per call")
    p.add_argument("--prefill-budget", type=int,
                   help="prompt tokens one step prefills beside running requests, whole chunks (default: a chunk of "
                        "every pending prompt on a GPU, one chunk on the CPU)")
    p.add_argument("--no-prefill-wait", dest="prefill_wait", action="store_false",
                   help="prefill new prompts at the next step; by default, where the engine measured its calls' "
                        "costs (adaptive widths), a prefill call beside running requests waits for more prompts to "
                        "share it while their waits cost less than the stall of the running ones that sharing "
                        "saves, each at most 8 such savings, and only where prompts come often enough for that "
                        "(without it: a shorter time to first token, less throughput and longer inter-token gaps "
                        "under load)")
    p.add_argument("--ride-prompts", type=int, default=RIDE_PROMPTS,
                   help="beside running requests, prompts with at most this many tokens left ride in the verify calls, "
                        "the step's width + 1 tokens a call, instead of taking prefill calls of their own (0: never)")
    p.add_argument("--prompt-segment", type=int, default=0,
                   help="beside running requests, the oldest pending prompt comes in the verify call, this many tokens "
                        "a call, in the same model pass (executables compiled with the segment; at least gamma + 1; "
                        "0: never; while on, no prompt rides)")
    p.add_argument("--fallback-acceptance", type=float, default=0.0,
                   help="acceptance breaker threshold in (0, 1]; 0 disables (reference starting point: 0.60)")
    p.add_argument("--fallback-min-drafted", type=int, default=32)
    p.add_argument("--fallback-steps", type=int, default=64)
    p.add_argument("--pause-steps", type=int, default=32,
                   help="adaptive widths: steps a request decodes without drafting when drafting does not pay on its "
                        "confidences, before it drafts again; doubled for each further pause, up to 32x (0: never pause)")
    p.add_argument("--gpu-memory", type=float,
                   help="GB of weights on the one GPU: the routed experts beyond it live in host memory and run "
                        "on the CPU (the placement is logged; a safetensors checkpoint)")
    p.add_argument("--pcie-share", type=float, default=None,
                   help="with --gpu-memory: the share of a step's host experts the GPU reads over PCIe, the rest "
                        "on the CPU (default: 1/3 on a CUDA GPU, 0 elsewhere)")
    p.add_argument("--reprofile", action="store_true", help="measure V(k) again instead of using the cache")
    p.add_argument("--log-every", type=int, default=0, help="engine log line every N steps")
    _add_parallel_options(p)


def _add_parallel_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="devices the attention heads, output groups, vocabulary and expert width are split over")
    p.add_argument("--expert-parallel-size", "--ep", type=int, default=1,
                   help="devices the routed experts are split over (tp x ep devices in all)")
    p.add_argument("--coordinator-address", help="HOST:PORT of process 0, to run as one of several processes "
                                                 "(jax.distributed; default $JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=int, help="processes in all (default $JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's id, 0..num_processes-1 (default $JAX_PROCESS_ID)")


def _convert(args) -> int:
    from jdspark.checkpoint.loader import convert
    dst = convert(args.src, args.dst, dtype=args.dtype, dequantize=args.dequantize)
    print(f"wrote {dst}")
    return 0


def _bench(args) -> int:
    from jdspark.experts import bench_bw
    return bench_bw.main(args.options)


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
    p = sub.add_parser("generate", help="generate a continuation (streams text when there is a tokenizer)")
    _add_generation_options(p)
    p.add_argument("--stats", action="store_true", help="print the completion's statistics as JSON on stderr")
    p.set_defaults(run=_generate)
    p = sub.add_parser("profile", help="generate under jax.profiler; write trace, costs/decisions JSON and a plot")
    _add_generation_options(p)
    p.add_argument("--out", default="profile_out")
    p.set_defaults(run=_profile)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /health, /metrics)")
    _add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-running", type=int, default=8, help="requests decoded together (engine slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model directory's name)")
    p.add_argument("--defer-speculation", action=argparse.BooleanOptionalAction, default=True,
                   help="serve target-only as soon as the prefill and decode executables are ready, and speculate "
                        "once the step executables, built in the background, are (default; they take one more "
                        "decode state meanwhile)")
    p.set_defaults(run=_serve)
    p = sub.add_parser("convert", help="convert a checkpoint to the orbax format of the in-memory layout "
                                       "(faster start; load_model restores it directly)")
    p.add_argument("src", help="checkpoint directory (safetensors, official or transformers names)")
    p.add_argument("dst", help="new output directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dequantize", action="store_true", help="store FP8 / FP4 weights expanded to --dtype")
    p.set_defaults(run=_convert)
    p = sub.add_parser("bench", help="benchmarks: `jdspark bench bw [--json PATH]` measures host read, PCIe and "
                                     "the CPU / GPU expert GEMV (its own --help)")
    p.add_argument("name", choices=["bw"])
    p.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(run=_bench)
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
