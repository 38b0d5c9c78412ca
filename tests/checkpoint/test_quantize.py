"""The quantizers store what the official formats define: power-of-two block scales covering the
block's amax, and each value rounded to the nearest code (checked against the independent tables)."""

import numpy as np
import pytest

from jdspark.checkpoint.quantize import quantize_fp4, quantize_fp8, quantize_tensors
from jdspark.model.quantized import Storage
from tests.model.dequant_ref import E2M1, E4M3FN, E8M0, decode_fp4


def nearest_code_distance(x: np.ndarray, codes: np.ndarray) -> np.ndarray:
    finite = codes[np.isfinite(codes)]
    return np.abs(x[..., None] - finite).min(axis=-1)


@pytest.mark.parametrize("shape", [(3, 200, 300), (128, 128)])
def test_fp8_e8m0_blocks(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.02
    q, s = quantize_fp8(w)
    assert q.shape == w.shape and s.dtype == np.uint8 and s.shape == (*shape[:-2], -(-shape[-2] // 128),
                                                                      -(-shape[-1] // 128))
    scale = E8M0[s]
    amax = np.abs(np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, -n % 128) for n in shape[-2:]])).reshape(
        *s.shape[:-2], s.shape[-2], 128, s.shape[-1], 128).max(axis=(-3, -1))
    assert np.all(amax <= 448 * scale) and np.all(amax > 224 * scale)  # the smallest power of two that fits
    x = w / scale[..., np.arange(shape[-2]) // 128, :][..., np.arange(shape[-1]) // 128]
    np.testing.assert_array_equal(np.abs(x - E4M3FN[q.view(np.uint8)]), nearest_code_distance(x, E4M3FN))


def test_fp8_float32_scales_are_amax_over_448():
    w = np.random.default_rng(1).standard_normal((130, 256)).astype(np.float32)
    q, s = quantize_fp8(w, "float32")
    assert s.dtype == np.float32 and s.shape == (2, 2)
    np.testing.assert_allclose(s[0, 1], np.abs(w[:128, 128:]).max() / 448, rtol=1e-7)
    per_elem_scale = s[np.arange(130) // 128][:, np.arange(256) // 128]
    x = np.clip(w / per_elem_scale, -448, 448)
    np.testing.assert_array_equal(np.abs(x - E4M3FN[q.view(np.uint8)]), nearest_code_distance(x, E4M3FN))


def test_fp4_codes_scales_and_nibble_order():
    w = np.random.default_rng(2).standard_normal((4, 5, 96)).astype(np.float32)
    packed, s = quantize_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (4, 5, 48) and s.shape == (4, 5, 3)
    scale = np.repeat(E8M0[s], 32, axis=-1)
    amax = np.abs(w).reshape(4, 5, 3, 32).max(-1)
    assert np.all(amax <= 6 * E8M0[s]) and np.all(amax > 3 * E8M0[s])
    x = w / scale
    np.testing.assert_array_equal(np.abs(x - decode_fp4(packed, np.full_like(s, 127))), nearest_code_distance(x, E2M1))
    row = np.zeros((1, 32), np.float32)
    row[0, :2] = [1.0, -2.0]  # scale 2/6 rounded up to 2^-1: values 2 (code 4) and -4 (code 8 + 6)
    packed, s = quantize_fp4(row)
    assert s[0, 0] == 126 and packed.view(np.uint8)[0, 0] == (14 << 4) | 4  # low nibble = element 0


def test_quantize_tensors_follows_the_storage():
    t = {"layers.0.attn.wq_a.weight": np.ones((128, 256), np.float32),
         "layers.0.attn.compressor.wkv.weight": np.ones((64, 256), np.float32),
         "layers.0.ffn.experts.1.w1.weight": np.ones((64, 256), np.float32)}
    out, names = quantize_tensors(t, Storage(linears="fp8", experts="fp4"))
    assert out["layers.0.attn.wq_a.scale"].shape == (1, 2) and out["layers.0.attn.compressor.wkv.weight"] is \
        t["layers.0.attn.compressor.wkv.weight"]
    assert out["layers.0.ffn.experts.1.w1.weight"].shape == (64, 128)
    assert names == {"layers.0.attn.wq_a.scale": "F8_E8M0", "layers.0.ffn.experts.1.w1.scale": "F8_E8M0"}
