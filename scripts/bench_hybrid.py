"""One decode step of a Flash-dimension model with part of its routed experts in host banks.

Builds the random model of `bench_decode.py` (weights drawn on the device, `--layers`, `--experts`,
`--storage`), times `extend` at S rows with every expert on the device, then moves a fraction
`--host-experts` of the experts of each of the first `--host-layers` layers to host banks
(`jdspark.experts.hybrid.with_host_experts`) and times it again, once per host path in `--via`
(the XLA FFI custom call, `ffi`, and the `jax.pure_callback`, `callback`; the same banks). Each
layer's host part counts its own seconds (plan + CPU GEMV) and the distinct host experts it read
(`HybridExperts.host_stats`), so the host part is reported against its bytes at the host read
bandwidth measured in the same run (`host_probes.host_read`): `host_vs_read` = host ms / (bytes / read
bandwidth), the issue's done-when asks <= 1.3. `round_trip_ms` = hybrid - all-device - host GEMV,
per host layer: what a host call costs beyond its GEMV (transfers, synchronisation, the Python call
of a callback); `empty_callback_ms` is the same for a pure_callback that does nothing, in a chain of
small products. "queued" times calls issued back to back (the engine's overlapped steps).

    PYTHONPATH=$PWD python scripts/bench_hybrid.py --layers 8 --host-experts 0.5 --rows 1 6 --json /tmp/h.json
    PYTHONPATH=$PWD python scripts/bench_hybrid.py --preset tiny --layers 2 --rows 1 --runs 3   # CPU smoke test
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
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import STORAGES, make_config, model_arguments, random_params, time_extend  # noqa: E402

from jdspark.config import EngineConfig  # noqa: E402
from jdspark.experts import cpu_gemv, host_probes  # noqa: E402
from jdspark.experts.hybrid import HybridExperts, with_host_experts  # noqa: E402
from jdspark.model.model import Model  # noqa: E402


def hybrid_params(model: Model, fraction: float, n_layers: int, seed: int, via: str):
    """(graphdef, params, hybrid layers) of `model` with `fraction` of each of its first n_layers
    layers' experts (random ones, the same for every `via`) in host banks."""
    e = model.config.n_routed_experts
    rng = np.random.default_rng(seed)
    host = {layer: np.sort(rng.choice(e, max(1, round(fraction * e)), replace=False)).tolist()
            for layer in range(n_layers)}
    module = with_host_experts(model, host, via=via).module()
    layers = [node for _, node in nnx.iter_graph(module) if isinstance(node, HybridExperts)]
    graphdef, params = nnx.split(module)
    return graphdef, params, layers


def host_seconds(layers, reset: bool = True) -> tuple[float, float]:
    """(median seconds of one layer's host call, mean distinct host experts per call) since the last reset."""
    counts = [layer.host_stats(reset=reset) for layer in layers]
    calls = sum(c["calls"] for c in counts)
    return sum(c["seconds"] for c in counts) / max(calls, 1), sum(c["experts"] for c in counts) / max(calls, 1)


def callback_round_trip_ms(layers: int = 8, runs: int = 20) -> float:
    """ms per pure_callback that does nothing, in a chain of `layers` [1, 4096] x [4096, 4096] bf16
    products each followed by one (against the same chain without them)."""
    w = jax.random.normal(jax.random.key(0), (4096, 4096), jax.numpy.bfloat16) * 0.01
    x = jax.numpy.ones((1, 4096), jax.numpy.bfloat16)

    def chain(callback):
        def f(x, w):
            for _ in range(layers):
                x = x @ w
                if callback:
                    x = jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return x
        return jax.jit(f)

    times = []
    for fn in (chain(False), chain(True)):
        fn(x, w).block_until_ready()
        calls = []
        for _ in range(runs):
            start = time.perf_counter()
            fn(x, w).block_until_ready()
            calls.append(time.perf_counter() - start)
        times.append(statistics.median(calls))
    return (times[1] - times[0]) / layers * 1e3


def measure(args) -> dict:
    config = make_config(args.preset, args.layers, args.experts, args.storage)
    dtype = jax.numpy.dtype(args.dtype)
    graphdef, params = random_params(config, dtype, STORAGES[args.storage])
    engine = EngineConfig(max_seq_len=args.context + 16, gamma=5, max_batch=1)
    n_host = min(args.host_layers or config.num_hidden_layers, config.num_hidden_layers)
    threads = args.threads or cpu_gemv.default_threads()
    read = host_probes.host_read(args.read_mb << 20, threads, 5)
    out = {"config": dict(preset=args.preset, layers=config.num_hidden_layers, experts=config.n_routed_experts,
                          storage=args.storage, host_experts=args.host_experts, host_layers=n_host,
                          context=args.context, threads=threads, device=str(jax.devices()[0].device_kind)),
           "host_read_GBps": read["GBps"], "empty_callback_ms": callback_round_trip_ms(), "rows": []}
    device = {rows: time_extend(graphdef, params, config, engine, dtype, 1, rows, args.context, args.runs)[0][:2]
              for rows in args.rows}
    for via in args.via:
        h_graphdef, h_params, layers = hybrid_params(Model(graphdef, params), args.host_experts, n_host, args.seed, via)
        expert_bytes = layers[0].bank.weight_nbytes
        for rows in args.rows:
            host_seconds(layers)
            (hybrid_ms, queued_ms, _), = time_extend(h_graphdef, h_params, config, engine, dtype, 1, rows,
                                                     args.context, args.runs)
            per_call, experts = host_seconds(layers)
            host_ms, host_bytes = per_call * 1e3 * n_host, experts * expert_bytes * n_host
            floor_ms = host_bytes / (read["GBps"] * 1e9) * 1e3
            out["rows"].append(dict(via=via, rows=rows, device_ms=device[rows][0], device_queued_ms=device[rows][1],
                                    hybrid_ms=hybrid_ms, hybrid_queued_ms=queued_ms, host_gemv_ms=host_ms,
                                    host_MB=host_bytes / 1e6, host_GBps=host_bytes / host_ms / 1e6,
                                    host_vs_read=host_ms / floor_ms,
                                    round_trip_ms=(hybrid_ms - device[rows][0] - host_ms) / n_host))
        del h_params, layers
    return out


def main(argv=None) -> dict:
    ap = model_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--host-experts", type=float, default=0.5, help="share of a host layer's experts on the host")
    ap.add_argument("--host-layers", type=int, default=None, help="layers with host experts (default: all)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--read-mb", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--via", nargs="+", choices=["ffi", "callback"], default=["ffi", "callback"],
                    help="host paths to time, in this order, on the same banks")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 0 < args.host_experts <= 1:
        ap.error(f"--host-experts {args.host_experts}: expected a share in (0, 1]")
    res = measure(args)
    print(f"{res['config']}\nhost read {res['host_read_GBps']:.1f} GB/s, an empty callback "
          f"{res['empty_callback_ms']:.3f} ms")
    print("via       rows  device ms (queued)  hybrid ms (queued)  host GEMV ms  host MB  host GB/s  host/read-floor  "
          "round trip ms/layer")
    for r in res["rows"]:
        print(f"{r['via']:8} {r['rows']:5d} {r['device_ms']:9.2f} ({r['device_queued_ms']:6.2f}) "
              f"{r['hybrid_ms']:9.2f} ({r['hybrid_queued_ms']:6.2f}) {r['host_gemv_ms']:13.2f} {r['host_MB']:8.1f} "
              f"{r['host_GBps']:10.1f} {r['host_vs_read']:16.2f} {r['round_trip_ms']:20.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
