"""One Triton compile per distinct Pallas kernel in a process, not one per call site.

From jaxlib 0.10.3 on, lowering a `pallas_call` for the GPU compiles its Triton module to PTX right
there (`jax._src.lib.triton.compile`, in the thread that lowers), once per call site: a model whose
43 layers call the same kernels on the same shapes compiles each of them 43 times per program, and
again in every program (the full-size Flash spent ~80 s lowering 3 programs on the H200). The result
is a function of the arguments only (the module's bytecode, the platform, the architecture, warps,
CTAs, stages), so `install` puts a memo in front of it for the Pallas lowering: the same arguments
get the result of their first compile. jaxlib 0.10.2 and older pass the module to XLA instead, and
the memo is never called. `JDSPARK_TRITON_MEMO=0` leaves jax as it is (to measure the difference).
"""

from __future__ import annotations

import os
import threading
import types


class MemoisedTriton:
    """A stand-in for `jax._src.lib.triton` whose `compile` remembers its results; every other
    attribute is the module's. `hits` / `misses` count the compiles served and run."""

    def __init__(self, triton: types.ModuleType):
        self._triton, self._results, self._lock = triton, {}, threading.Lock()
        self.hits = self.misses = 0

    def compile(self, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        with self._lock:
            if key in self._results:
                self.hits += 1
                return self._results[key]
        result = self._triton.compile(*args, **kwargs)  # outside the lock: compiles may run in parallel
        with self._lock:
            self.misses += 1
            return self._results.setdefault(key, result)

    def __getattr__(self, name):
        return getattr(self._triton, name)


def install() -> MemoisedTriton | None:
    """Put the memo in front of the Pallas GPU lowering's Triton compiles (once; later calls return
    the same memo). None where that lowering cannot be imported or `JDSPARK_TRITON_MEMO=0`."""
    if os.environ.get("JDSPARK_TRITON_MEMO", "1") == "0":
        return None
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:  # a jaxlib without the Pallas GPU lowering
        return None
    triton = getattr(registration, "triton", None)
    if triton is None or not callable(getattr(triton, "compile", None)):  # a jax that lowers otherwise
        return None
    if not isinstance(triton, MemoisedTriton):
        registration.triton = triton = MemoisedTriton(triton)
    return triton
