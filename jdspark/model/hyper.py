"""mHC hyper-connections (spec §5.2, §5.6): C residual streams mixed around every sublayer.

All mixing math runs in fp32. The Sinkhorn-projected comb matrix P is applied transposed:
X'_j = sum_i P[i, j] X_i + post_j f (P is doubly stochastic but not symmetric).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.model.layers import Keys, rms_normalize
from pallas_kernels import resolve_implementation
from pallas_kernels import sinkhorn as kernels


def sinkhorn(logits: jax.Array, iters: int, eps: float, implementation: str = "auto") -> jax.Array:
    """The Sinkhorn projection of comb logits [..., C, C]: "pallas" is the kernel (one launch per mHC
    site instead of a device loop of iters-1 launches), "xla" the jnp reference, "auto" the kernel
    on the GPU (`pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "pallas":
        return kernels.sinkhorn(logits, iters, eps)
    return kernels.ref_sinkhorn(logits, iters, eps)


def with_implementation(graphdef: nnx.GraphDef, params: nnx.State, implementation: str) -> nnx.GraphDef:
    """The model graph `graphdef` with its kernel choice set to `implementation` ("auto", "pallas" or
    "xla") in every module that declares an `implementation` field (each mHC site's Sinkhorn, and any
    kernel-backed layer that declares one the same way); the parameters are unchanged. The setting
    is a static field, so executables traced from the returned graph use it, and nothing global
    changes."""
    resolve_implementation(implementation)  # validates it
    module = nnx.merge(graphdef, params)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module) and "implementation" in vars(node):
            node.implementation = implementation
    return nnx.split(module)[0]


def _mixes(x: jax.Array, fn: jax.Array, norm_eps: float) -> jax.Array:
    """rsqrt(mean over all C*D entries) * (fn . flatten(x)), in fp32. x: [..., C, D]."""
    flat = rms_normalize(x.reshape(*x.shape[:-2], -1), norm_eps)
    return jnp.einsum("...k,mk->...m", flat, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _stream_sum(w: jax.Array, x: jax.Array) -> jax.Array:
    """sum_i w[..., i, j] X_i over the C streams, fp32, in stream order: w [..., C, J], x [..., C, D]
    -> [..., J, D]. Written out (C = 4 terms), not as a dot, so XLA fuses it with its neighbours
    instead of launching a matmul for a 4-term sum (the optimised HLO of a Flash-dims decode step on
    the H200 had a 4 x 4 gemm per mHC site)."""
    x = x.astype(jnp.float32)
    total = w[..., 0, :, None] * x[..., 0, None, :]
    for i in range(1, x.shape[-2]):
        total = total + w[..., i, :, None] * x[..., i, None, :]
    return total


def collapse(x: jax.Array, pre: jax.Array) -> jax.Array:
    """u = sum_i pre_i X_i in fp32, cast to the stream dtype. x: [..., C, D], pre: [..., C]."""
    return _stream_sum(pre[..., None], x)[..., 0, :].astype(x.dtype)


class HyperConnection(nnx.Module):
    """Parameters of one mHC site: fn [(2+C)C, C*D], base [(2+C)C], scale [3] (all fp32)."""

    def __init__(self, hc_mult: int, dim: int, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 rngs: Keys):
        mix = (2 + hc_mult) * hc_mult
        self.fn = nnx.Param(rngs.normal((mix, hc_mult * dim), jnp.float32, (hc_mult * dim) ** -0.5))
        self.base = nnx.Param(jnp.zeros((mix,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.implementation = "auto"  # the Sinkhorn kernel choice; set with `with_implementation`

    def pre(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., C, D] -> (u [..., D] in x.dtype, post [..., C], comb [..., C, C]) (fp32 weights)."""
        c = self.hc_mult
        mixes = _mixes(x, self.fn[...], self.norm_eps)
        scale, base = self.scale[...], self.base[...]
        pre = jax.nn.sigmoid(mixes[..., :c] * scale[0] + base[:c]) + self.hc_eps
        post = 2.0 * jax.nn.sigmoid(mixes[..., c:2 * c] * scale[1] + base[c:2 * c])
        comb_logits = (mixes[..., 2 * c:] * scale[2] + base[2 * c:]).reshape(*mixes.shape[:-1], c, c)
        comb = sinkhorn(comb_logits, self.sinkhorn_iters, self.hc_eps, self.implementation)
        return collapse(x, pre), post, comb

    @staticmethod
    def post(f: jax.Array, residual: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """X' = comb^T X + post (x) f, cast to the stream dtype. f: [..., D], residual: [..., C, D]."""
        out = post[..., :, None] * f.astype(jnp.float32)[..., None, :] + _stream_sum(comb, residual)
        return out.astype(residual.dtype)


def hc_head(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, hc_eps: float,
            norm_eps: float) -> jax.Array:
    """Final stream collapse: pre = sigmoid(scale * mixes + base) + eps; no Sinkhorn. x: [..., C, D]."""
    pre = jax.nn.sigmoid(_mixes(x, fn, norm_eps) * scale[0] + base) + hc_eps
    return collapse(x, pre)
