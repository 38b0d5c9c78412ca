"""Multi-threaded CPU routed-expert forward over the packed formats of a host `ExpertBank`.

`moe_forward(bank, x, ids, weights, limit=...)` is the host part of one MoE layer: x [R, D] float32
(the MoE input after ffn_norm, in the model dtype's values), ids [R, K] global expert ids, weights
[R, K] routing weights -> [R, D] float32, the sum over k of the experts that live in `bank` (pairs
whose expert is not in the bank contribute nothing: the GPU computes them; nor do pairs of expert
-1, which no one computes). The arithmetic follows `jdspark.model.moe.Experts`:

    gate, up = x W1^T, x W3^T            fp32 accumulation, rounded to the model dtype
    h        = swiglu(gate, up, limit) * routing weight   (fp32), rounded to the model dtype
    out      = h W2^T                     fp32 accumulation, rounded to the model dtype
    y        = sum_k out (fp32)

`dtype="bfloat16"` rounds x to bf16 and rounds at those points as a bf16 model does (and rounds FP8
weights with float32 scales to bf16, as its dequantization does); "float32" keeps fp32 throughout. In
a bf16 model, where the CPU has AVX512-BF16, the C++ kernel multiplies ds_fp4 by bf16 inputs with
vdpbf16ps (the same products, another summation order): on the Zen 4 machine below, D 4096 / F 2048,
rows 1, 2 threads, with ds_fp4 rows prefetched into L2, 24.5-26.2 GB/s against 21.1-21.6 for a
float32 model (docs/BENCHMARKS.md). Each distinct expert is
read once for all the rows that selected it; threads run over (expert, output tile). The signature
suits one `jax.pure_callback` per MoE layer: (x, ids, weights) -> y, the bank bound beforehand.

Two implementations of the same plan: a C++ kernel (`_kernel.cc`, AVX2/F16C/FMA decoding in
registers, ds_fp4 with AVX-512 where built for it, OpenMP threads; built with g++ -march=native at
first use into a cache folder, $JDSPARK_CACHE or ~/.cache/jdspark) and a numba one (`prange`, table decoding). `jdspark bench bw`
times both. The C++ kernel is the default (`backend="cpp"`): on the 2-core AMD EPYC (Zen 4)
development machine, D 4096 / F 2048, rows 1, one thread, it read 3.2 GB/s of ds_fp4, 4.8 GB/s of
FP8 and 10.7 GB/s of bf16 experts against numba's 0.9, 0.9 and 0.8 GB/s (before the AVX-512 ds_fp4
decoder, which doubled its fp4 rate there; docs/BENCHMARKS.md has the H200 host's). On that machine
it is compute-bound (about 15 G fp4 weights/s per core from L2) while one core streams ~20-30 GB/s.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import pathlib
import subprocess
import tempfile
import threading

import ml_dtypes
import numpy as np

from jdspark.experts.banks import ExpertBank

log = logging.getLogger(__name__)

_FMT_CODE = {("fp4", "e8m0"): 0, ("fp8", "e8m0"): 1, ("fp8", "float32"): 2, ("bf16", "e8m0"): 3}
_SOURCES = tuple(pathlib.Path(__file__).with_name(n) for n in ("_kernel.cc", "_host_ffi.cc"))
_LOCK = threading.Lock()
_LIB = None
TILE_F, TILE_D = 32, 32


def _prefetch_groups() -> int:
    """JDSPARK_CPU_PREFETCH: groups of weight rows the GEMV prefetches ahead (0: off; default 1)."""
    setting = os.environ.get("JDSPARK_CPU_PREFETCH", "1")
    if not (setting.isdigit() and int(setting) <= 64):
        raise ValueError(f"JDSPARK_CPU_PREFETCH={setting!r}: must be a whole number of row groups, 0..64 (0: off)")
    return int(setting)


PREFETCH = _prefetch_groups()
PREFETCH_HINTS = {"t0": "_MM_HINT_T0", "t1": "_MM_HINT_T1", "t2": "_MM_HINT_T2"}


def fp4_prefetch_hint() -> str:
    """JDSPARK_CPU_FP4_PREFETCH_HINT: the cache level the GEMV prefetches ds_fp4 rows into, t0 (L1),
    t1 (L2, the default) or t2 (the other formats go to L1); a build setting (a library per setting)."""
    setting = os.environ.get("JDSPARK_CPU_FP4_PREFETCH_HINT", "t1")
    if setting not in PREFETCH_HINTS:
        raise ValueError(f"JDSPARK_CPU_FP4_PREFETCH_HINT={setting!r}: must be one of {', '.join(PREFETCH_HINTS)}")
    return setting


def default_threads() -> int:
    """Threads for the host GEMV: JDSPARK_CPU_THREADS, else the CPUs this process may run on."""
    env = os.environ.get("JDSPARK_CPU_THREADS")
    if env:
        return max(1, int(env))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------------
# the C++ kernel


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JDSPARK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jdspark")
    return pathlib.Path(root) / "experts"


def _ffi_include() -> pathlib.Path:
    """jaxlib's XLA FFI headers (what `jax.ffi.include_dir()` returns), found without importing jax."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("building the host expert library needs jaxlib's XLA FFI headers: install jax")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "include"


def build_kernel(force: bool = False) -> pathlib.Path:
    """Compile `_kernel.cc` and `_host_ffi.cc` (the XLA FFI custom call around it) for this CPU
    (g++ -O3 -march=native -fopenmp) into one library in the cache folder, keyed by the sources and
    the compiler flags (the prefetch hint among them); returns the shared library's path."""
    include = _ffi_include()
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", f"-I{include}",
             f"-DJDS_FP4_PREFETCH_HINT={PREFETCH_HINTS[fp4_prefetch_hint()]}"]
    src = b"".join(p.read_bytes() for p in _SOURCES)
    key = hashlib.sha256(src + " ".join(flags).encode() + os.uname().machine.encode()).hexdigest()[:16]
    out = _cache_dir() / f"_kernel-{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = pathlib.Path(tmp) / out.name
        cmd = [cxx, *flags, "-o", str(tmp_so), *map(str, _SOURCES), "-ldl"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"building the CPU expert kernel failed ({' '.join(cmd)}):\n{res.stderr}\n"
                               "Install g++ (with OpenMP), or set CXX, or use backend='numba'.")
        os.replace(tmp_so, out)
    log.info("built the CPU expert kernel: %s", out)
    return out


def kernel() -> ctypes.CDLL:
    """The loaded C++ kernel (built on first use)."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            lib = ctypes.CDLL(str(build_kernel()))
            P = ctypes.c_void_p
            i32, i64, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_float
            lib.jds_moe_forward.restype = ctypes.c_int
            lib.jds_moe_forward.argtypes = [i32, P, P, P, i32, i32, i32, i32, P, i32, P, P, P, P, P, P,
                                            P, P, P, P, f32, i32, i32, i32, i32, i32, i32]
            lib.jds_read_sum.restype = ctypes.c_uint64
            lib.jds_read_sum.argtypes = [P, i64, i32, i32]
            lib.jds_has_simd.restype = ctypes.c_int
            lib.jds_bank_register.restype = ctypes.c_int
            lib.jds_bank_register.argtypes = [i64, i32, P, P, P, i32, i32, i32, i32, P]
            lib.jds_bank_release.restype = None
            lib.jds_bank_release.argtypes = [i64, P]
            lib.jds_bank_stats.restype = ctypes.c_int
            lib.jds_bank_stats.argtypes = [i64, P, i32]
            _LIB = lib
        return _LIB


# ------------------------------------------------------------------------------------------------
# the plan shared by both backends


class Plan:
    """Which (row, k) pairs each distinct bank expert serves, sorted by expert.

    uniq_slot [U] bank slots; pstart [U+1] pair ranges; pair_row [P], pair_w [P] fp32 routing
    weights, pair_out [P] = r * K + k; covered [R*K] uint8, 1 where the pair is computed here."""

    def __init__(self, bank: ExpertBank, ids: np.ndarray, weights: np.ndarray):
        ids = np.asarray(ids)
        if ids.ndim != 2 or np.shape(weights) != ids.shape:
            raise ValueError(f"ids {list(ids.shape)} and weights {list(np.shape(weights))}: expected both [R, K]")
        r, k = ids.shape
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < -1 or flat.max() >= bank.n_experts):
            raise ValueError(f"expert ids must lie in [0, {bank.n_experts}) or be -1 (no expert), got "
                             f"{flat.min()}..{flat.max()}")
        slots = np.where(flat >= 0, bank.slot_of[flat], -1)
        keep = np.flatnonzero(slots >= 0).astype(np.int32)
        order = keep[np.argsort(slots[keep], kind="stable")]
        s_sorted = slots[order]
        self.uniq_slot, first = np.unique(s_sorted, return_index=True)
        self.uniq_slot = self.uniq_slot.astype(np.int32)
        self.pstart = np.append(first, len(order)).astype(np.int32)
        self.pair_out = order.astype(np.int32)
        self.pair_row = (order // k).astype(np.int32)
        self.pair_w = np.ascontiguousarray(np.asarray(weights, np.float32).reshape(-1)[order])
        self.covered = np.zeros(r * k, np.uint8)
        self.covered[order] = 1
        self.rows, self.k = r, k

    @property
    def n_experts(self) -> int:
        return len(self.uniq_slot)

    @property
    def n_pairs(self) -> int:
        return len(self.pair_out)


def _check_x(bank: ExpertBank, x) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x, np.float32))
    if x.ndim != 2 or x.shape[1] != bank.dim:
        raise ValueError(f"x {list(x.shape)}: expected [R, {bank.dim}] for {bank.describe()}")
    return x


def moe_forward(bank: ExpertBank, x, ids, weights, *, limit: float = 0.0, dtype: str = "float32",
                backend: str = "cpp", threads: int | None = None, simd: bool = True) -> np.ndarray:
    """The host experts' part of one MoE layer: x [R, D], ids / weights [R, K] -> y [R, D] float32.
    See the module docstring. `backend` "cpp" or "numba"; `simd=False` runs the C++ scalar path."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")
    x = _check_x(bank, x)
    if dtype == "bfloat16":  # a bf16 model's hidden states are bf16 values
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    plan = Plan(bank, ids, weights)
    if x.shape[0] != plan.rows:
        raise ValueError(f"x has {x.shape[0]} rows, ids {plan.rows}")
    threads = threads or default_threads()
    if backend == "cpp":
        return _forward_cpp(bank, x, plan, limit, dtype == "bfloat16", threads, simd)
    if backend == "numba":
        from jdspark.experts import numba_gemv
        return numba_gemv.forward(bank, x, plan, limit, dtype == "bfloat16", threads, format_code(bank),
                                  (TILE_F, TILE_D))
    raise ValueError(f"backend={backend!r}: expected 'cpp' or 'numba'")


def format_code(bank: ExpertBank) -> int:
    return _FMT_CODE[(bank.fmt, bank.scale_dtype if bank.fmt == "fp8" else "e8m0")]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _forward_cpp(bank, x, plan, limit, round_bf16, threads, simd) -> np.ndarray:
    lib = kernel()
    r, d, f, k = x.shape[0], bank.dim, bank.inter, plan.k
    y = np.empty((r, d), np.float32)
    if plan.n_pairs == 0:
        y[...] = 0.0
        return y
    off, stride = bank.addressing()
    xp = np.empty_like(x)
    h = np.empty((plan.n_pairs, f), np.float32)
    out = np.empty((r * k, d), np.float32)
    rc = lib.jds_moe_forward(
        format_code(bank), _ptr(bank.data),
        _ptr(stride), _ptr(off), d, f, r, k, _ptr(x), plan.n_experts, _ptr(plan.uniq_slot),
        _ptr(plan.pstart), _ptr(plan.pair_row), _ptr(plan.pair_w), _ptr(plan.pair_out), _ptr(plan.covered),
        _ptr(xp), _ptr(h), _ptr(out), _ptr(y), float(limit), int(round_bf16), int(threads), TILE_F, TILE_D,
        int(simd), PREFETCH)
    if rc:
        raise RuntimeError(f"jds_moe_forward failed with code {rc} for {bank.describe()}")
    return y


def host_callback(bank: ExpertBank, *, limit: float, dtype: str = "float32", backend: str = "cpp",
                  threads: int | None = None):
    """A function (x [..., D], ids [..., K], weights [..., K]) -> [..., D] float32 over numpy inputs,
    for `jax.pure_callback` (one per MoE layer): x may be bf16; leading axes are flattened into rows,
    so a vmapped call (vmap_method="broadcast_all") is still one host call."""
    def call(x, ids, weights):
        x = np.asarray(x, np.float32)
        k = np.shape(ids)[-1]
        y = moe_forward(bank, x.reshape(-1, x.shape[-1]), np.asarray(ids).reshape(-1, k),
                        np.asarray(weights, np.float32).reshape(-1, k), limit=limit, dtype=dtype, backend=backend,
                        threads=threads)
        return y.reshape(x.shape)
    return call
