"""Interleaved RoPE on the last `qk_rope_head_dim` channels, with YaRN on compressed layers only.

Window-only layers (SWA, MTP, drafter) use `rope_theta` without YaRN; CSA/HCA layers, their
compressors and the indexer use `compress_rope_theta` with YaRN (spec §4). No YaRN mscale anywhere.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.config import DSV4Config


def yarn_correction_range(rope_dim: int, base: float, original_seq_len: int,
                          beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """(low, high) pair indices of the YaRN ramp, as the reference computes them."""
    def corr(rotations):
        return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    return low, (high + 0.001 if low == high else high)


def inv_frequencies(rope_dim: int, base: float, factor: float = 1.0, original_seq_len: int = 0,
                    beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """theta_i for the rope_dim/2 interleaved pairs (float32, like the reference)."""
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))))
    freqs = freqs.astype(np.float32)
    if original_seq_len > 0:
        low, high = yarn_correction_range(rope_dim, base, original_seq_len, beta_fast, beta_slow)
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        freqs = (freqs / np.float32(factor) * ramp + freqs * (1 - ramp)).astype(np.float32)
    return freqs


@dataclasses.dataclass(frozen=True)
class Rope:
    """Static description of one frequency table (hashable, so modules keep it out of their state)."""

    rope_dim: int
    base: float
    factor: float = 1.0
    original_seq_len: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self) -> np.ndarray:
        return inv_frequencies(self.rope_dim, self.base, self.factor, self.original_seq_len,
                               self.beta_fast, self.beta_slow)


def layer_rope(config: DSV4Config, compressed: bool) -> Rope:
    """Window-only layers: rope_theta, no YaRN. Compressed layers: compress_rope_theta + YaRN."""
    if not compressed:
        return Rope(config.qk_rope_head_dim, config.rope_theta)
    return Rope(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_factor,
                config.original_seq_len, config.beta_fast, config.beta_slow)


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope, inverse: bool = False) -> jax.Array:
    """Rotate the last `rope.rope_dim` channels of x in interleaved pairs at `positions`.

    x: [..., T, (heads,) C]; positions: broadcastable to x.shape[:-1] once a head axis is added by the
    caller, i.e. positions has x's leading dims up to and including T. `inverse` rotates by -angle
    (the de-rotation of the attention output at the query position).
    """
    r = rope.rope_dim
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq())  # [..., T, r/2]
    while angles.ndim < x.ndim:  # broadcast over any axes between T and channels (heads)
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        sin = -sin
    rope = x[..., -r:].astype(jnp.float32).reshape(*x.shape[:-1], r // 2, 2)
    even, odd = rope[..., 0], rope[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(*x.shape[:-1], r)
    return jnp.concatenate([x[..., :-r], rotated.astype(x.dtype)], axis=-1)
