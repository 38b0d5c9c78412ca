"""Where a cold start-up's compile time goes: the embedded engine's executables (one batch bucket,
prefill, decode, step[0..5]) lowered one after another, each compiled by a pool of N threads as
soon as it is lowered (as the engine does), or by the engine's P compile workers
(`jdspark.engine.compiling`, into an empty temporary store; they log their phases), with the
engine's XLA options (`compiler_options`; XLA_FLAGS overrides them) and no compile cache before.
Prints each program's lowering and compile time (threads: its start and end, to see whether the
compiles overlap) and the wall; `--json` writes them.

    python scripts/compile_probe.py --threads 1      # serial
    python scripts/compile_probe.py --threads 8
    python scripts/compile_probe.py --processes 8
    python scripts/compile_probe.py --threads 8 --implementation xla   # no Pallas kernels
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1 python scripts/compile_probe.py --threads 1 --only decode 5

`--cross-lower LAYERS` instead traces and lowers the Flash-dims extend (FP8 linears + ds_fp4 experts,
abstract weights: nothing is allocated) for CUDA on any machine, its Pallas kernels lowered to Triton
as on the GPU, with the blocks traced once per kind (as the model does, `block.shared_extend`) and one
by one (as before): what the serial lowering of a Flash start-up costs, measurable on a CPU.

    python scripts/compile_probe.py --cross-lower 43 --rows 1 6
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def build(args):
    """(Executables, decode state, draft cache) of the embedded model's 1-slot engine."""
    from jdspark.assets import default_model_dir
    from jdspark.checkpoint.loader import load_model
    from jdspark.config import EngineConfig
    from jdspark.drafter import dspark
    from jdspark.engine.executables import Executables
    from jdspark.engine.widths import compiled_widths
    model = load_model(default_model_dir(), dtype=args.dtype)
    config = EngineConfig(max_seq_len=args.max_seq_len, gamma=model.config.dspark.block_size, max_batch=1,
                          batch_buckets=(1,))
    widths = compiled_widths(model.config, config, True, None, None)
    exe = Executables(model, config, args.prefill_chunk, args.implementation, widths, pack_params=True)
    draft = model.on_devices(dspark.init_draft_cache(model.config, 1, model.dtype))
    return exe, model.init_state(config), draft


def lower(exe, decode, draft, only=()):
    """(key, (lowered, seconds)) for every program (or those named in `only`: "prefill", "decode" or a
    width), one at a time."""
    for key, program in exe.programs(decode, draft).items():
        if only and str(key[1]) not in only:
            continue
        start = time.perf_counter()
        yield key, (exe.lowering(program, decode, draft)(), time.perf_counter() - start)


def run_threads(args) -> dict:
    from jdspark.engine.compiling import compiler_options
    exe, decode, draft = build(args)
    options, rows, futures, origin = compiler_options(exe.config), {}, [], time.perf_counter()

    def compile_one(key, program):
        start = time.perf_counter()
        program.compile(options or None)
        rows[key].update(compile_start_s=start - origin, compile_end_s=time.perf_counter() - origin)

    with ThreadPoolExecutor(args.threads) as pool:
        for key, (program, seconds) in lower(exe, decode, draft, args.only):  # lowered one by one, lazily
            text = program.as_text()
            rows[key] = {"program": str(key), "lower_s": seconds, "hlo_chars": len(text),
                         "triton_calls": text.count("__gpu$xla.gpu.triton")}
            futures.append(pool.submit(compile_one, key, program))
        for future in futures:
            future.result()  # a failed compile raises here
    return {"mode": f"threads={args.threads}", "implementation": args.implementation, "options": options,
            "lower_s": sum(r["lower_s"] for r in rows.values()), "wall_s": time.perf_counter() - origin,
            "programs": list(rows.values())}


def cross_lower(args) -> dict:
    """Seconds to trace and to lower the Flash-dims extend at each of `args.rows`, per way of tracing
    the blocks, with the Pallas calls and the size of the lowered program."""
    import sys
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from flax import nnx
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_decode import STORAGES, make_config, per_layer_extend, random_params

    import pallas_kernels
    from jdspark.config import EngineConfig
    from jdspark.model import dsv4, moe, quantized
    from jdspark.model import state as state_lib
    from jdspark.model.hyper import with_implementation
    from pallas_kernels import rejection_sampler, sinkhorn

    def compiled_mode(interpret=None):  # the kernels as the GPU lowers them, not in interpret mode
        return bool(interpret)
    for module in (pallas_kernels, moe, quantized, sinkhorn, rejection_sampler):
        module.interpret_mode = compiled_mode
    config = make_config("flash", args.cross_lower, None, "fp8+fp4")
    graphdef, params = random_params(config, jnp.bfloat16, STORAGES["fp8+fp4"], skip=lambda path: True)
    graphdef = with_implementation(graphdef, params, "pallas")
    decode = jax.eval_shape(lambda: state_lib.init_state(config, EngineConfig(max_seq_len=4096), jnp.bfloat16))
    shared, rows = dsv4.shared_extend, []
    for name, blocks in (("per_kind", shared), ("per_layer", per_layer_extend)):
        dsv4.shared_extend = blocks
        for s in args.rows:
            def extend(params, decode, ids, n_valid):
                logits, _, new = nnx.merge(graphdef, params).extend(ids, decode, n_valid)
                return logits, new
            ids, n_valid = jax.ShapeDtypeStruct((1, s), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
            start = time.perf_counter()
            traced = jax.jit(extend, donate_argnums=1).trace(params, decode, ids, n_valid)
            middle = time.perf_counter()
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            rows.append({"program": f"extend S={s}", "blocks": name, "trace_s": middle - start,
                         "lower_s": time.perf_counter() - middle, "pallas_calls": text.count("xla.gpu.triton"),
                         "mlir_chars": len(text)})
    dsv4.shared_extend = shared
    return {"mode": f"cross-lower {args.cross_lower} layers for cuda", "jax": jax.__version__, "programs": rows}


def run_processes(args) -> dict:
    """The engine's own compile path with `args.processes` workers, into a fresh temporary store."""
    import jax
    with tempfile.TemporaryDirectory() as folder:
        os.environ["JDSPARK_COMPILE_WORKERS"] = str(args.processes)
        jax.config.update("jax_compilation_cache_dir", folder)
        exe, decode, draft = build(args)
        origin = time.perf_counter()
        exe.compile(decode, draft)
        return {"mode": f"processes={args.processes}", "wall_s": time.perf_counter() - origin,
                "workers_s": exe.worker_seconds, "from_workers": exe.from_workers, "programs": []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int)
    p.add_argument("--processes", type=int)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--implementation", default="auto", choices=("auto", "pallas", "xla"),
                   help="the kernels (xla: every Pallas kernel's jnp reference; what Triton's compiles cost)")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--only", nargs="*", default=[], help="threads: only these programs (prefill, decode, widths)")
    p.add_argument("--cross-lower", type=int, metavar="LAYERS", help="the Flash-dims extend lowered for CUDA")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="--cross-lower: rows S per call")
    p.add_argument("--json")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)  # the workers' phases
    start = time.perf_counter()
    if args.cross_lower:
        result = cross_lower(args)
    else:
        result = run_processes(args) if args.processes else run_threads(args)
    result["total_s"] = time.perf_counter() - start
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    for row in result["programs"]:
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    print({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items() if k != "programs"})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
