"""What one call of a compiled program costs the host thread that issues it, and whether that thread
holds the GIL meanwhile (issue 26: at 64 rows the engine's step is host-paced, and cProfile puts ~1 ms
of each step in `Compiled.__call__`).

A chain of `--layers` small matmuls stands in for a model step (about two kernels a layer, as many
launches as the embedded model's step). Its weights come either as one leaf per layer or as one
stacked leaf; a trivial program with as many leaves separates the per-leaf cost from the launches.
For each variant: the host microseconds a call takes to return (the device runs behind it) and, with
a second Python thread spinning, the share of that time the spinner ran (the GIL released). Then, per
variant, a round of issuing the call beside `--work-us` of Python work (the engine reads the call
before meanwhile), the call issued on this thread or handed to a second one.

    python scripts/bench_dispatch.py --layers 300 --work-us 1000 --json dispatch.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp


def chain(layers: int):
    """x -> tanh(x @ w_i) for each layer: the weights one [layers, d, d] leaf or `layers` leaves."""
    def run(weights, x):
        for i in range(layers):
            x = jnp.tanh(x @ weights[i])
        return x[0, 0]
    return run


def touch(leaves):
    """A program reading one element of each leaf: the per-leaf cost without many launches."""
    return sum(w.reshape(-1)[0] for w in leaves)


def variants(layers: int, d: int):
    """{name: (function, its arguments)}: the chain with its weights as many leaves or one, and `touch` likewise."""
    key = jax.random.key(0)
    stacked = jax.random.normal(key, (layers, d, d), jnp.float32) / d ** 0.5
    separate = tuple(stacked[i] for i in range(layers))
    x = jnp.ones((8, d), jnp.float32)
    return {
        f"{layers} leaves, ~{2 * layers} kernels": (chain(layers), (separate, x)),
        f"1 leaf, ~{2 * layers} kernels": (chain(layers), (stacked, x)),
        f"{layers} leaves, 1 kernel": (touch, (separate,)),
        "1 leaf, 1 kernel": (touch, ((stacked,),)),
    }


def host_us(call, args, calls: int) -> float:
    """Microseconds a call takes to return, the device finishing behind it (waited for after each block)."""
    jax.block_until_ready(call(*args))
    total = 0.0
    for _ in range(calls):
        started = time.perf_counter()
        out = call(*args)
        total += time.perf_counter() - started
        jax.block_until_ready(out)
    return total / calls * 1e6


def released_share(call, args, calls: int) -> float:
    """The share of the calls' host time during which a spinning Python thread ran: the GIL released."""
    counted, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counted[0] += 1
    # the spinner's rate alone, then while the calls run (the switch interval short, so neither thread waits long)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
        time.sleep(0.05)
        before, started = counted[0], time.perf_counter()
        time.sleep(0.2)
        rate = (counted[0] - before) / (time.perf_counter() - started)
        ran = spent = 0.0
        for _ in range(calls):
            before, started = counted[0], time.perf_counter()
            out = call(*args)
            spent += time.perf_counter() - started
            ran += (counted[0] - before) / rate
            jax.block_until_ready(out)
        stop.set()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    return ran / spent


def python_work(us: float) -> int:
    """`us` microseconds of pure-Python work (the engine's read of the call before holds the GIL so)."""
    started, total = time.perf_counter(), 0
    while time.perf_counter() - started < us * 1e-6:
        for i in range(50):
            total += i
    return total


def with_work(call, args, calls: int, work_us: float, threaded: bool) -> float:
    """Microseconds a round of (issue the call, `work_us` of Python work, have the call's outputs) takes:
    the call issued on this thread before the work, or handed to a second thread that issues it meanwhile."""
    pool = ThreadPoolExecutor(1)
    jax.block_until_ready(call(*args))
    started = time.perf_counter()
    for _ in range(calls):
        if threaded:
            future = pool.submit(call, *args)
            python_work(work_us)
            out = future.result()
        else:
            out = call(*args)
            python_work(work_us)
        jax.block_until_ready(out)
    pool.shutdown()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=300)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--work-us", type=float, default=1000.0, help="Python work beside each call (overlap rows)")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the overlap rows")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"| variant | host us a call | us a leaf | GIL released |\n|---|---:|---:|---:|")
    for name, (function, inputs) in variants(args.layers, args.d).items():
        compiled = jax.jit(function).lower(*inputs).compile()
        leaves = len(jax.tree.leaves(inputs))
        us = host_us(compiled, inputs, args.calls)
        share = released_share(compiled, inputs, args.calls)
        rows.append({"variant": name, "leaves": leaves, "host_us": us, "gil_released": share})
        print(f"| {name} | {us:.1f} | {us / leaves:.2f} | {share:.0%} |")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(f"\n{args.work_us:.0f} us of Python work beside each call: a round's us, the call issued first on this"
          f" thread / by a second thread meanwhile\n| variant | this thread | second thread | ratio |\n|---|---:|---:|---:|")
    for name, (function, inputs) in variants(args.layers, args.d).items():
        compiled = jax.jit(function).lower(*inputs).compile()
        alone, threaded = (with_work(compiled, inputs, args.calls, args.work_us, t) for t in (False, True))
        rows.append({"variant": name, "work_us": args.work_us, "this_thread_us": alone, "second_thread_us": threaded})
        print(f"| {name} | {alone:.1f} | {threaded:.1f} | {threaded / alone:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
