"""Start-up time: `load_model` from the official safetensors vs. from the `jdspark convert` (orbax)
directory of the same model, on the current default device; or, with `--gpu-memory GB`, the load
into a GPU / host placement (issue 24) against the all-device load.

Writes a synthetic checkpoint in the official storage (FP8 linears, ds_fp4 experts), converts it,
loads each format `--repeats` times (parameters on the device, `block_until_ready`), checks that
both give identical logits, prints a table and writes JSON. `--drop-caches` (root) empties the page
cache before each load, so the numbers include reading the disk; without it the files just written
are usually still cached and the numbers measure decoding and the host-to-device copy.

`--gpu-memory GB`: no conversion; the safetensors checkpoint is loaded with that many GB of weights
on the device and the other routed experts streamed into host banks, then loaded all on the device;
the run states the host memory each load added at its peak (the process's resident set, sampled
every 5 ms, above what it held before the load) beside the bytes of its host banks (what must stay;
on a CPU backend the "device" parameters are host memory too), and how far the hybrid model's
logits are from the all-device ones.

    python scripts/bench_load.py --preset flash --layers 4 --json load.json
    python scripts/bench_load.py --preset flash --layers 4 --gpu-memory 8 --json load.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jdspark.checkpoint.loader import convert, load_model
from jdspark.checkpoint.synthetic import write_checkpoint
from jdspark.config import QuantConfig, flash_config, pro_config, tiny_config
from jdspark.experts import hybrid
from jdspark.experts.hybrid import host_banks

PRESETS = {"tiny": lambda: tiny_config(expert_dtype="fp4", quantization=QuantConfig()),
           "flash": flash_config, "pro": pro_config}


def config_for(args):
    config = PRESETS[args.preset]()
    changes = {}
    if args.layers is not None:
        changes.update(num_hidden_layers=args.layers, num_hash_layers=min(config.num_hash_layers, args.layers),
                       compress_ratios=config.compress_ratios[:args.layers] + (0,) * config.num_nextn_predict_layers)
    if args.experts is not None:
        changes.update(n_routed_experts=args.experts)
    return config.replace(**changes)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def written(config, src: Path) -> tuple:
    """Write the synthetic checkpoint to `src`; its table row."""
    start = time.perf_counter()
    write_checkpoint(config, src, progress=True)
    return ("write synthetic safetensors", time.perf_counter() - start, dir_bytes(src), None)


def print_rows(rows: list) -> None:
    """(step, seconds, bytes, page cache dropped or None) as a table."""
    print(f"{'step':40s} {'seconds':>9s} {'GiB':>8s} {'GiB/s':>7s} {'cold':>5s}")
    for step, seconds, nbytes, dropped in rows:
        cold = "" if dropped is None else "yes" if dropped else "no"
        print(f"{step:40s} {seconds:9.2f} {nbytes / 2**30:8.2f} {nbytes / 2**30 / seconds:7.2f} {cold:>5s}")


def resident_bytes() -> int:
    """This process's resident set now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


class PeakResident:
    """The most resident memory above the level at entry, sampled every 5 ms while the block runs:
    in all (`added`), per phase (`phase(name)` ends the current one) and at its end (`after`)."""

    def __enter__(self):
        self.base = self.peak = self.phase_peak = resident_bytes()
        self.phases: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._seen(resident_bytes())

    def _seen(self, now: int) -> None:
        self.peak, self.phase_peak = max(self.peak, now), max(self.phase_peak, now)

    def phase(self, name: str) -> None:
        """End the phase `name` here: its peak is kept, the next phase's starts from now."""
        now = resident_bytes()
        self._seen(now)
        self.phases[name] = self.phase_peak - self.base
        self.phase_peak = now

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._seen(resident_bytes())
        self.after = resident_bytes() - self.base

    @property
    def added(self) -> int:
        return self.peak - self.base


def mappings() -> list[dict]:
    """This process's memory mappings (/proc/self/smaps): start, end, name ([anon] for none),
    resident bytes and bytes in transparent huge pages; [] off Linux."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            fields = line.split()
            start, end = (int(x, 16) for x in head.split("-"))
            rows.append({"start": start, "end": end, "name": fields[5] if len(fields) > 5 else "[anon]",
                         "resident": 0, "huge": 0})
        elif rows and line.startswith(("Rss:", "AnonHugePages:")):
            rows[-1]["resident" if line.startswith("Rss:") else "huge"] = int(line.split()[1]) * 1024
    return rows


def largest_resident(banks, top: int = 6) -> list[dict]:
    """The mappings holding the most of this process's resident set, largest first: name, size and
    resident GiB, and whether a host bank lies in it. Where the placed load's host memory goes
    beyond its banks."""
    spans = [(bank.data.ctypes.data, bank.data.ctypes.data + bank.data.nbytes) for bank in banks]
    rows = [{"name": m["name"], "GiB": (m["end"] - m["start"]) / 2**30, "resident_GiB": m["resident"] / 2**30,
             "bank": any(lo < m["end"] and m["start"] < hi for lo, hi in spans)} for m in mappings()]
    return sorted(rows, key=lambda row: -row["resident_GiB"])[:top]


def timed_load(path: Path, dtype: str, cold: bool, gpu_memory: float | None = None):
    """(model, seconds, page cache dropped, PeakResident of the load). With `gpu_memory` the peak is
    split in two phases: reading the checkpoint into place, then `with_host_experts` (the hybrid
    layers built on the banks: pinning them for the GPU, registering them with the host GEMV)."""
    dropped = drop_caches() if cold else False
    start = time.perf_counter()
    split = hybrid.with_host_experts

    def traced(*args, **kwargs):
        peak.phase("read")
        model = split(*args, **kwargs)
        peak.phase("hybrid layers")
        return model

    with PeakResident() as peak:
        hybrid.with_host_experts = traced
        try:
            model = load_model(path, dtype=dtype, progress=False, gpu_memory=gpu_memory)
        finally:
            hybrid.with_host_experts = split
        jax.block_until_ready(model.params)
    return model, time.perf_counter() - start, dropped, peak


def hybrid_rows(args, config, src: Path, rows: list) -> dict:
    """The load into the placement, then the all-device load: seconds, the host memory each added
    at its peak, and the hybrid logits against the all-device ones."""
    ids = np.arange(16) * 7 % config.vocab_size
    out = {}
    for name, gpu_memory in (("hybrid", args.gpu_memory * 1e9), ("all-device", None)):
        model, seconds, dropped, peak = timed_load(src, args.dtype, args.drop_caches, gpu_memory)
        rows.append((f"load safetensors, {name}", seconds, dir_bytes(src), dropped))
        banks = sum(bank.nbytes for bank in host_banks(model).values())
        out[name] = {"seconds": seconds, "host_peak_added_bytes": peak.added, "host_added_after_bytes": peak.after,
                     "host_peak_by_phase_bytes": peak.phases, "host_bank_bytes": banks,
                     "logits": np.asarray(model.logits(ids), np.float32)}
        out[name]["largest_resident"] = largest_resident(host_banks(model).values())
        print("  largest resident mappings: " + ", ".join(
            f"{m['name'].rsplit('/', 1)[-1]} {m['resident_GiB']:.2f}/{m['GiB']:.2f} GiB{' (bank)' if m['bank'] else ''}"
            for m in out[name]["largest_resident"]))
        phases = "".join(f", {phase} {b / 2**30:.2f}" for phase, b in peak.phases.items())
        print(f"{name}: {seconds:.2f} s, host memory added at peak {peak.added / 2**30:.2f} GiB{phases}, "
              f"after {peak.after / 2**30:.2f} (host banks {banks / 2**30:.2f} GiB)", flush=True)
        del model
        gc.collect()
    got, want = out["hybrid"].pop("logits"), out["all-device"].pop("logits")
    out["max_abs_diff"] = float(np.abs(got - want).max())
    out["max_abs_logit"] = float(np.abs(want).max())
    out["same_argmax"] = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"hybrid vs all-device logits: max |diff| {out['max_abs_diff']:.3g} (max |logit| "
          f"{out['max_abs_logit']:.3g}), same argmax: {out['same_argmax']}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="flash")
    parser.add_argument("--layers", type=int, default=4, help="main layers (default 4; the MTP block is kept)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jdspark_bench_load"))
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before each load (root)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("--gpu-memory", type=float, default=None,
                        help="GB of weights on the device: the load into a GPU / host placement instead of orbax")
    parser.add_argument("--json", type=Path, default=Path("bench_load.json"))
    args = parser.parse_args(argv)
    if args.gpu_memory is not None:
        return placement_main(args)

    config = config_for(args)
    shutil.rmtree(args.workdir, ignore_errors=True)
    src, dst = args.workdir / "safetensors", args.workdir / "orbax"
    rows = [written(config, src)]
    start = time.perf_counter()
    convert(src, dst, dtype=args.dtype, progress=False)
    rows.append(("jdspark convert (load + orbax save)", time.perf_counter() - start, dir_bytes(dst), None))

    ids = np.arange(16) * 7 % config.vocab_size
    logits, device_bytes = {}, None
    for fmt, path in (("safetensors", src), ("orbax", dst)):
        for r in range(args.repeats):
            model, seconds, dropped, _ = timed_load(path, args.dtype, args.drop_caches)
            rows.append((f"load {fmt} #{r + 1}", seconds, dir_bytes(path), dropped))
            if r == 0:
                logits[fmt] = model.logits(ids)
                device_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
            del model
            gc.collect()
    identical = bool(np.array_equal(logits["safetensors"], logits["orbax"]))

    print(f"\n{args.preset} layers={config.num_hidden_layers} experts={config.n_routed_experts} dtype={args.dtype} "
          f"device={jax.devices()[0].device_kind} jax={jax.__version__}; params on device "
          f"{device_bytes / 2**30:.2f} GiB; identical logits: {identical}")
    print_rows(rows)
    result = {
        "preset": args.preset, "config": config.to_dict(), "dtype": args.dtype, "device": str(jax.devices()[0]),
        "jax": jax.__version__, "device_param_bytes": device_bytes, "identical_logits": identical,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rows": [{"step": s, "seconds": t, "bytes": b, "page_cache_dropped": d} for s, t, b, d in rows],
    }
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if identical else 1


def placement_main(args) -> int:
    """`--gpu-memory`: write the checkpoint, then `hybrid_rows`; table and JSON."""
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jdspark.checkpoint.loader").setLevel(logging.INFO)  # the placement report
    config = config_for(args)
    shutil.rmtree(args.workdir, ignore_errors=True)
    src = args.workdir / "safetensors"
    rows = [written(config, src)]
    result = hybrid_rows(args, config, src, rows)
    print_rows(rows)
    result |= {"preset": args.preset, "config": config.to_dict(), "dtype": args.dtype, "gpu_memory_GB": args.gpu_memory,
               "device": str(jax.devices()[0]), "jax": jax.__version__,
               "rows": [{"step": s, "seconds": t, "bytes": b} for s, t, b, _ in rows]}
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
