"""QAT simulation (spec §5.8): the FP8 / FP4 rounding and Hadamard rotation the reference applies.

The checkpoint was trained with these roundings; reproducing them is optional for serving and off by
default: a build option, `load_model(path, qat_sim=True)` / `Model.random(config, qat_sim=True)`
(checked against the config by `check_dims`). Scales are powers of two (ue8m0), as in the reference
kernels.
Note: the pure-PyTorch mirror of the reference `act_quant` skips the cast to e4m3 on its in-place
path; the TileLang kernel (and this module) round to e4m3 / e2m1 values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.config import ConfigError, DSV4Config

FP8_MAX = 448.0
FP4_MAX = 6.0


def check_dims(config: DSV4Config) -> None:
    """Raise `ConfigError` unless `config`'s head dims suit the simulation's blocks: FP8 blocks of 64
    on the KV nope part, Hadamard and FP4 blocks of 32 on the indexer's queries and keys."""
    nope, index = config.nope_head_dim, config.index_head_dim
    if nope % 64 or index & (index - 1) or index % 32:
        raise ConfigError("qat_sim=True: needs (head_dim - qk_rope_head_dim) % 64 == 0 and a power-of-two "
                          "index_head_dim (FP8 blocks of 64, Hadamard, FP4 blocks of 32); "
                          f"this config has head_dim - qk_rope_head_dim = {config.head_dim} - "
                          f"{config.qk_rope_head_dim} = {nope} and index_head_dim = {index}")


def _blocks(x: jax.Array, block: int) -> jax.Array:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def pow2_ceil(v: jax.Array) -> jax.Array:
    """Smallest power of two >= v (v > 0), exactly: frexp/ldexp are bit operations, whereas
    exp2(ceil(log2(v))) is approximate on GPUs."""
    m, e = jnp.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(v), jnp.where(m == 0.5, e - 1, e))


def round_to_float(v: jax.Array, mantissa_bits: int, min_exponent: int) -> jax.Array:
    """Round to the nearest value with `mantissa_bits` explicit mantissa bits (ties to even),
    subnormals below 2^min_exponent; the caller clamps to the format's range.

    Arithmetic on an exact power-of-two grid rather than a cast round trip (f32 -> f8 -> f32), which
    XLA may drop as excess precision (it does on the GPU).
    """
    _, e = jnp.frexp(v)
    ulp = jnp.ldexp(jnp.ones_like(v), jnp.maximum(e - 1, min_exponent) - mantissa_bits)
    return jnp.round(v / ulp) * ulp


def fp8_sim(x: jax.Array, block: int) -> jax.Array:
    """Round x to e4m3 with one power-of-two scale per `block` channels; returns x's dtype."""
    xb = _blocks(x, block)
    scale = pow2_ceil(jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4) / FP8_MAX)
    q = round_to_float(jnp.clip(xb / scale, -FP8_MAX, FP8_MAX), mantissa_bits=3, min_exponent=-6)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def fp4_sim(x: jax.Array, block: int = 32) -> jax.Array:
    """Round x to e2m1 with one power-of-two scale per `block` channels; returns x's dtype."""
    xb = _blocks(x, block)
    scale = pow2_ceil(jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), FP4_MAX * 2.0 ** -126) / FP4_MAX)
    q = round_to_float(jnp.clip(xb / scale, -FP4_MAX, FP4_MAX), mantissa_bits=1, min_exponent=0)
    return (q * scale).reshape(x.shape).astype(x.dtype)


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of size n (a power of two), unnormalised."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(x: jax.Array) -> jax.Array:
    """Normalised Walsh-Hadamard transform over the last axis (orthogonal, scale n^-1/2)."""
    n = x.shape[-1]
    h = jnp.asarray(hadamard_matrix(n) * n ** -0.5)
    return jnp.einsum("...i,ij->...j", x.astype(jnp.float32), h,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)
