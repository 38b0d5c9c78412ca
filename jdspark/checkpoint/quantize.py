"""Quantizing float weights into the official storage formats (numpy, on the host): how the
checkpoint stores FP8 linears and ds_fp4 experts. Used to write checkpoints (synthetic ones, tests).

The scales follow the reference's quantizers (`act_quant`, `fp4_act_quant` in the official
kernel.py): per block, s = amax / max_code, rounded up to a power of two for e8m0 scales (amax
clamped below at 1e-4 for FP8 and 6 * 2^-126 for FP4); values are rounded to nearest-even in
e4m3fn / e2m1 (ml_dtypes casts) after clamping to the code range.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from jdspark.checkpoint.names import official_to_path
from jdspark.model.dequant import FP4_BLOCK, FP8_BLOCK, fp4_dequant, fp8_block_dequant
from jdspark.model.quantized import Storage

FP8_MAX = 448.0
FP4_MAX = 6.0


def pow2_ceil(v: np.ndarray) -> np.ndarray:
    """Smallest power of two >= v (v > 0), exactly (frexp, no logarithms)."""
    m, e = np.frexp(v.astype(np.float32))
    return np.ldexp(np.float32(1.0), np.where(m == 0.5, e - 1, e)).astype(np.float32)


def e8m0_encode(scale: np.ndarray) -> np.ndarray:
    """Powers of two (float32) -> e8m0 bytes (biased exponent)."""
    _, e = np.frexp(scale)
    return (e - 1 + 127).astype(np.uint8)


def quantize_fp8(w: np.ndarray, scale_dtype: str = "e8m0") -> tuple[np.ndarray, np.ndarray]:
    """float [..., N, K] -> (e4m3fn [..., N, K], scales [..., ceil(N/128), ceil(K/128)]):
    e8m0 bytes (uint8) or float32 (the -Base variants)."""
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    bn, bk = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    padded = np.zeros((*lead, bn * FP8_BLOCK, bk * FP8_BLOCK), np.float32)
    padded[..., :n, :k] = w
    blocks = padded.reshape(*lead, bn, FP8_BLOCK, bk, FP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=(-3, -1)), np.float32(1e-4))
    scale = amax / np.float32(FP8_MAX)
    if scale_dtype == "e8m0":
        scale = pow2_ceil(scale)
    elif scale_dtype != "float32":
        raise ValueError(f"scale_dtype={scale_dtype!r}: expected 'e8m0' or 'float32'")
    q = np.clip(blocks / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    q = q.reshape(padded.shape)[..., :n, :k]
    return np.ascontiguousarray(q), (e8m0_encode(scale) if scale_dtype == "e8m0" else scale)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., N, K] -> ds_fp4 (int8 [..., N, K/2], low nibble = even element; e8m0 bytes
    [..., N, K/32])."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % FP4_BLOCK:
        raise ValueError(f"FP4 needs the last dim divisible by {FP4_BLOCK}, got shape {list(w.shape)}")
    blocks = w.reshape(*w.shape[:-1], -1, FP4_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1), np.float32(FP4_MAX * 2.0 ** -126))
    scale = pow2_ceil(amax / np.float32(FP4_MAX))
    q = np.clip(blocks / scale[..., None], -FP4_MAX, FP4_MAX).astype(ml_dtypes.float4_e2m1fn)
    codes = q.reshape(w.shape).view(np.uint8) & 0xF
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(np.int8), e8m0_encode(scale)


def quantize_tensors(tensors: dict[str, np.ndarray], storage: Storage) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Official-named float tensors -> the tensors a checkpoint of format `storage` stores (FP8 /
    FP4 weights with their `.scale`), and the safetensors dtype names of the e8m0 scales."""
    out, dtype_names = {}, {}
    for name, value in tensors.items():
        path, _ = official_to_path(name)
        fmt = storage.format_of(path)
        if fmt is None:
            out[name] = value
            continue
        scale_name = name.removesuffix(".weight") + ".scale"
        out[name], out[scale_name] = quantize_fp4(value) if fmt == "fp4" else quantize_fp8(value, storage.scale_dtype)
        if out[scale_name].dtype == np.uint8:
            dtype_names[scale_name] = "F8_E8M0"
    return out, dtype_names


def roundtrip(path: tuple, value: np.ndarray, storage: Storage) -> np.ndarray:
    """The float32 value the parameter at `path` has after being stored as `storage` says and
    dequantized (unchanged where the format stores it as is): measures what quantization costs."""
    fmt = storage.format_of(path)
    if fmt is None:
        return np.asarray(value)
    if fmt == "fp4":
        return np.asarray(fp4_dequant(*quantize_fp4(value), np.float32))
    return np.asarray(fp8_block_dequant(*quantize_fp8(value, storage.scale_dtype), np.float32))
