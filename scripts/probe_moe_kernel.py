"""The routed-expert kernel alone at Flash dimensions, per kernel: where its time goes.

Draws one layer of ds_fp4 experts (E = 256, D = 4096, F = 2048, the checkpoint's storage) on the
device, routes R rows to 6 experts each at random, and for each tiling given (`--tiles`, `Tiles`
fields as key=value pairs; the first: the default) prints the gate/up and the down kernel's device
time (`jax.profiler` trace), each against the bytes of the distinct experts it reads at the copy
bandwidth measured in the same run, and the error against `ref_moe`; `other`: the XLA work around
them (the grouped form's sort, gather and combine). `--grouped`: the form calls of many rows take
(`grouped_moe`, blocks of 16 (row, choice) pairs of one expert) instead of the slot form (`moe`, up to
64 rows). `--runs 0 --calls N` runs each tiling N times untraced, for a profiler of its own (Nsight
Compute).

    PYTHONPATH=$PWD python scripts/probe_moe_kernel.py --rows 1 6 --tiles "" "out=128,num_warps=8"
    PYTHONPATH=$PWD python scripts/probe_moe_kernel.py --rows 16 96 --grouped --tiles "" "out=64"
    PYTHONPATH=$PWD python scripts/probe_moe_kernel.py --dims 16 512 256 --rows 1 3 --runs 2   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import copy_bandwidth, traced_kernels  # noqa: E402

from jdspark.model.moe import expert_slots, routed_slots  # noqa: E402
from pallas_kernels import moe as moe_kernels  # noqa: E402

K = 6
SCALE_BYTE = 118  # 2^-9: values of the size a trained layer's are


def experts_fp4(E: int, D: int, F: int, seed: int = 0):
    """(w1, w3, w2) as stored: ds_fp4 bytes [E, out, in/2] + e8m0 scale bytes [E, out, in/32]."""
    keys = jax.random.split(jax.random.key(seed), 3)

    def one(key, out, inp):
        packed = jax.lax.bitcast_convert_type(jax.random.bits(key, (E, out, inp // 2), jnp.uint8), jnp.int8)
        return packed, jnp.full((E, out, inp // 32), SCALE_BYTE, jnp.uint8)
    return one(keys[0], F, D), one(keys[1], F, D), one(keys[2], D, F)


def parse_tiles(text: str) -> moe_kernels.Tiles:
    """"out=128,num_warps=8" -> the default Tiles with those fields replaced ("" -> the default)."""
    fields = [f.name for f in dataclasses.fields(moe_kernels.Tiles)]
    over = {}
    for pair in filter(None, text.split(",")):
        key, value = pair.split("=")
        if key not in fields:
            raise SystemExit(f"--tiles: no Tiles field {key!r}; fields: {', '.join(fields)}")
        kind = type(getattr(moe_kernels.TILES, key))
        over[key] = value == "True" if kind is bool else kind(value)
    return dataclasses.replace(moe_kernels.TILES, **over)


def kernel_ms(fn, args, runs: int) -> dict[str, float]:
    """Device ms per call of each kernel of fn, by name (gate_up, down, other)."""
    totals: dict[str, float] = {}
    for k in traced_kernels(fn, args, runs, python=False):
        name = "gate_up" if "gate_up" in k["name"] else "down" if "moe_down" in k["name"] else "other"
        totals[name] = totals.get(name, 0.0) + k["dur"] / runs / 1e3
    return totals


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--tiles", nargs="+", default=[""])
    ap.add_argument("--runs", type=int, default=20, help="calls traced per tiling (0: no trace, for ncu)")
    ap.add_argument("--calls", type=int, default=0, help="more calls of each tiling, untimed (for ncu)")
    ap.add_argument("--dims", type=int, nargs=3, default=[256, 4096, 2048], metavar=("E", "D", "F"),
                    help="experts, model width, expert width (Flash: 256 4096 2048)")
    ap.add_argument("--grouped", action="store_true", help="the grouped form (grouped_moe), not the slot form")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    E, D, F = args.dims
    tilings = [(text or "default", parse_tiles(text)) for text in args.tiles]
    interpret = jax.default_backend() == "cpu"
    w1, w3, w2 = experts_fp4(E, D, F)
    bytes_up = sum(a.nbytes for a in (*w1, *w3)) / E
    bytes_down = sum(a.nbytes for a in w2) / E
    bandwidth = copy_bandwidth(1 << 30) if not interpret else 1e11
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; per expert gate/up {bytes_up / 1e6:.2f} MB, "
          f"down {bytes_down / 1e6:.2f} MB", flush=True)
    rows_out = []
    for rows in args.rows:
        rng = np.random.default_rng(100 + rows)
        idx = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(rows)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1, idx.shape), jnp.float32)
        x = jnp.asarray(rng.standard_normal((rows, D)), jnp.bfloat16)
        experts, dense = jax.jit(lambda w, i: routed_slots(w, i, E))(w, idx)
        slot = expert_slots(idx, E)[1]
        distinct = len(np.unique(np.asarray(idx)))
        call = (x, experts, dense, slot, w1, w3, w2)
        want = jax.jit(partial(moe_kernels.ref_moe, fmt="fp4", limit=10.0))(*call)
        kernel = moe_kernels.grouped_moe if args.grouped else moe_kernels.moe
        call = (x, idx, w, w1, w3, w2) if args.grouped else call
        floors = {"gate_up": distinct * bytes_up / bandwidth * 1e3, "down": distinct * bytes_down / bandwidth * 1e3}
        for name, tiles in tilings:
            row = {"rows": rows, "distinct": distinct, "tiles": name, "form": kernel.__name__}
            try:
                fn = jax.jit(partial(kernel, fmt="fp4", limit=10.0, tiles=tiles, interpret=interpret))
                got = fn(*call)
                row["rel_err"] = float(jnp.abs(got - want).max() / jnp.abs(want).max())
                for _ in range(args.calls):
                    jax.block_until_ready(fn(*call))
                if not args.runs:  # under ncu: no profiler trace of our own
                    print(f"R={rows} [{name}] err {row['rel_err']:.1e}", flush=True)
                    rows_out.append(row)
                    continue
                row["ms"] = kernel_ms(fn, call, args.runs)
                parts = "  ".join(f"{part} {row['ms'][part] * 1e3:6.1f} us "
                                  f"({floors[part] / row['ms'][part]:5.1%} of floor)" for part in floors
                                  if part in row["ms"])
                print(f"R={rows} [{row['tiles']}] {parts}  other {row['ms'].get('other', 0) * 1e3:5.1f} us  "
                      f"err {row['rel_err']:.1e}", flush=True)
            except Exception as exc:  # a tiling Triton refuses: say so, go on with the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:1500]
                print(f"R={rows} [{row['tiles']}] failed: {row['error'][:300]}", flush=True)
            rows_out.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": bandwidth, "rows": rows_out}, indent=1))
    return rows_out


if __name__ == "__main__":
    main()
