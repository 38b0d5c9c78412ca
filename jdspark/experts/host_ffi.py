"""The host experts of one hybrid MoE layer as XLA FFI custom calls (`jds_host_experts_start` /
`_finish`).

`start(key, x, ids, weights, ...)` inside a jitted step computes what `cpu_gemv.moe_forward`
computes, in C++ with no Python in the round trip (`_host_ffi.cc`, built into the CPU expert
library); `finish(key, pending)` hands its result to the rest of the program. What the program
runs between the two (the layer's device experts and its PCIe share: `HybridExperts`) runs while
the host computes:

- on the CPU, start runs the plan and the GEMV where XLA calls it, and finish does nothing;
- on a CUDA GPU start enqueues, on the step's stream, the copies of x, ids and weights to pinned
  memory; on a side stream, a host function that runs the plan and the GEMV and the copy of y back;
  finish makes the step's stream wait for that copy. The thread that runs the executable goes on
  launching the rest of the step without waiting. A `jax.pure_callback` instead blocks that thread
  for each host layer, moves its operands through JAX's CPU device and runs Python (~0.7 ms a layer
  on the H200 host beyond the GEMV, docs/BENCHMARKS.md).

`host_experts` is the two back to back. A bank is named in the program by a key, its fingerprint
(format, sizes, expert ids and sampled bytes of every expert), and registered in this process under
it (`register`); the same bank in another process gets the same key, so executables holding the
calls can be stored and loaded again (the persistent compile cache, `jdspark.engine.exe_cache`). A
call whose key no live bank holds fails with an error naming the key. `stats(bank)` reads the calls,
the seconds inside the host part and the distinct host experts read, counted in C++.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.experts import cpu_gemv
from jdspark.experts.banks import ExpertBank

START, FINISH = "jds_host_experts_start", "jds_host_experts_finish"
_SAMPLES = 1024  # bytes sampled from every expert's run for its bank's fingerprint (plus its first 4 KiB)
_lock = threading.Lock()
_targets: set[str] = set()
_keys: "weakref.WeakKeyDictionary[ExpertBank, int]" = weakref.WeakKeyDictionary()


def _register_targets() -> None:
    """Register the custom call with XLA for the CPU and, where this process has one, the CUDA GPU."""
    platforms = ["cpu"] + (["CUDA"] if any(d.platform == "gpu" for d in jax.devices()) else [])
    with _lock:
        lib = cpu_gemv.kernel()
        for platform in platforms:
            if platform not in _targets:
                suffix = "cpu" if platform == "cpu" else "cuda"
                for target in (START, FINISH):
                    symbol = getattr(lib, f"{target}_{suffix}")
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform=platform)
                _targets.add(platform)


def fingerprint(bank: ExpertBank) -> int:
    """A signed 64-bit key of the bank's content: its format and sizes, expert ids, and of each
    expert's run the first 4 KiB and `_SAMPLES` bytes spread over the rest."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr((bank.fmt, bank.scale_dtype, bank.dim, bank.inter, bank.n_experts, bank.expert_nbytes)).encode())
    digest.update(np.ascontiguousarray(bank.expert_ids).tobytes())
    for name in bank.offsets:
        raw = bank.raw(name)
        digest.update(np.ascontiguousarray(raw[:, :min(raw.shape[1], 4096)]).tobytes())
        digest.update(np.ascontiguousarray(raw[:, ::max(1, raw.shape[1] // _SAMPLES)]).tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


def register(bank: ExpertBank) -> int:
    """Register `bank` with the custom call in this process (once per bank) and return its key. The
    registration ends when the bank is garbage-collected."""
    with _lock:
        if bank in _keys:
            return _keys[bank]
    _register_targets()
    key = fingerprint(bank)
    off, stride = bank.addressing()
    slot_of = np.ascontiguousarray(bank.slot_of, np.int32)
    lib = cpu_gemv.kernel()
    lib.jds_bank_register(key, cpu_gemv.format_code(bank), bank.data.ctypes.data, stride.ctypes.data,
                          off.ctypes.data, bank.dim, bank.inter, bank.n_experts, len(bank.expert_ids),
                          slot_of.ctypes.data)
    weakref.finalize(bank, lib.jds_bank_release, key, bank.data.ctypes.data)
    with _lock:
        _keys[bank] = key
    return key


def start(key: int, x: jax.Array, ids: jax.Array, weights: jax.Array, *, limit: float, round_bf16: bool,
          threads: int) -> jax.Array:
    """Start the host part: x [..., D] (bf16 or f32; other dtypes as f32), ids [..., K] (an id the
    bank does not hold, -1 included, adds nothing), weights [..., K] -> pending float32 [..., D], to
    be passed to `finish` (zero rows where no pair is on the host). Under `jax.vmap` the batch becomes
    leading rows of one call."""
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        x = x.astype(jnp.float32)
    call = jax.ffi.ffi_call(START, jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="broadcast_all")
    return call(x, ids.astype(jnp.int32), weights.astype(jnp.float32), bank=np.int64(key),
                limit=np.float32(limit), round_bf16=np.int32(bool(round_bf16)), threads=np.int32(threads),
                tile_f=np.int32(cpu_gemv.TILE_F), tile_d=np.int32(cpu_gemv.TILE_D),
                prefetch=np.int32(cpu_gemv.PREFETCH))


def finish(key: int, pending: jax.Array) -> jax.Array:
    """The host part `start` began, once it is in: the same buffer, which the program may read now."""
    call = jax.ffi.ffi_call(FINISH, jax.ShapeDtypeStruct(pending.shape, jnp.float32), vmap_method="broadcast_all",
                            input_output_aliases={0: 0})
    return call(pending, bank=np.int64(key))


def host_experts(key: int, x: jax.Array, ids: jax.Array, weights: jax.Array, *, limit: float, round_bf16: bool,
                 threads: int) -> jax.Array:
    """The host experts' part of a layer, float32 [..., D]: `start` then `finish`, nothing between."""
    return finish(key, start(key, x, ids, weights, limit=limit, round_bf16=round_bf16, threads=threads))


def stats(bank: ExpertBank, *, reset: bool = False) -> dict:
    """{"calls", "seconds", "experts"} of the custom call over `bank` since its registration (or the
    last reset): calls, seconds inside the host part (plan + GEMV), distinct bank experts read."""
    out = np.zeros(3, np.int64)
    key = register(bank)
    if cpu_gemv.kernel().jds_bank_stats(key, out.ctypes.data_as(ctypes.c_void_p), int(reset)):
        raise KeyError(f"no bank is registered under key {key}")
    return {"calls": int(out[0]), "seconds": out[1] * 1e-9, "experts": int(out[2])}
