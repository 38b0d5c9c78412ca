"""How the engine's programs become executables: XLA's options for them, loading stored ones and
compiling the rest in parallel threads, and a cold start-up spread over worker processes.

Tracing and lowering are Python and hold the GIL, so one process lowers its programs one after
another: on the H200 that was 96.6 s of the 144.9 s cold start-up of `jdspark serve`'s default
8-slot engine (23 executables; docs/BENCHMARKS.md, start-up). Compile workers each unpickle a
recipe of the executables (the model graph, the parameters' layout and shapes, the engine's
settings, the state's shapes; no weights), lower and compile their share and store every program
in the executable store (`exe_cache`); the engine then loads them as a warm start-up does.

A worker can only make start-up faster, never change what runs: the store's keys hold everything
a program depends on, so a program whose key came out different in a worker, or that a worker did
not deliver (it failed, or ran past its time), is simply not found and the engine compiles it
itself. Used for models on one device with no host experts (their banks live in this process),
while the store is on; JDSPARK_COMPILE_WORKERS sets how many (default: up to 8 on a GPU, none on the
CPU, whose compiles already spread over its cores).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
from flax import nnx

from jdspark.engine.exe_cache import ExecutableCache

log = logging.getLogger(__name__)
MIN_PROGRAMS = 4  # fewer missing programs are compiled in-process: a worker's own start-up costs seconds
TIMEOUT_S = 1800
TRITON_GEMM_MIN_HIDDEN = 1024
AUTOTUNE_SLACK_BYTES = 1 << 30  # what one compile's autotuning needs besides its operands


def thread_pool(jobs: int, most: int | None = None) -> ThreadPoolExecutor:
    """Threads for `jobs` loads or compiles (they leave the GIL), at most one per CPU (and `most`)."""
    return ThreadPoolExecutor(max_workers=max(1, min(jobs, os.cpu_count() or 1, most or jobs)))


def concurrent_compiles(free_bytes: float, largest_operand: int) -> int:
    """How many programs may compile at once in worker processes beside this one on its GPU, with
    `free_bytes` outside its pool (`device_memory_outside_this_process`). XLA's autotuner allocates
    a fusion's operands on the device, and the largest are stacked parameters: at Flash dims (8
    layers, 64 slots) on an H100, three of four workers ran out of memory allocating 4.02 GiB beside
    the engine's 41 GB of weights (docs/BENCHMARKS.md). Each compile is given twice the largest
    operand and `AUTOTUNE_SLACK_BYTES`."""
    return max(1, int(free_bytes // (2 * largest_operand + AUTOTUNE_SLACK_BYTES)))


def device_memory_outside_this_process() -> float | None:
    """Bytes of the GPU this process's allocator has not reserved, where XLA preallocates its pool
    (the default: XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75, of the card); None on the CPU or without
    preallocation (then nothing says what is free)."""
    if (jax.default_backend() != "gpu"
            or os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0")
            or os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "bfc") != "bfc"):
        return None
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return None if not limit or not 0 < fraction < 1 else limit / fraction - limit


def load_all(store: ExecutableCache | None, arguments: dict, outputs) -> dict:
    """{key: the stored executable, or None} for programs called with `arguments[key]`, loaded in
    parallel threads (measured: 8 executables of the embedded engine load in 3.4 s against 5.6-6.4 s
    one by one on the 2-core CPU, so deserializing leaves the GIL; on the H200 16 loaded in 1.3 s,
    where one by one had taken 0.9 s each)."""
    if store is None:
        return dict.fromkeys(arguments)
    with thread_pool(len(arguments)) as pool:
        futures = {key: pool.submit(store.load, str(key), args, outputs) for key, args in arguments.items()}
        return {key: future.result() for key, future in futures.items()}


def compiler_options(config) -> dict:
    """XLA options of the engine's executables for a model of `config`. On the GPU XLA's Triton GEMM
    fusions stay on for models of real width and are off below TRITON_GEMM_MIN_HIDDEN (cuBLAS runs
    the dots). Measured on the H200 (docs/BENCHMARKS.md, start-up): at Flash dims (8 layers) they
    made the target-only step 1.47x faster (2.43 against 3.58 ms); on the embedded model (hidden 256)
    autotuning their tilings doubled the compiles (8 executables on 8 threads: 78.5 against 39.9 s)
    and its steps were no faster (fixed width 5: 1435 against 1572 tok/s). XLA_FLAGS naming
    xla_gpu_enable_triton_gemm overrides this."""
    if (jax.default_backend() != "gpu" or config.hidden_size >= TRITON_GEMM_MIN_HIDDEN
            or "xla_gpu_enable_triton_gemm" in os.environ.get("XLA_FLAGS", "")):
        return {}
    return {"xla_gpu_enable_triton_gemm": False}


def compile_all(lowerings: dict, store: ExecutableCache | None = None, arguments: dict | None = None,
                options: dict | None = None, threads: int | None = None) -> tuple[dict, float]:
    """Lower programs one after another in this thread (tracing holds the GIL) and compile each in
    a pool thread as soon as it is lowered (XLA compiles outside the GIL), so the compiles overlap
    the lowering of the programs after them. `lowerings`: {key: a function returning the lowered
    program}. With a `store`, each is stored as it finishes (under its key and `arguments[key]`),
    so a start-up cut short keeps what it compiled; `options`: XLA's (`compiler_options`); `threads`:
    at most this many compiles at once. -> ({key: compiled}, seconds spent lowering)."""
    lowering = 0.0
    with thread_pool(len(lowerings), threads) as pool:
        futures = {}
        for key, lower in lowerings.items():
            start = time.perf_counter()
            program = lower()
            lowering += time.perf_counter() - start
            futures[pool.submit(ExecutableCache.compile, program, options)] = key
        compiled = {}
        for future in as_completed(futures):
            key = futures[future]
            compiled[key], storable = future.result()
            if store and storable:
                store.save(str(key), arguments[key], compiled[key])
    return compiled, lowering


def workers(programs: int) -> int:
    """Workers for `programs` missing executables: JDSPARK_COMPILE_WORKERS, or by default on a GPU
    one per two programs, at most 8 and half the CPUs; 0 (compile in-process) below MIN_PROGRAMS."""
    setting = os.environ.get("JDSPARK_COMPILE_WORKERS")
    if setting is not None:
        if not setting.isdigit():
            raise ValueError(f"JDSPARK_COMPILE_WORKERS={setting!r}: must be a whole number of processes (0: none)")
        count = int(setting)
    elif jax.default_backend() == "gpu":
        count = min(8, max(1, (os.cpu_count() or 2) // 2), programs // 2)
    else:
        count = 0
    return count if programs >= MIN_PROGRAMS else 0


def eligible(exe, decode, draft_cache) -> bool:
    """Whether workers can rebuild these programs: one process, every array on the default device
    in device memory (no mesh, no views of host memory), and no host expert banks in the graph."""
    from jdspark.experts.hybrid import HybridExperts
    device = jax.devices()[0]
    leaves = jax.tree.leaves((exe.params.arrays, decode, draft_cache))
    if jax.process_count() != 1 or any(
            not isinstance(a.sharding, jax.sharding.SingleDeviceSharding) or a.sharding.memory_kind != "device"
            or a.sharding.device_set != {device} for a in leaves):
        return False
    module = nnx.merge(exe.graphdef, jax.eval_shape(exe.params.unpack, exe.params.arrays))  # shapes only
    return not any(isinstance(node, HybridExperts) for _, node in nnx.iter_graph(module))


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _on_device(tree):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def recipe(exe, decode, draft_cache) -> bytes:
    """The executables without weights or compiled programs, and the state's shapes, pickled."""
    shell = copy.copy(exe)
    shell.params = copy.copy(exe.params)
    shell.params.arrays = _abstract(exe.params.arrays)
    shell.buckets = {n: type(bucket)() for n, bucket in exe.buckets.items()}
    shell._parities = None  # the engine's call counts (the twins' parities) stay here
    return pickle.dumps({"exe": shell, "decode": _abstract(decode), "draft_cache": _abstract(draft_cache),
                         "cache_dir": jax.config.jax_compilation_cache_dir})


def compile_in_workers(exe, decode, draft_cache, keys: list, count: int) -> None:
    """Lower, compile and store the programs `keys` in `count` processes (round robin), and wait
    for them; on a GPU, no more compiles at once than its memory outside this process holds
    (`concurrent_compiles`). Each worker's phases are logged (start-up, lowering, compiling); a
    failed worker is logged with its error, and its programs stay missing."""
    start = time.perf_counter()
    free = device_memory_outside_this_process()
    threads = None
    if free is not None:
        largest = max(a.nbytes for a in jax.tree.leaves((exe.params.arrays, decode, draft_cache)))
        at_once = concurrent_compiles(free, largest)
        count = min(count, at_once)
        threads = max(1, at_once // count)
        log.info("compile workers: %d, at most %d compiles each (%.1f GiB of the GPU outside this process, the "
                 "largest operand %.2f GiB)", count, threads, free / 2 ** 30, largest / 2 ** 30)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(sys.path))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "recipe.pkl")
        with open(path, "wb") as file:
            file.write(recipe(exe, decode, draft_cache))
        shares = [share for share in (keys[i::count] for i in range(count)) if share]
        # files, not pipes: a full pipe would block its worker while this waits for another
        outs = [open(os.path.join(folder, f"worker{i}.{kind}"), "w+") for i in range(len(shares)) for kind in "oe"]
        processes = [subprocess.Popen([sys.executable, "-m", __name__, path, repr(share), repr(time.time()),
                                       repr(threads)],
                                      env=env, stdout=outs[2 * i], stderr=outs[2 * i + 1])
                     for i, share in enumerate(shares)]
        try:
            for i, process in enumerate(processes):
                try:
                    process.wait(timeout=max(1.0, TIMEOUT_S - (time.perf_counter() - start)))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                phases, errors = (_read(outs[2 * i + j]) for j in (0, 1))
                if process.returncode != 0:
                    log.warning("compile worker exited with %s; the engine compiles its programs itself: %s",
                                process.returncode, errors.strip()[-2000:])
                elif phases.strip():
                    log.info("compile worker %d: %s", i, phases.strip())
        finally:  # a start-up interrupted here (Ctrl-C) leaves no worker behind
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for out in outs:
                out.close()
    log.info("%d compile workers lowered and compiled %d programs in %.1f s", len(processes), len(keys),
             time.perf_counter() - start)


def _die_with_parent() -> None:
    """A worker ends with the thread that started it (Linux's PR_SET_PDEATHSIG): a server stopped while
    a background build waits for its workers (`jdspark.engine.deferred`) leaves none compiling on."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the workers end when their programs are done
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _read(file) -> str:
    file.seek(0)
    return file.read()


def _work(path: str, keys: list, spawned: float, threads: int | None) -> None:
    """A worker: rebuild the executables from the recipe at `path`, compile and store `keys` (at most
    `threads` at once), and print its phases (`spawned`: when the engine started it, time.time())."""
    _die_with_parent()
    up = time.time() - spawned  # the interpreter, jax and this module
    with open(path, "rb") as file:
        spec = pickle.load(file)
    jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
    exe = spec["exe"]
    exe.params.arrays = _on_device(exe.params.arrays)
    decode, draft_cache = _on_device(spec["decode"]), _on_device(spec["draft_cache"])
    ready = time.time() - spawned  # the recipe read and the device up
    with exe.precision():
        programs = exe.programs(decode, draft_cache)
        store = ExecutableCache.default(exe.static_key())
        arguments = {key: programs[key][1] for key in keys}
        lowerings = {key: exe.lowering(programs[key], decode, draft_cache) for key in keys}
        begun = time.perf_counter()
        _, lowering = compile_all(lowerings, store, arguments, compiler_options(exe.config), threads)
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))  # every thread, and tools it ran (ptxas): are the cores the bound?
    print(f"{len(keys)} programs; started in {up:.1f} s, ready at {ready:.1f} s; lowering {lowering:.1f} s, "
          f"then compiling until {time.perf_counter() - begun:.1f} s after it began; {cpu:.1f} CPU-seconds",
          flush=True)


if __name__ == "__main__":
    import ast
    _work(sys.argv[1], ast.literal_eval(sys.argv[2]), float(sys.argv[3]), ast.literal_eval(sys.argv[4]))
