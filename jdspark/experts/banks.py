"""Host banks: the routed experts of one MoE layer in their packed checkpoint storage, in host memory.

One `ExpertBank` holds some (or all) routed experts of a layer in one page-aligned allocation
(`data`), tensor by tensor: each of the six checkpoint tensors has a region of its own holding that
tensor of every slot, `[S, *shape]`, C-contiguous and starting on a page boundary. So a tensor of all
the bank's experts is one dense array, which the GPU can read in place once the allocation is pinned
(`jdspark.experts.mapped`: the PCIe share of a hybrid layer), and a host GEMV finds tensor t of slot
s at `offsets[t] + s * strides[t]`. Each tensor keeps the checkpoint's own layout (row-major
[out, in], the model's `[E, out, in]` per expert):

    fmt "fp4" (ds_fp4):  w1, w3 codes uint8 [F, D/2], w2 codes uint8 [D, F/2]   (low nibble = even
                         element), then e8m0 scale bytes s1, s3 uint8 [F, D/32], s2 uint8 [D, F/32]
    fmt "fp8" (e4m3fn):  w1, w3 uint8 [F, D], w2 uint8 [D, F], then 128 x 128 block scales
                         s1, s3 [ceil(F/128), ceil(D/128)], s2 [ceil(D/128), ceil(F/128)], as e8m0
                         bytes (uint8) or float32 (the -Base variants)
    fmt "bf16":          w1, w3 bfloat16 bits uint16 [F, D], w2 [D, F]; no scales

Bytes per expert at Flash dims (D 4096, F 2048): fp4 13,369,344; fp8 (e8m0) 25,166,592; bf16 50,331,648.

`expert_ids[slot]` is the global expert id of each slot, `slot_of[e]` the slot of global expert e or
-1 where the expert does not live in this bank (it lives on the GPU), so a hybrid layer's host part is
a bank over a subset of the layer's experts.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FP4_BLOCK = 32   # = jdspark.model.dequant.FP4_BLOCK (kept free of a jax import)
FP8_BLOCK = 128  # = jdspark.model.dequant.FP8_BLOCK

FORMATS = ("fp4", "fp8", "bf16")
SCALE_DTYPES = {"e8m0": np.uint8, "float32": np.float32}
_PAGE = 4096
TENSORS = ("w1", "w3", "w2", "s1", "s3", "s2")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tensor_specs(fmt: str, dim: int, inter: int, scale_dtype: str = "e8m0") -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (shape, numpy dtype) of the six per-expert tensors (scales absent for bf16)."""
    if fmt not in FORMATS:
        raise ValueError(f"expert format {fmt!r}: expected one of {FORMATS}")
    d, f = dim, inter
    if fmt == "fp4":
        if d % FP4_BLOCK or f % FP4_BLOCK:
            raise ValueError(f"ds_fp4 experts need dim and inter divisible by {FP4_BLOCK}, got dim={d}, inter={f}")
        u8 = np.dtype(np.uint8)
        return {"w1": ((f, d // 2), u8), "w3": ((f, d // 2), u8), "w2": ((d, f // 2), u8),
                "s1": ((f, d // FP4_BLOCK), u8), "s3": ((f, d // FP4_BLOCK), u8), "s2": ((d, f // FP4_BLOCK), u8)}
    if fmt == "fp8":
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={scale_dtype!r}: expected one of {sorted(SCALE_DTYPES)}")
        u8, sd = np.dtype(np.uint8), np.dtype(SCALE_DTYPES[scale_dtype])
        bd, bf = math.ceil(d / FP8_BLOCK), math.ceil(f / FP8_BLOCK)
        return {"w1": ((f, d), u8), "w3": ((f, d), u8), "w2": ((d, f), u8),
                "s1": ((bf, bd), sd), "s3": ((bf, bd), sd), "s2": ((bd, bf), sd)}
    u16 = np.dtype(np.uint16)
    return {"w1": ((f, d), u16), "w3": ((f, d), u16), "w2": ((d, f), u16)}


def layout(fmt: str, dim: int, inter: int, n_slots: int, scale_dtype: str = "e8m0"
           ) -> tuple[dict[str, int], dict[str, int], int]:
    """(byte offset of each tensor's region, bytes of that tensor per expert (the region's stride
    from one slot to the next), total bytes) of a bank of `n_slots` experts: regions page-aligned."""
    offsets, strides, pos = {}, {}, 0
    for name, (shape, dt) in tensor_specs(fmt, dim, inter, scale_dtype).items():
        offsets[name], strides[name] = pos, math.prod(shape) * dt.itemsize
        pos = _round_up(pos + n_slots * strides[name], _PAGE)
    return offsets, strides, max(pos, _PAGE)


def weight_bytes(fmt: str, dim: int, inter: int, scale_dtype: str = "e8m0") -> int:
    """Bytes of one expert's stored tensors (weights + scales, no alignment padding): what a GEMV reads."""
    return sum(math.prod(s) * dt.itemsize for s, dt in tensor_specs(fmt, dim, inter, scale_dtype).values())


def aligned_empty(shape: tuple[int, ...], dtype=np.uint8, align: int = _PAGE, huge: bool = True) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary. Arrays of
    2 MiB or more start on a 2 MiB boundary and ask for transparent huge pages (madvise), which
    spares a streaming GEMV the TLB misses of 4 KiB pages."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    if huge and n >= _HUGE:
        align = max(align, _HUGE)
    raw = np.empty(n + align, np.uint8)
    start = (-raw.ctypes.data) % align
    out = raw[start:start + n]
    if huge and n >= _HUGE:
        _madvise_huge(out)
    return out.view(dtype).reshape(shape)


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _madvise_huge(a: np.ndarray) -> None:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes // _HUGE * _HUGE), _MADV_HUGEPAGE)
    except (OSError, AttributeError):  # not Linux: plain pages
        pass


@dataclasses.dataclass(eq=False)
class ExpertBank:
    """Routed experts of one layer in packed storage; see the module docstring for the layout."""

    fmt: str
    dim: int                 # D, model width
    inter: int               # F, expert width
    n_experts: int           # experts of the layer (global ids 0..n_experts-1)
    expert_ids: np.ndarray   # int32 [S]: global id held by each slot
    data: np.ndarray         # uint8 [total], page-aligned, one region per tensor (`layout`)
    scale_dtype: str = "e8m0"

    def __post_init__(self):
        self.expert_ids = np.asarray(self.expert_ids, np.int32)
        self.offsets, self.strides, total = layout(self.fmt, self.dim, self.inter, len(self.expert_ids),
                                                   self.scale_dtype)
        self.expert_nbytes = sum(self.strides.values())
        if self.data.shape != (total,) or self.data.dtype != np.uint8:
            raise ValueError(f"bank data {self.data.dtype}{list(self.data.shape)}: expected uint8"
                             f"[{total}] for {self.describe()}")
        if len(self.expert_ids) and (self.expert_ids.min() < 0 or self.expert_ids.max() >= self.n_experts
                                     or len(np.unique(self.expert_ids)) != len(self.expert_ids)):
            raise ValueError(f"expert_ids must be distinct ids in [0, {self.n_experts}), got {self.expert_ids}")
        self.slot_of = np.full(self.n_experts, -1, np.int32)
        self.slot_of[self.expert_ids] = np.arange(len(self.expert_ids), dtype=np.int32)

    # construction -----------------------------------------------------------------------------
    @classmethod
    def empty(cls, fmt: str, dim: int, inter: int, n_experts: int, expert_ids=None,
              scale_dtype: str = "e8m0") -> "ExpertBank":
        """A bank with uninitialised storage for `expert_ids` (default: all experts)."""
        ids = np.arange(n_experts, dtype=np.int32) if expert_ids is None else np.asarray(expert_ids, np.int32)
        data = aligned_empty((layout(fmt, dim, inter, len(ids), scale_dtype)[2],))
        return cls(fmt, dim, inter, n_experts, ids, data, scale_dtype)

    @classmethod
    def from_stacked(cls, fmt: str, w1, w3, w2, s1=None, s3=None, s2=None, *, expert_ids=None,
                     n_experts: int | None = None) -> "ExpertBank":
        """A bank from the model's stacked arrays [E', out, in(/2)] (+ scales), the experts
        `expert_ids` (default 0..E'-1) of a layer of `n_experts` (default E'). Accepts the
        checkpoint dtypes: int8 / uint8 ds_fp4 codes, float8_e4m3fn or uint8 FP8, bfloat16 or
        uint16; e8m0 scales as uint8, FP8 scales as uint8 or float32."""
        w1 = np.asarray(w1)
        e_local, f = w1.shape[0], w1.shape[1]
        d = w1.shape[2] * (2 if fmt == "fp4" else 1)
        scale_dtype = "float32" if (fmt == "fp8" and np.asarray(s1).dtype == np.float32) else "e8m0"
        ids = np.arange(e_local, dtype=np.int32) if expert_ids is None else np.asarray(expert_ids, np.int32)
        bank = cls.empty(fmt, d, f, n_experts or e_local, ids, scale_dtype)
        for name, value in zip(TENSORS, (w1, w3, w2, s1, s3, s2)):
            if name in bank.offsets:
                bank.view(name)[...] = as_stored(np.asarray(value), bank.view(name).dtype)
        bank.check_scales()
        return bank

    def check_scales(self) -> None:
        """ds_fp4 e8m0 scale bytes must be >= 1: the CPU kernel builds 2^(b - 127) from the bits
        b << 23, and the checkpoint's quantizer never writes byte 0 (its scales are >= 2^-126)."""
        if self.fmt == "fp4":
            for name in ("s1", "s3", "s2"):
                if len(self.expert_ids) and self.view(name).min() == 0:
                    raise ValueError(f"{self.describe()}: {name} holds e8m0 byte 0 (2^-127), which the "
                                     "checkpoint's FP4 quantizer never writes and the CPU kernel does not decode")

    # access -------------------------------------------------------------------------------------
    def view(self, name: str) -> np.ndarray:
        """[S, *shape] view (no copy, C-contiguous) of tensor `name` ("w1", "w3", "w2", "s1", "s3", "s2")
        of every slot: its region of `data`."""
        shape, dt = tensor_specs(self.fmt, self.dim, self.inter, self.scale_dtype)[name]
        region = self.raw(name)
        return region.view(dt).reshape(len(self.expert_ids), *shape)

    def raw(self, name: str) -> np.ndarray:
        """uint8 [S, stride] view of tensor `name`'s region: its bytes, one row per slot."""
        off, stride = self.offsets[name], self.strides[name]
        return self.data[off:off + len(self.expert_ids) * stride].reshape(len(self.expert_ids), stride)

    def addressing(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 (offsets, strides) of the tensors in TENSORS order, as the C++ and numba kernels
        address a bank: tensor t of slot s at data + offsets[t] + s * strides[t] (0, 0 for the absent
        scales of bf16)."""
        return (np.array([self.offsets.get(n, 0) for n in TENSORS], np.int64),
                np.array([self.strides.get(n, 0) for n in TENSORS], np.int64))

    def expert(self, e: int) -> dict[str, np.ndarray]:
        """The tensors of global expert `e` (views into the bank)."""
        slot = int(self.slot_of[e])
        if slot < 0:
            raise KeyError(f"expert {e} is not in this host bank (it holds {len(self.expert_ids)} of {self.n_experts})")
        return {name: self.view(name)[slot] for name in self.offsets}

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def weight_nbytes(self) -> int:
        """Stored bytes of one expert (without padding): the bytes a GEMV reads per expert."""
        return weight_bytes(self.fmt, self.dim, self.inter, self.scale_dtype)

    def describe(self) -> str:
        scales = f", {self.scale_dtype} scales" if self.fmt == "fp8" else ""
        return (f"ExpertBank({self.fmt}{scales}, D={self.dim}, F={self.inter}, "
                f"{len(self.expert_ids)}/{self.n_experts} experts x {self.expert_nbytes} B)")

    __repr__ = describe


def as_stored(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The checkpoint array reinterpreted as the bank's storage dtype (same bits)."""
    if value.dtype == dtype:
        return value
    if value.dtype.itemsize == dtype.itemsize and dtype != np.float32:
        return value.view(dtype)
    return value.astype(dtype)  # e.g. float FP8 scales given as float64


def random_bank(fmt: str, dim: int, inter: int, n_experts: int, *, scale_dtype: str = "e8m0",
                seed: int = 0, expert_ids=None) -> ExpertBank:
    """A bank filled with random valid codes (no NaN e4m3 bytes) and scales around 2^-4..2^-7 so the
    outputs stay finite: for tests and `bench bw`, fast enough for GB-sized banks."""
    bank = ExpertBank.empty(fmt, dim, inter, n_experts, expert_ids, scale_dtype)
    rng = np.random.default_rng(seed)
    for name in bank.offsets:
        rows = bank.raw(name)
        for i in range(rows.shape[0]):
            rows[i] = rng.integers(0, 256, rows.shape[1], dtype=np.uint8)
    for name in ("w1", "w3", "w2"):
        v = bank.view(name)
        if fmt == "fp8":
            v[(v & 0x7F) == 0x7F] = 0x7E          # e4m3fn NaN codes -> 448 magnitude
        elif fmt == "bf16":  # random sign and mantissa, exponents 2^-8 .. 2^-5
            v[...] = (v & 0x807F) | ((v & 0x0180) + 0x3B80)
    for name in ("s1", "s3", "s2"):
        if name in bank.offsets:
            v = bank.view(name)
            fan_in = dim if name != "s2" else inter
            if v.dtype == np.uint8:
                base = 127 - int(round(math.log2(fan_in) / 2)) - (2 if fmt == "fp4" else 6)
                v[...] = rng.integers(base - 1, base + 2, v.shape, dtype=np.uint8)
            else:
                v[...] = rng.uniform(0.5, 1.0, v.shape).astype(np.float32) * fan_in ** -0.5 / 64
    return bank
