"""Basic layers with the reference numerics: linears [out, in] without bias, fp32 RMSNorm.

Parameter names mirror the official checkpoint (`weight`), so a checkpoint name such as
`layers.3.attn.wq_a.weight` is also the module path of the parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.model import quant_sim


class Keys:
    """Deterministic random init. `concrete=True` draws with numpy (no XLA compile per shape: fast
    for real small models); otherwise jax.random with fold_in(seed, counter), which traces cheaply
    under `nnx.eval_shape` for full-size abstract models. A plain counter, unlike nnx.Rngs, whose
    per-call Variable update makes tracing a 43-layer init quadratic."""

    def __init__(self, seed: int = 0, concrete: bool = False):
        self.seed, self.count, self.concrete = seed, 0, concrete
        self.np_rng = np.random.default_rng(seed) if concrete else None

    def _key(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(jax.random.key(self.seed), self.count)

    def normal(self, shape, dtype, std: float) -> jax.Array:
        if self.concrete:
            return jnp.asarray((self.np_rng.standard_normal(shape, np.float32) * std).astype(dtype))
        return (jax.random.normal(self._key(), shape, jnp.float32) * std).astype(dtype)

    def distinct_choices(self, rows: int, n: int, k: int) -> jax.Array:
        """[rows, k] int32: k distinct values of range(n) per row."""
        if self.concrete:
            return jnp.asarray(np.argsort(self.np_rng.random((rows, n)), axis=-1)[:, :k].astype(np.int32))
        return jnp.argsort(jax.random.uniform(self._key(), (rows, n)), axis=-1)[:, :k].astype(jnp.int32)


class Linear(nnx.Module):
    """y = x W^T, computed in the input dtype with fp32 accumulation.

    `fp8_input` marks linears whose checkpoint weight is FP8/FP4: with QAT simulation on, the
    reference quantizes their input activation to FP8 in 1x128 blocks first (`act_quant`).
    `compute_dtype` forces the matmul dtype (fp32 for the compressor's wkv/wgate and the head).
    """

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: Keys,
                 fp8_input: bool = False, compute_dtype=None):
        self.weight = nnx.Param(rngs.normal((out_features, in_features), dtype, in_features ** -0.5))
        self.fp8_input = fp8_input
        self.compute_dtype = compute_dtype

    def dense_weight(self, dtype) -> jax.Array:
        """The [out, in] weight in `dtype`; quantized subclasses dequantize here, inside the jit."""
        return self.weight[...].astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.compute_dtype or x.dtype
        x = x.astype(dtype)
        if self.fp8_input:
            x = quant_sim.fp8_sim(x, 128)
        return self.project(x, dtype).astype(dtype)

    def project(self, x: jax.Array, dtype) -> jax.Array:
        """x W^T with float32 accumulation (float32 result); quantized subclasses read their stored
        weight in place here."""
        return jnp.einsum("...i,oi->...o", x, self.dense_weight(dtype), preferred_element_type=jnp.float32)

    def grouped(self, x: jax.Array) -> jax.Array:
        """A grouped linear in x.dtype (the attention's `wo_a`): x [..., G, in] -> [..., G, out/G],
        group g through weight rows [g*out/G, (g+1)*out/G), float32 accumulation."""
        w = self.dense_weight(x.dtype)
        w = w.reshape(x.shape[-2], -1, w.shape[-1])
        return jnp.einsum("...gk,grk->...gr", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class RMSNorm(nnx.Module):
    """w * x * rsqrt(mean(x^2) + eps) in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs=None):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps)).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """Unweighted RMS normalisation over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: Keys):
        self.weight = nnx.Param(rngs.normal((vocab_size, dim), dtype, 1.0))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)
