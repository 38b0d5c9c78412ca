"""Probe (GPU): host memory read in place by GPU kernels, alone and beside the CPU expert GEMV.

1. a 1 GiB pinned host array viewed as a device array (`jdspark.experts.mapped`): an XLA sum over
   it, GB/s, against the same sum over a device copy; values checked;
2. the routed-expert kernel over ds_fp4 experts whose arrays are such views, rows 1 and 6, 6 experts a
   row out of 32: GB/s of distinct expert bytes, against the same experts in device memory; output
   checked against the device copy;
3. the same kernel while the CPU GEMV runs in a thread on another bank: both rates, alone and together.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jdspark.experts import cpu_gemv, mapped  # noqa: E402
from jdspark.experts.banks import aligned_empty, random_bank  # noqa: E402
from jdspark.model.moe import expert_slots, routing_matrix  # noqa: E402
from pallas_kernels import moe as kmoe  # noqa: E402

D, F, N, K = 4096, 2048, 32, 6


def timed(fn, runs=20):
    fn()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    gpu = jax.devices()[0]
    out = {}
    a = aligned_empty((1 << 30,), np.uint8)
    a[...] = np.random.default_rng(0).integers(0, 256, a.size, dtype=np.uint8)
    view = mapped.device_view(a, gpu)
    dev = jax.device_put(a, gpu)
    total = jax.jit(lambda v: jnp.sum(v.astype(jnp.uint32)))
    want = int(a.astype(np.uint64).sum() % (1 << 32))
    got_view, got_dev = int(total(view)), int(total(dev))
    out["sum_ok"] = got_view == want and got_dev == want
    for name, x in (("mapped", view), ("device", dev)):
        s = timed(lambda x=x: total(x), runs=5)
        out[f"sum_{name}_GBps"] = a.nbytes / s / 1e9
    print(out, flush=True)
    del dev

    bank = random_bank("fp4", D, F, N, seed=1)
    tensors = {}
    for name in ("w1", "w3", "w2", "s1", "s3", "s2"):
        v = bank.view(name)
        c = aligned_empty(v.shape, np.int8 if name[0] == "w" else np.uint8)
        c[...] = v.view(c.dtype)
        tensors[name] = c
    stored = {where: [(put(tensors[w]), put(tensors[s])) for w, s in (("w1", "s1"), ("w3", "s3"), ("w2", "s2"))]
              for where, put in (("mapped", lambda t: mapped.device_view(t, gpu)),
                                 ("device", lambda t: jax.device_put(t, gpu)))}
    per_expert = bank.weight_nbytes
    rng = np.random.default_rng(2)
    cpu_bank = random_bank("fp4", D, F, N, seed=3)
    for rows in (1, 6):
        idx = np.stack([rng.choice(N, K, replace=False) for _ in range(rows)]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((rows, D)), jnp.bfloat16)
        w = jnp.asarray(rng.uniform(0.05, 0.5, (rows, K)), jnp.float32)
        nbytes = len(np.unique(idx)) * per_expert

        def step(x, w, idx, s):
            experts, slot = expert_slots(idx, N)
            dense = routing_matrix(w, slot, experts.shape[0])
            return kmoe.moe(x, experts, dense, slot, *s, fmt="fp4", limit=10.0)

        fn = jax.jit(step)
        res = {k: fn(x, w, jnp.asarray(idx), stored[k]) for k in stored}
        out[f"rows{rows}_equal"] = bool(jnp.array_equal(res["mapped"], res["device"]))
        for k in stored:
            s = timed(lambda k=k: fn(x, w, jnp.asarray(idx), stored[k]))
            out[f"rows{rows}_{k}_GBps"] = nbytes / s / 1e9
            out[f"rows{rows}_{k}_ms"] = s * 1e3
        # the CPU GEMV alone, then both together
        xc = np.asarray(x, np.float32)
        cidx = np.stack([rng.choice(N, K, replace=False) for _ in range(rows)]).astype(np.int32)
        cw = np.full((rows, K), 0.2, np.float32)
        cbytes = len(np.unique(cidx)) * per_expert
        threads = cpu_gemv.default_threads() - 1
        call = lambda: cpu_gemv.moe_forward(cpu_bank, xc, cidx, cw, limit=10.0, threads=threads)  # noqa: E731
        call()
        t = time.perf_counter()
        for _ in range(10):
            call()
        out[f"rows{rows}_cpu_alone_GBps"] = cbytes * 10 / (time.perf_counter() - t) / 1e9
        stop, count = threading.Event(), [0, 0.0]

        def spin():
            t0 = time.perf_counter()
            while not stop.is_set():
                call()
                count[0] += 1
            count[1] = time.perf_counter() - t0

        th = threading.Thread(target=spin)
        th.start()
        time.sleep(0.05)
        s = timed(lambda: fn(x, w, jnp.asarray(idx), stored["mapped"]), runs=30)
        stop.set()
        th.join()
        out[f"rows{rows}_mapped_with_cpu_GBps"] = nbytes / s / 1e9
        out[f"rows{rows}_cpu_with_mapped_GBps"] = cbytes * count[0] / count[1] / 1e9
        print(json.dumps(out), flush=True)
    Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe_mapped.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
