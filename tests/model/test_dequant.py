"""Decoding inside jit equals the independent numpy reference bit for bit, on fresh random inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jdspark.model.dequant import fp4_dequant, fp8_block_dequant, scale_to_f32
from tests.model.dequant_ref import E2M1, E8M0, decode_fp4, decode_fp8


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def test_reference_tables_match_the_spec():
    assert E2M1.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert E8M0[127] == 1.0 and E8M0[128] == 2.0 and E8M0[120] == 2.0 ** -7


def test_e8m0_scales_decode_exactly():
    # 255 is NaN in the format and never written; byte 0 is 2^-127, a float32 subnormal, which XLA
    # flushes to zero (the quantizers never write it: their smallest scale byte is 1).
    b = np.arange(1, 255, dtype=np.uint8)
    np.testing.assert_array_equal(bits(jax.jit(scale_to_f32)(b)), bits(E8M0[1:255]))


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)])
def test_fp4_decoding_matches_reference(shape):
    rng = np.random.default_rng(sum(shape))
    *lead, n, k = (*shape[:-1], 1, shape[-1]) if len(shape) == 2 else shape
    packed = rng.integers(-128, 128, (*lead, n, k // 2), dtype=np.int8)  # every byte value: all code pairs
    scale = rng.integers(110, 140, (*lead, n, k // 32), dtype=np.uint8)
    out = jax.jit(lambda p, s: fp4_dequant(p, s, jnp.float32))(packed, scale)
    assert out.shape == (*lead, n, k)
    np.testing.assert_array_equal(bits(out), bits(decode_fp4(packed, scale)))


def test_fp4_nibble_order_low_first():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, :2] = [0x71, 0x0A]  # codes 1, 7, 10, 0
    out = fp4_dequant(packed.view(np.int8), np.array([[127]], np.uint8), jnp.float32)[..., :4]
    np.testing.assert_array_equal(np.asarray(out), [[0.5, 6.0, -1.0, 0.0]])


@pytest.mark.parametrize("scale_dtype", ["e8m0", "float32"])
@pytest.mark.parametrize("shape", [(200, 300), (2, 128, 256), (96, 64)])
def test_fp8_block_decoding_matches_reference(shape, scale_dtype):
    rng = np.random.default_rng(len(shape))
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # drop the NaN codes
    weight = raw.view(ml_dtypes.float8_e4m3fn)
    blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale = rng.integers(100, 150, blocks, dtype=np.uint8) if scale_dtype == "e8m0" \
        else rng.uniform(1e-4, 1e-2, blocks).astype(np.float32)
    out = jax.jit(lambda w, s: fp8_block_dequant(w, s, jnp.float32))(weight, scale)
    np.testing.assert_array_equal(bits(out), bits(decode_fp8(weight, scale)))


def test_bfloat16_decoding_is_exact_for_e8m0_scales():
    rng = np.random.default_rng(5)
    packed = rng.integers(-128, 128, (4, 64), dtype=np.int8)
    scale = rng.integers(110, 140, (4, 4), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(fp4_dequant(packed, scale, jnp.bfloat16), np.float32),
                                  decode_fp4(packed, scale))
    weight = rng.integers(0, 0x7F, (130, 140), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(110, 140, (2, 2), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(fp8_block_dequant(weight, scale, jnp.bfloat16), np.float32),
                                  decode_fp8(weight, scale))


@pytest.mark.parametrize("scale_dtype", ["e8m0", "float32"])
@pytest.mark.parametrize("shape", [(200, 300), (256, 384), (96, 64)])
@pytest.mark.parametrize("lead", [(1,), (2, 3), (64,), (3, 200)])  # (3, 200): the decoded-weight branch
def test_fp8_block_matmul_matches_decoded_weight(shape, scale_dtype, lead):
    from jdspark.model.dequant import fp8_block_matmul
    rng = np.random.default_rng(sum(shape) + len(lead))
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    weight = raw.view(ml_dtypes.float8_e4m3fn)
    blocks = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale = rng.integers(110, 130, blocks, dtype=np.uint8) if scale_dtype == "e8m0" \
        else rng.uniform(1e-4, 1e-2, blocks).astype(np.float32)
    x = rng.standard_normal((*lead, shape[1])).astype(np.float32)
    out = jax.jit(lambda x, w, s: fp8_block_matmul(x, w, s, jnp.float32))(x, weight, scale)
    want = x.astype(np.float64) @ decode_fp8(weight, scale).astype(np.float64).T
    assert out.shape == (*lead, shape[0]) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_fp8_block_matmul_bfloat16_equals_the_decoded_dot():
    """In bfloat16 with e8m0 scales the block form computes the decoded-weight dot's products
    exactly; only the float32 summation order differs."""
    from jdspark.model.dequant import fp8_block_matmul
    rng = np.random.default_rng(9)
    weight = rng.integers(0, 0x7F, (256, 512), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(110, 130, (2, 4), dtype=np.uint8)
    x = jnp.asarray(rng.standard_normal((6, 512)), jnp.bfloat16)
    got = jax.jit(lambda x, w, s: fp8_block_matmul(x, w, s, jnp.bfloat16))(x, weight, scale)
    want = jnp.einsum("ri,oi->ro", x, fp8_block_dequant(weight, scale, jnp.bfloat16),
                      preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("scale_dtype", ["e8m0", "float32"])
@pytest.mark.parametrize("lead", [(1,), (2, 3)])
def test_fp8_scaled_x_matmul_matches_decoded_weight(scale_dtype, lead):
    from jdspark.model.dequant import fp8_scaled_x_matmul
    rng = np.random.default_rng(len(lead))
    shape = (256, 300)
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    weight = raw.view(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(110, 130, (2, 3), dtype=np.uint8) if scale_dtype == "e8m0" \
        else rng.uniform(1e-4, 1e-2, (2, 3)).astype(np.float32)
    x = rng.standard_normal((*lead, shape[1])).astype(np.float32)
    out = jax.jit(lambda x, w, s: fp8_scaled_x_matmul(x, w, s, jnp.float32))(x, weight, scale)
    want = x.astype(np.float64) @ decode_fp8(weight, scale).astype(np.float64).T
    assert out.shape == (*lead, shape[0])
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-6 * np.abs(want).max())
