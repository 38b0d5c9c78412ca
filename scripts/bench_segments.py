"""A prompt chunk beside a verify block: one `extend_segments` call against the two calls the engine
makes for them today (the verify call, then a prefill call of its own), at real dimensions.

At Flash dimensions a prompt chunk of 64 tokens selects most of a layer's 256 routed experts (64 x 6
choices), and so does a verify block of 16 slots x 6 rows: two calls read them twice, one call once.
This measures what one call saves before the engine is built around it (issue 26: the equal-length
Flash-dims regime at c = 16 loses to target-only by the prefill calls that stall the verify calls).

Builds `bench_decode`'s random model (`--preset`, `--layers`, `--experts`, `--storage`) and a decode
state of B + P slots holding `--context` tokens, then times, queued (calls issued back to back and
synced once, as the overlapped engine issues them), each call rolled back inside its program so the
context stays fixed:
- verify: extend of [B, S] (B slots, S = k + 1 rows each);
- prompt: extend of [P, T] (P slots, a T-token chunk each: a prefill call);
(`--cases BxS+PxT ...`)
- two calls: verify, then prompt;
- one call: `extend_segments` of both.
The prompt chunk's logits are those of its last real token alone, as the engine's prefill calls and
prompt segments compute them (`extend_segments`' `last_logits`).
Per line: ms, the bytes the call(s) must read (`bench_decode`'s floor: non-expert weights once a call,
the distinct routed experts of its rows, the KV they attend to), the floor at the copy bandwidth
measured in the same run, and bandwidth achieved. JSON with `--json`.

    PYTHONPATH=$PWD python scripts/bench_segments.py --preset flash --layers 8 --experts 256 \
        --cases 16x6+1x64 1x6+1x64 --context 4096 --json /tmp/bench_segments.json
    PYTHONPATH=$PWD python scripts/bench_segments.py --preset tiny --cases 2x3+1x5 --context 16 --runs 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import (STORAGES, _seq_len, call_bytes, copy_bandwidth, kv_bytes, make_config,  # noqa: E402
                          model_arguments, param_bytes, random_params)

from jdspark.config import EngineConfig  # noqa: E402
from jdspark.engine.packed import PackedParams  # noqa: E402
from jdspark.model import state as state_lib  # noqa: E402


def segment_bytes(config, sizes, context, shapes, dtype, calls: int) -> float:
    """The floor of `calls` calls over the segments `shapes` [(slots, rows)]: non-expert weights once a
    call, each call's distinct routed experts (one call: of all segments' rows together), the KV."""
    if calls == 1:
        tokens = sum(b * s for b, s in shapes)
        experts = call_bytes(config, sizes, context, 1, tokens, dtype)
        return (experts["weights"] + experts["experts"]
                + sum(kv_bytes(config, context, b, s, dtype) for b, s in shapes))
    return sum(call_bytes(config, sizes, context, b, s, dtype)["total"] for b, s in shapes)


def programs(graphdef, pack: PackedParams, shapes):
    """{variant: its calls}, each jitted f(arrays, states, ids, n_valid) -> (logits, states rolled back)."""
    def extend(arrays, segments, last_logits):
        results = nnx.merge(graphdef, pack.unpack(arrays)).extend_segments(segments, (), last_logits)
        return ([r[0] for r in results],
                [state_lib.commit(r[2], jnp.zeros_like(r[2].length)) for r in results])  # rolled back

    def call(which):
        def run(arrays, states, ids, n_valid):
            logits, new = extend(arrays, tuple((ids[i], states[i], n_valid[i]) for i in which),
                                 tuple(i > 0 for i in which))  # the prompt chunk's logits at its last token
            states = list(states)
            for i, s in zip(which, new):
                states[i] = s
            return logits, states
        return jax.jit(run, donate_argnums=1)

    verify, prompt, both = call((0,)), call((1,)), call((0, 1))
    return {"verify": [verify], "prompt": [prompt], "two calls": [verify, prompt], "one call": [both]}


def time_variant(calls, arrays, states, ids, n_valid, runs: int) -> tuple[float, list]:
    """Median seconds of an iteration (the variant's calls) over 3 rounds of `runs` queued iterations."""
    for call in calls:  # compile and warm up
        logits, states = call(arrays, states, ids, n_valid)
    jax.block_until_ready((logits, states))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(runs):
            for call in calls:
                logits, states = call(arrays, states, ids, n_valid)
        jax.block_until_ready((logits, states))
        rounds.append((time.perf_counter() - start) / runs)
    return statistics.median(rounds), states


def parse_case(text: str) -> list[tuple[int, int]]:
    """'16x6+1x64' -> [(16, 6), (1, 64)]: the verify block's slots x rows, then the prompt chunk's."""
    try:
        shapes = [tuple(int(v) for v in part.split("x")) for part in text.split("+")]
    except ValueError:
        shapes = []
    if len(shapes) != 2 or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected VERIFY_SLOTSxROWS+PROMPT_SLOTSxTOKENS, e.g. 16x6+1x64")
    return shapes


def time_case(graphdef, pack, config, sizes, dtype, shapes, context, runs, bandwidth) -> list[dict]:
    """The four variants of one (verify, prompt) pair of shapes, printed."""
    rng = np.random.default_rng(0)
    ids = [jnp.asarray(rng.integers(0, config.vocab_size, shape), jnp.int32) for shape in shapes]
    n_valid = [jnp.full((b,), s, jnp.int32) for b, s in shapes]
    seq_len = _seq_len(context + max(s for _, s in shapes))
    states = []
    for b, _ in shapes:  # zeros: finite pooled entries; every slot holding `context` tokens
        empty = state_lib.init_state(config, EngineConfig(max_seq_len=seq_len, max_batch=b), dtype)
        states.append(jax.tree.map(jnp.zeros_like, empty).replace(length=jnp.full((b,), context, jnp.int32)))
    case = "+".join(f"{b}x{s}" for b, s in shapes)
    rows = []
    for name, calls in programs(graphdef, pack, shapes).items():
        seconds, states = time_variant(calls, pack.arrays, states, ids, n_valid, runs)
        which = {"verify": shapes[:1], "prompt": shapes[1:]}.get(name, shapes)
        moved = segment_bytes(config, sizes, context, which, dtype, 2 if name == "two calls" else 1)
        floor_ms = moved / bandwidth * 1e3
        rows.append({"case": case, "variant": name, "ms": seconds * 1e3, "bytes": moved, "floor_ms": floor_ms,
                     "bandwidth_achieved": floor_ms / (seconds * 1e3)})
        r = rows[-1]
        print(f"{case:>12} {name:>10} {r['ms']:>9.3f} {moved / 1e6:>9.1f} {floor_ms:>8.3f} "
              f"{r['bandwidth_achieved']:>18.1%}", flush=True)
    ms, floor = ({r["variant"]: r[key] for r in rows} for key in ("ms", "floor_ms"))
    print(f"# {case}: the prompt chunk costs {ms['prompt']:.3f} ms in a call of its own (floor "
          f"{floor['prompt']:.3f}), {ms['one call'] - ms['verify']:.3f} ms inside the verify call (floor "
          f"{floor['one call'] - floor['verify']:.3f}); one call / two calls = {ms['one call'] / ms['two calls']:.2f}",
          flush=True)
    return rows


def main(argv=None) -> list[dict]:
    ap = model_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--cases", type=parse_case, nargs="+", default=[parse_case("16x6+1x64")],
                    help="verify block + prompt chunk shapes, e.g. 16x6+1x64 1x6+1x64 16x6+4x64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth array size (default 2048 GPU, 64 CPU)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    config = make_config(args.preset, args.layers, args.experts, args.storage)
    gpu = jax.default_backend() != "cpu"
    bandwidth = copy_bandwidth((args.copy_mib or (2048 if gpu else 64)) << 20)
    graphdef, params = random_params(config, dtype, STORAGES[args.storage])
    sizes, pack = param_bytes(params), PackedParams(params)
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "preset": args.preset,
              "layers": config.num_hidden_layers, "experts": config.n_routed_experts, "storage": args.storage,
              "context": args.context, "copy_bandwidth_GBps": bandwidth / 1e9, "rows": []}
    print(f"# {report['device']}: {args.preset} dims, {config.num_hidden_layers} layers, {config.n_routed_experts} "
          f"experts, {args.storage}, context {args.context}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; queued calls")
    print(f"{'case':>12} {'variant':>10} {'ms':>9} {'MB floor':>9} {'floor ms':>8} {'bandwidth achieved':>18}")
    for shapes in args.cases:
        report["rows"] += time_case(graphdef, pack, config, sizes, dtype, shapes, args.context, args.runs, bandwidth)
        if args.json:  # after every case: a run cut short keeps what it measured
            args.json.write_text(json.dumps(report, indent=1))
    return report["rows"]


if __name__ == "__main__":
    sys.exit(main() and 0)
