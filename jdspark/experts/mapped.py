"""Host memory the GPU reads in place: a page-aligned numpy array pinned and viewed as a jax array.

`device_view(array, device)` returns a jax.Array on `device` whose buffer IS `array`'s host memory:
on a CUDA device the array is page-locked and mapped into the GPU's address space
(`cuMemHostRegister` with DEVICEMAP, through the driver API found with ctypes) and handed to JAX as
a DLPack view of a device buffer, so a kernel that reads it reads host memory over PCIe, each byte
it touches once, with no copy made first (zero-copy). That is how a GPU kernel serves the host
experts it was given (`HybridExperts`' PCIe share): it reads only the experts its rows selected,
straight from their bank.

On other backends the view is a plain jax array of the same values (a copy where the backend needs
one), so the code that uses it runs, and is tested, unchanged on the CPU.

The view does not own the memory: its owner (the `ExpertBank`) must outlive every jax array made
from it. `unpin(array)` releases the page lock once no view is used any more.
"""

from __future__ import annotations

import ctypes
import threading

import jax
import ml_dtypes
import numpy as np

_KDL_CPU, _KDL_CUDA = 1, 2
# numpy dtype -> DLPack (type code, bits): the DLPack 1.1 codes, float8_e4m3fn included
_DTYPES = {np.dtype(np.uint8): (1, 8), np.dtype(np.int8): (0, 8), np.dtype(np.uint16): (1, 16),
           np.dtype(np.int32): (0, 32), np.dtype(np.float32): (2, 32), np.dtype(ml_dtypes.bfloat16): (4, 16),
           np.dtype(ml_dtypes.float8_e4m3fn): (10, 8)}
# The module name under which parameters are views of host memory (`jdspark.experts.hybrid`):
# whatever handles parameters must pass them as they are (a packed copy would move them to the GPU).
MODULE = "host_mapped"
_REGISTER_PORTABLE, _REGISTER_DEVICEMAP = 1, 2
_ALREADY_REGISTERED = 712
_lock = threading.Lock()
_pinned: dict[int, int] = {}  # host address -> device address of every array pinned by `pin`


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]


class _View:
    """A DLPack producer of the buffer at `address` on a device of DLPack type `device_type`, with
    `array`'s shape and dtype. The managed tensor lives in malloc'ed memory and its deleter is libc's
    free: JAX frees it when the buffer is dropped, whenever that is (even at interpreter exit), and
    the memory it describes stays its owner's (the module docstring)."""

    def __init__(self, address: int, array: np.ndarray, device_type: int, device_id: int):
        code, bits = _DTYPES[array.dtype]
        ndim = array.ndim
        self.pointer = _libc.malloc(ctypes.sizeof(_DLManagedTensor) + 8 * max(ndim, 1))
        shape = (ctypes.c_int64 * max(ndim, 1)).from_address(self.pointer + ctypes.sizeof(_DLManagedTensor))
        shape[:ndim] = array.shape
        tensor = _DLManagedTensor.from_address(self.pointer)
        tensor.dl_tensor = _DLTensor(address, _DLDevice(device_type, device_id), ndim, _DLDataType(code, bits, 1),
                                     ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)), None, 0)
        tensor.manager_ctx = None
        tensor.deleter = ctypes.cast(_libc.free, ctypes.c_void_p).value
        self.device = (device_type, device_id)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **_):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(self.pointer, b"dltensor", None)


class _Driver:
    """The few CUDA driver calls pinning needs (libcuda through ctypes: no CUDA headers or toolkit)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, rc: int, what: str, ok=(0,)) -> None:
        if rc not in ok:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def in_context(self, ordinal: int, fn):
        lib, dev, ctx = self.lib, ctypes.c_int(), ctypes.c_void_p()
        self.check(lib.cuInit(0), "cuInit")
        self.check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            return fn(lib)
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            lib.cuDevicePrimaryCtxRelease_v2(dev)


_driver: _Driver | None = None


def _cuda() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def is_mapped(path: tuple) -> bool:
    """Whether the parameter at `path` (its pytree keys as names) is a view of host memory."""
    return MODULE in path


def is_cuda(device) -> bool:
    return device.platform == "gpu" and "cuda" in str(getattr(device.client, "platform_version", "cuda")).lower()


def pin(array: np.ndarray, device) -> int:
    """Page-lock `array` (C-contiguous) and map it for `device`; returns its device address."""
    if not array.flags.c_contiguous:
        raise ValueError("only a C-contiguous array can be pinned and mapped")
    host = array.ctypes.data
    with _lock:
        if host in _pinned:
            return _pinned[host]

        def register(lib):
            rc = lib.cuMemHostRegister_v2(ctypes.c_void_p(host), ctypes.c_size_t(array.nbytes),
                                          _REGISTER_PORTABLE | _REGISTER_DEVICEMAP)
            _cuda().check(rc, f"cuMemHostRegister of {array.nbytes} bytes", ok=(0, _ALREADY_REGISTERED))
            address = ctypes.c_uint64()
            _cuda().check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(address), ctypes.c_void_p(host), 0),
                          "cuMemHostGetDevicePointer")
            return address.value

        _pinned[host] = _cuda().in_context(device.local_hardware_id, register)
        return _pinned[host]


def unpin(array: np.ndarray, device) -> None:
    """Release the page lock `pin` took (views of `array` must no longer be used)."""
    host = array.ctypes.data
    with _lock:
        if _pinned.pop(host, None) is not None:
            _cuda().in_context(device.local_hardware_id, lambda lib: lib.cuMemHostUnregister(ctypes.c_void_p(host)))


def device_view(array: np.ndarray, device, base: np.ndarray | None = None) -> jax.Array:
    """`array` as a jax array on `device`, read in place from host memory on a CUDA device (module
    docstring). `base`: the pinned allocation `array` is a contiguous part of (default: itself)."""
    if not is_cuda(device):
        return jax.device_put(array, device)
    base = array if base is None else base
    offset = array.ctypes.data - base.ctypes.data
    if not array.flags.c_contiguous or offset < 0 or offset + array.nbytes > base.nbytes:
        raise ValueError("device_view: the array must be a C-contiguous part of `base`")
    address = pin(base, device) + offset
    return jax.dlpack.from_dlpack(_View(address, array, _KDL_CUDA, device.local_hardware_id), copy=False)


def cpu_view(array: np.ndarray) -> jax.Array:
    """`array` as a CPU jax array aliasing its memory, through the same DLPack producer as the CUDA
    views (what the tests check the producer with on a machine without a GPU)."""
    return jax.dlpack.from_dlpack(_View(array.ctypes.data, array, _KDL_CPU, 0), copy=False)
