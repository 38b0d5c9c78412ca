"""Basic layers with the reference numerics: linears [out, in] without bias, fp32 RMSNorm.

Parameter names mirror the official checkpoint (`weight`), so a checkpoint name such as
`layers.3.attn.wq_a.weight` is also the module path of the parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.model import quant_sim


def normal_init(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x W^T, computed in the input dtype with fp32 accumulation.

    `fp8_input` marks linears whose checkpoint weight is FP8/FP4: with QAT simulation on, the
    reference quantizes their input activation to FP8 in 1x128 blocks first (`act_quant`).
    `compute_dtype` forces the matmul dtype (fp32 for the compressor's wkv/wgate and the head).
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs,
                 fp8_input: bool = False, compute_dtype=None):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), dtype, in_features ** -0.5))
        self.fp8_input = fp8_input
        self.compute_dtype = compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.compute_dtype or x.dtype
        x = x.astype(dtype)
        if self.fp8_input:
            x = quant_sim.fp8_sim(x, 128)
        y = jnp.einsum("...i,oi->...o", x, self.weight[...].astype(dtype), preferred_element_type=jnp.float32)
        return y.astype(dtype)


class RMSNorm(nnx.Module):
    """w * x * rsqrt(mean(x^2) + eps) in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps)).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Unweighted RMS normalisation over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (vocab_size, dim), dtype, 1.0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)
