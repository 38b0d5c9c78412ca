"""Decoding the checkpoint's quantized weight formats (spec §7.3-7.4), in jnp so it runs inside jit.

- e8m0 scale byte b: the power of two 2^(b - 127) (ue8m0; byte 255 is NaN in the format and never
  written). Kept as raw uint8 in memory.
- FP8 linears: e4m3fn weight [..., N, K] times one scale per 128 x 128 block [..., ceil(N/128),
  ceil(K/128)] (e8m0 bytes, or float32 in the -Base variants). The scale multiplies.
- ds_fp4 experts: int8 [..., N, K/2], two E2M1 codes per byte, low nibble = even element; one e8m0
  scale per 32 consecutive K elements [..., N, K/32]. Code 8 (negative zero) decodes to +0.0, as in
  the official converter's table.

Every decoded value is a small integer times a power of two, so the float32 products are exact; the
cast to bfloat16 is exact too for e8m0 scales (e4m3 and e2m1 have fewer mantissa bits than bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_BLOCK = 128
FP4_BLOCK = 32
# E2M1 code -> value; bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def scale_to_f32(scale: jax.Array) -> jax.Array:
    """e8m0 bytes (uint8) -> 2^(b - 127) in float32, exactly (ldexp is a bit operation); float32
    scales pass through."""
    if scale.dtype == jnp.uint8:
        return jnp.ldexp(jnp.ones(scale.shape, jnp.float32), scale.astype(jnp.int32) - 127)
    return scale.astype(jnp.float32)


def fp8_block_dequant(weight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """e4m3 [..., N, K] x block scales [..., ceil(N/128), ceil(K/128)] -> [..., N, K] in `dtype`."""
    n, k = weight.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale_to_f32(scale), FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n, :k]
    return (weight.astype(jnp.float32) * s).astype(dtype)


def fp4_unpack_codes(packed: jax.Array) -> jax.Array:
    """int8 [..., K/2] -> E2M1 codes uint8 [..., K], low nibble first."""
    b = jax.lax.bitcast_convert_type(packed, jnp.uint8)
    return jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def fp4_dequant(packed: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """ds_fp4 int8 [..., N, K/2] with e8m0 scales [..., N, K/32] -> [..., N, K] in `dtype`."""
    values = jnp.asarray(E2M1_VALUES)[fp4_unpack_codes(packed).astype(jnp.int32)]
    return (values * jnp.repeat(scale_to_f32(scale), FP4_BLOCK, axis=-1)).astype(dtype)


# Largest (rows x K blocks) for which `fp8_block_matmul` takes the block-expanded form; above it the
# extra products (rows * ceil(K/128) GEMV rows) cost more than decoding the weight once.
BLOCK_MATMUL_MAX_ROWS = 1024


def fp8_block_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x [..., K] @ dequant(weight e4m3 [N, K], scale [ceil(N/128), ceil(K/128)])^T -> float32 [..., N],
    without writing a decoded copy of the weight when the call has few rows (decode, verify).

    y[r, n] = sum_j s[n // 128, j] * (x[r, block j] . W[n, block j]). The per-block partial sums come
    from one plain dot of a block-expanded x — x_exp[r, j, k] = x[r, k] where k // 128 == j, else 0
    — with the e4m3 weight cast to `dtype` as the dot's operand (no scale, no batch dimension, so
    the compiler can fuse the cast into the dot and stream the 1-byte weight once). The block scales
    then multiply the float32 partials. For e8m0 scales every step is exact up to float32 summation
    order; float32 scales are applied in float32 (the reference's GEMM), not rounded into `dtype`.
    Calls with many rows (prefill) decode the weight and run one dot."""
    n, k = weight.shape
    nb, kb = scale.shape
    lead = x.shape[:-1]
    rows = 1
    for size in lead:
        rows *= size
    if rows * kb > BLOCK_MATMUL_MAX_ROWS:
        return jnp.einsum("...i,oi->...o", x.astype(dtype), fp8_block_dequant(weight, scale, dtype),
                          preferred_element_type=jnp.float32)
    xr = x.reshape(rows, k).astype(dtype)
    blocks = (jnp.arange(k) // FP8_BLOCK)[None, :] == jnp.arange(kb)[:, None]  # [Kb, K]
    x_exp = jnp.where(blocks[None], xr[:, None, :], jnp.zeros((), dtype))  # [R, Kb, K]
    partial = jnp.einsum("rjk,nk->rjn", x_exp, weight.astype(dtype), preferred_element_type=jnp.float32)
    s = jnp.repeat(scale_to_f32(scale), FP8_BLOCK, axis=0)[:n].T  # [Kb, N]
    return jnp.sum(partial * s[None], axis=1).reshape(*lead, n)


def fp8_scaled_x_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`fp8_block_matmul` with no extra products: the scales move onto x, once per output block.

    y[r, a*128 + b] = sum_k (x[r, k] * s[a, k // 128]) * W[a*128 + b, k]: one batched dot over the
    N/128 output blocks a (the weight's leading axis, so it is read in place, [N/128, 128, K]) of an
    x scaled per block [N/128, R, K]. x * s is exact for e8m0 scales (a power of two), so the
    products equal the decoded weight's. Needs N % 128 == 0; the scaled x holds R/128 x 2 bytes per
    weight byte, so it is for few rows (decode)."""
    n, k = weight.shape
    nb = scale.shape[0]
    if n % FP8_BLOCK:
        raise ValueError(f"fp8_scaled_x_matmul needs N % {FP8_BLOCK} == 0, got {n}")
    lead = x.shape[:-1]
    xr = x.reshape(-1, k).astype(jnp.float32)
    s = jnp.repeat(scale_to_f32(scale), FP8_BLOCK, axis=1)[:, :k]  # [Nb, K]
    xs = (xr[None] * s[:, None, :]).astype(dtype)  # [Nb, R, K]
    w = weight.reshape(nb, FP8_BLOCK, k).astype(dtype)
    y = jax.lax.dot_general(xs, w, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)  # [Nb, R, 128]
    return jnp.swapaxes(y, 0, 1).reshape(*lead, n)
