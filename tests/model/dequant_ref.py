"""An independent numpy decoder of the checkpoint's quantized formats, written from the format
definitions (spec §7.3-7.4, the official converter's E2M1 table), not from jdspark's code:
E2M1 and e4m3fn values from their bit fields, e8m0 bytes as 2^(b - 127)."""

import numpy as np


def _e2m1(code: int) -> float:
    sign, exp, mant = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mant * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + mant / 2)
    return -magnitude if sign and magnitude else magnitude  # code 8 is +0.0 in the official table


def _e4m3fn(byte: int) -> float:
    sign, exp, mant = byte >> 7, (byte >> 3) & 15, byte & 7
    if exp == 15 and mant == 7:
        return float("nan")
    magnitude = mant / 8 * 2.0 ** -6 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7)
    return -magnitude if sign else magnitude


E2M1 = np.array([_e2m1(c) for c in range(16)], np.float32)
E4M3FN = np.array([_e4m3fn(b) for b in range(256)], np.float32)
E8M0 = np.array([2.0 ** (b - 127) if b < 255 else np.nan for b in range(256)], np.float32)


def decode_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 [..., N, K/2] (low nibble = even element) x e8m0 bytes [..., N, K/32] -> float32 [..., N, K]."""
    b = packed.view(np.uint8)
    codes = np.empty((*b.shape[:-1], 2 * b.shape[-1]), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = b & 0xF, b >> 4
    return E2M1[codes] * np.repeat(E8M0[scale], 32, axis=-1)


def decode_fp8(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3fn [..., N, K] x block scales [..., ceil(N/128), ceil(K/128)] (e8m0 bytes or float32)."""
    s = E8M0[scale] if scale.dtype == np.uint8 else scale.astype(np.float32)
    n, k = weight.shape[-2:]
    s = s[..., np.arange(n) // 128, :][..., np.arange(k) // 128]
    return E4M3FN[weight.view(np.uint8)] * s


def dequantize_tensors(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Official-named stored tensors -> float32 values (quantized weights decoded with their scales)."""
    out = {}
    for name, value in stored.items():
        if name.endswith(".scale"):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        if value.dtype == np.int8:
            out[name] = decode_fp4(value, scale)
        elif value.dtype.itemsize == 1 and scale is not None:
            out[name] = decode_fp8(value, scale)
        else:
            out[name] = value
    return out
