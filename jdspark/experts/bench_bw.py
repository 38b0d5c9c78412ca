"""`jdspark bench bw`: the bandwidths the host expert pool's split is decided from.

Measures, in one run:
- host read bandwidth: a multi-threaded streaming sum over a buffer well past the last-level cache
  (the C++ kernel's `jds_read_sum`; numpy's sum when the kernel cannot be built);
- PCIe host -> device copies (pageable and pinned_host), when JAX sees a GPU;
- the CPU routed-expert forward (`cpu_gemv.moe_forward`) at rows 1..6 for each expert format, at
  Flash expert dims by default (D 4096, F 2048): K = 6 experts per row drawn from a bank far larger
  than the caches, each call a fresh draw; GBps = bytes of the distinct experts read / time. The
  numba backend is timed beside the C++ one (at rows 1 by default). `--dtype` is the model's
  (default bfloat16, a served checkpoint's: bf16 inputs, which ds_fp4 multiplies by vdpbf16ps where
  the CPU has it; float32 times the fp32 decoders);
- the GPU routed-expert kernel (pallas_kernels.moe) at the same dims, when JAX sees a GPU: over
  experts in device memory, and over experts read in place from pinned host memory over PCIe
  (`jdspark.experts.mapped`, the PCIe share of a hybrid layer);
- both shares at once: the CPU GEMV (one thread fewer) in a thread while the GPU kernel reads host
  experts, each rate measured as the other runs; their ratio is the q* split of a hybrid layer
  (`hybrid.CUDA_PCIE_SHARE`: q = GPU / (GPU + CPU)).

Figures are per-call medians, with each call's time and the shares of the machine's CPU time that
other guests (steal) and other processes took meanwhile (on the H200's host whole sweeps ran 10x
slow at random). Prints a table; `--json PATH` writes
{"host_read_GBps", "cpu_gemv": [{"format", "rows", "GBps", ...}], ...}. On a shared machine the
figures are noisy: the read test and the GEMV run back to back so their ratio is the robust number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

from jdspark.experts import cpu_gemv, host_probes
from jdspark.experts.banks import random_bank

log = logging.getLogger(__name__)
FORMATS = {"fp4": ("fp4", "e8m0"), "fp8": ("fp8", "e8m0"), "fp8-f32": ("fp8", "float32"), "bf16": ("bf16", "e8m0")}
TOP_K = 6


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jdspark bench bw", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--dim", type=int, default=4096, help="model width D (default: Flash, 4096)")
    p.add_argument("--inter", type=int, default=2048, help="expert width F (default: Flash, 2048)")
    p.add_argument("--formats", default="fp4,fp8,bf16", help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--rows", default="1-6", help="row counts of the CPU GEMV sweep, e.g. 1-6 or 1,2,6")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the CPUs this process may use)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (default 5)")
    p.add_argument("--bank-experts", type=int, default=32, help="experts per benchmark bank (default 32)")
    p.add_argument("--read-mb", type=int, default=None, help="read-test buffer in MiB (default 1024, 256 below 32 GiB RAM)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the model dtype the GEMV rounds as (default bfloat16, a served model's: bf16 inputs, "
                        "which ds_fp4 multiplies by vdpbf16ps where the CPU has it)")
    p.add_argument("--numba-rows", default="1", help="row counts also timed with the numba backend ('' for none)")
    p.add_argument("--no-gpu", action="store_true", help="skip the PCIe and GPU parts even with a GPU")
    return p


# ------------------------------------------------------------------------------------------------
# CPU GEMV


def cpu_gemv_sweep(fmt_name: str, dim: int, inter: int, rows_list, *, threads: int, repeats: int,
                   bank_experts: int, backends: dict[str, set[int]], dtype: str = "bfloat16",
                   seed: int = 0) -> list[dict]:
    fmt, scale = FORMATS[fmt_name]
    n_bank = max(bank_experts, TOP_K)
    t0 = time.perf_counter()
    bank = random_bank(fmt, dim, inter, n_bank, scale_dtype=scale, seed=seed)
    log.info("bank %s filled in %.1f s", bank.describe(), time.perf_counter() - t0)
    rng = np.random.default_rng(seed)
    per_expert = bank.weight_nbytes
    results = []
    for backend, backend_rows in backends.items():
        for rows in rows_list:
            if rows not in backend_rows:
                continue
            calls, ticks = [], host_probes.cpu_ticks()
            for it in range(repeats + 1):  # the first call warms up (and compiles numba)
                ids = np.stack([rng.choice(n_bank, TOP_K, replace=False) for _ in range(rows)])
                x = rng.standard_normal((rows, dim)).astype(np.float32)
                w = rng.uniform(0.05, 0.5, (rows, TOP_K)).astype(np.float32)
                t = time.perf_counter()
                cpu_gemv.moe_forward(bank, x, ids, w, limit=10.0, dtype=dtype, threads=threads, backend=backend)
                dt = time.perf_counter() - t
                if it:
                    calls.append((len(np.unique(ids)) * per_expert, dt))
            rates = [b / t / 1e9 for b, t in calls]
            results.append({"format": fmt_name, "rows": rows, "dtype": dtype, "GBps": float(np.median(rates)),
                            "best_GBps": float(max(rates)), "backend": backend,
                            "ms": float(np.median([t for _, t in calls]) * 1e3),
                            "calls_ms": [round(t * 1e3, 3) for _, t in calls],
                            **host_probes.interference(ticks, host_probes.cpu_ticks()),
                            "experts": float(np.mean([b for b, _ in calls]) / per_expert),
                            "expert_bytes": per_expert})
    del bank
    return results


# ------------------------------------------------------------------------------------------------
# GPU parts (only where JAX sees a GPU)


def _gpu():
    try:
        import jax
        gpus = jax.devices("gpu")
        return gpus[0] if gpus else None
    except Exception:  # noqa: BLE001 - no GPU backend at all
        return None


def pcie_h2d(gpu, sizes_mb=(1, 16, 256, 1024), repeats: int = 5) -> list[dict]:
    import jax
    from jax.sharding import SingleDeviceSharding
    out = []
    for mb in sizes_mb:
        a = np.ones(mb << 20, np.uint8)
        kinds = {"pageable": None}
        try:
            kinds["pinned_host"] = jax.device_put(a, SingleDeviceSharding(gpu, memory_kind="pinned_host"))
        except Exception as e:  # noqa: BLE001
            log.info("pinned_host not available: %s", e)
        for kind, src in kinds.items():
            dst = SingleDeviceSharding(gpu, memory_kind="device") if src is not None else gpu
            value = a if src is None else src
            jax.device_put(value, dst).block_until_ready()
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                jax.device_put(value, dst).block_until_ready()
                ts.append(time.perf_counter() - t)
            out.append({"kind": kind, "MiB": mb, "GBps": (mb << 20) / float(np.median(ts)) / 1e9})
    return out


def gpu_gemv_sweep(fmt_name: str, dim: int, inter: int, rows_list, *, bank_experts: int, repeats: int,
                   interpret: bool = False, device=None, source: str = "device") -> list[dict]:
    """The GPU routed-expert kernel (pallas_kernels.moe) on random stored experts at these dims, in
    device memory (`source` "device") or read in place from the pinned host bank ("host")."""
    import jax
    import jax.numpy as jnp
    from jdspark.experts import mapped
    from jdspark.model.moe import expert_slots, routing_matrix
    from pallas_kernels import moe as kmoe
    fmt, scale = FORMATS[fmt_name]
    n = max(bank_experts, TOP_K)
    bank = random_bank(fmt, dim, inter, n, scale_dtype=scale)
    device = device or jax.devices()[0]
    put = (lambda a: jax.device_put(a, device)) if source == "device" else \
        (lambda a: mapped.device_view(a, device, bank.data))
    if fmt == "bf16":
        w = [put(bank.view(name).view(jnp.bfloat16)) for name in ("w1", "w3", "w2")]
        stored = [(w[0],), (w[1],), (w[2],)]
    else:
        code = (lambda v: v.view(np.int8)) if fmt == "fp4" else (lambda v: v.view(jnp.float8_e4m3fn))
        stored = [(put(code(bank.view(a))), put(bank.view(b))) for a, b in (("w1", "s1"), ("w3", "s3"), ("w2", "s2"))]
    kfmt = "bf16" if fmt == "bf16" else fmt
    per_expert = bank.weight_nbytes
    rng = np.random.default_rng(0)
    results = []
    for rows in rows_list:
        if not kmoe.supported(kfmt, dim, inter, rows):
            continue

        @jax.jit
        def step(x, weights, idx):
            experts, slot = expert_slots(idx, n)
            dense = routing_matrix(weights, slot, experts.shape[0])
            return kmoe.moe(x, experts, dense, slot, *stored, fmt=kfmt, limit=10.0, interpret=interpret)

        calls = []
        for it in range(repeats + 1):
            idx = np.stack([rng.choice(n, TOP_K, replace=False) for _ in range(rows)]).astype(np.int32)
            x = put(rng.standard_normal((rows, dim)).astype(jnp.bfloat16))
            weights = put(rng.uniform(0.05, 0.5, (rows, TOP_K)).astype(np.float32))
            idx_d = put(idx)
            step(x, weights, idx_d).block_until_ready()
            t = time.perf_counter()
            step(x, weights, idx_d).block_until_ready()
            if it:
                calls.append((len(np.unique(idx)) * per_expert, time.perf_counter() - t))
        rates = [b / t / 1e9 for b, t in calls]
        results.append({"format": fmt_name, "rows": rows, "source": source, "GBps": float(np.median(rates)),
                        "us": float(np.median([t for _, t in calls]) * 1e6)})
    del stored
    return results


def together(fmt_name: str, dim: int, inter: int, rows: int, *, bank_experts: int, threads: int,
             repeats: int = 100, interpret: bool = False, dtype: str = "bfloat16") -> dict:
    """The CPU GEMV (`threads` - 1 threads, one bank) in a thread while the GPU kernel reads another
    bank's experts from host memory: each one's GB/s while the other runs, and the split q = GPU /
    (GPU + CPU) that balances them."""
    import threading
    fmt, scale = FORMATS[fmt_name]
    cpu_bank = random_bank(fmt, dim, inter, max(bank_experts, TOP_K), scale_dtype=scale, seed=1)
    rng = np.random.default_rng(2)
    stop, done = threading.Event(), []

    def cpu():
        while not stop.is_set():
            ids = np.stack([rng.choice(len(cpu_bank.expert_ids), TOP_K, replace=False) for _ in range(rows)])
            x = rng.standard_normal((rows, dim)).astype(np.float32)
            t = time.perf_counter()
            cpu_gemv.moe_forward(cpu_bank, x, ids, np.full((rows, TOP_K), 0.2, np.float32), limit=10.0,
                                 dtype=dtype, threads=max(1, threads - 1))
            done.append((len(np.unique(ids)) * cpu_bank.weight_nbytes, time.perf_counter() - t))

    worker = threading.Thread(target=cpu)
    worker.start()
    try:
        gpu = gpu_gemv_sweep(fmt_name, dim, inter, [rows], bank_experts=bank_experts, repeats=repeats,
                             source="host", interpret=interpret)
    finally:
        stop.set()
        worker.join()
    cpu_rate = sum(b for b, _ in done) / sum(t for _, t in done) / 1e9 if done else float("nan")
    gpu_rate = gpu[0]["GBps"] if gpu else float("nan")
    return {"format": fmt_name, "rows": rows, "cpu_GBps": cpu_rate, "gpu_GBps": gpu_rate,
            "pcie_share": gpu_rate / (gpu_rate + cpu_rate)}


# ------------------------------------------------------------------------------------------------


def _progress(message: str) -> None:
    """A measurement as it finishes, on stderr: a run cut short still shows what it measured."""
    print(f"bench bw: {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    threads = args.threads or cpu_gemv.default_threads()
    rows_list = _ints(args.rows)
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"--formats: unknown format {f!r}; expected some of {', '.join(FORMATS)}")
    ram = host_probes.ram_bytes()
    read_mb = args.read_mb or (1024 if ram >= 32 << 30 else 256)
    res = {"dim": args.dim, "inter": args.inter, "threads": threads, "cpus": os.cpu_count(),
           "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "simd": bool(cpu_gemv.kernel().jds_has_simd()), "prefetch_groups": cpu_gemv.PREFETCH,
           "fp4_prefetch_hint": cpu_gemv.fp4_prefetch_hint(), "dtype": args.dtype,
           "bf16dot": bool(cpu_gemv.kernel().jds_has_bf16dot())}
    read = host_probes.host_read(read_mb << 20, threads, args.repeats)
    res.update(host_read_GBps=read["GBps"], host_read_best_GBps=read["best_GBps"], host_read=read)
    _progress(f"host read {read['GBps']:.2f} GB/s")
    numba_rows = set(_ints(args.numba_rows)) if args.numba_rows else set()
    backends = {"cpp": set(rows_list)}
    if numba_rows:
        try:
            import numba  # noqa: F401
            backends["numba"] = numba_rows
        except ImportError:
            res["numba"] = "not installed"
    gemv = []
    for f in formats:
        gemv += cpu_gemv_sweep(f, args.dim, args.inter, rows_list, threads=threads, repeats=args.repeats,
                               bank_experts=args.bank_experts, backends=backends, dtype=args.dtype)
        _progress(f"CPU GEMV {f}: " + ", ".join(f"rows {g['rows']} {g['GBps']:.1f} GB/s" for g in gemv
                                                if g["format"] == f and g["backend"] == "cpp"))
    # the read test once more after the sweep: the machine may be busier or quieter by now
    read2 = host_probes.host_read(read_mb << 20, threads, args.repeats)
    res["host_read_after_GBps"] = read2["GBps"]
    res["cpu_gemv"] = [g for g in gemv if g["backend"] == "cpp"]
    res["cpu_gemv_numba"] = [g for g in gemv if g["backend"] == "numba"]
    ref = res["host_read_GBps"]
    res["rows1_share_of_read"] = {g["format"]: g["GBps"] / ref for g in res["cpu_gemv"] if g["rows"] == 1}
    gpu = None if args.no_gpu else _gpu()
    if gpu is None:
        res["pcie_h2d"] = res["gpu_gemv"] = None
        res["gpu"] = "skipped: no GPU" if not args.no_gpu else "skipped: --no-gpu"
    else:
        res["gpu"] = str(gpu)
        res["pcie_h2d"] = pcie_h2d(gpu)
        _progress("PCIe " + ", ".join(f"{p['kind']} {p['MiB']} MiB {p['GBps']:.1f} GB/s" for p in res["pcie_h2d"]))
        res["gpu_gemv"], res["together"] = [], []
        for f in formats:
            try:
                for source in ("device", "host"):
                    res["gpu_gemv"] += gpu_gemv_sweep(f, args.dim, args.inter, rows_list, bank_experts=args.bank_experts,
                                                      repeats=args.repeats, device=gpu, source=source)
                _progress(f"GPU GEMV {f}: " + ", ".join(f"rows {g['rows']} {g['source']} {g['GBps']:.1f} GB/s"
                                                        for g in res["gpu_gemv"] if g["format"] == f))
                res["together"] += [together(f, args.dim, args.inter, rows, bank_experts=args.bank_experts,
                                             threads=threads, dtype=args.dtype) for rows in sorted({1, max(rows_list)})]
            except Exception as e:  # noqa: BLE001 - report, keep the rest
                res.setdefault("gpu_gemv_errors", {})[f] = f"{type(e).__name__}: {e}"
    return res


def format_table(res: dict) -> str:
    lines = [f"host read: {res['host_read_GBps']:.2f} GB/s median (best {res['host_read_best_GBps']:.2f}; "
             f"{res['host_read']['how']}, {res['host_read']['bytes'] >> 20} MiB; after the sweep "
             f"{res['host_read_after_GBps']:.2f}); load average {res.get('load_average')}",
             f"CPU expert GEMV, {res['dtype']} model, D={res['dim']} F={res['inter']}, top-{TOP_K} per row, "
             f"{res['threads']} threads, ds_fp4 x bf16 by vdpbf16ps {'on' if res['bf16dot'] else 'off'}, "
             f"SIMD {'on' if res['simd'] else 'off'}, prefetch {res['prefetch_groups']} group(s) of rows ahead "
             f"(ds_fp4 into {res['fp4_prefetch_hint']}):",
             f"  {'format':8} {'backend':7} {'rows':>4} {'experts':>7} {'ms':>8} {'max ms':>8} {'GB/s':>7} "
             f"{'% read':>7} {'steal':>6} {'others':>6}"]
    for g in res["cpu_gemv"] + res["cpu_gemv_numba"]:
        steal, others = ("" if g[key] is None else f"{100 * g[key]:.1f}%" for key in ("steal", "others"))
        lines.append(f"  {g['format']:8} {g['backend']:7} {g['rows']:>4} {g['experts']:>7.1f} {g['ms']:>8.2f} "
                     f"{max(g['calls_ms']):>8.2f} {g['GBps']:>7.2f} {100 * g['GBps'] / res['host_read_GBps']:>6.1f}% "
                     f"{steal:>6} {others:>6}")
    if res["pcie_h2d"] is None:
        lines.append(f"PCIe host->device: {res['gpu']}")
    else:
        lines.append("PCIe host->device: " + ", ".join(f"{p['kind']} {p['MiB']} MiB {p['GBps']:.1f} GB/s"
                                                      for p in res["pcie_h2d"]))
    if res["gpu_gemv"] is None:
        lines.append(f"GPU expert GEMV: {res['gpu']}")
    else:
        for g in res["gpu_gemv"]:
            lines.append(f"GPU expert GEMV {g['format']} rows {g['rows']}, experts in {g['source']} memory: "
                         f"{g['us']:.0f} us, {g['GBps']:.1f} GB/s")
        for t in res["together"]:
            lines.append(f"at once, {t['format']} rows {t['rows']}: CPU GEMV {t['cpu_GBps']:.1f} GB/s, GPU reading "
                         f"host experts {t['gpu_GBps']:.1f} GB/s: PCIe share q = {t['pcie_share']:.2f}")
        for f, e in res.get("gpu_gemv_errors", {}).items():
            lines.append(f"GPU expert GEMV {f}: failed: {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        res = run(args)
    except (ValueError, RuntimeError, MemoryError) as e:
        print(f"jdspark bench bw: error: {e}", file=sys.stderr)
        return 2
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
