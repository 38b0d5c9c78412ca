"""Temporary stand-in for the sampler helper's module (same interface): warp_probs, sample."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def warp_probs(logits, temperature, top_k, top_p):
    """Per-row temperature / top-k / top-p warp to probabilities (fp32); T <= 0 is greedy one-hot.
    temperature, top_k, top_p broadcast against logits.shape[:-1]."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    t = jnp.asarray(temperature, jnp.float32)[..., None]
    greedy = jax.nn.one_hot(jnp.argmax(logits, -1), v, dtype=jnp.float32)
    scaled = logits / jnp.where(t > 0, t, 1.0)
    k = jnp.asarray(top_k, jnp.int32)[..., None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, v - 1), axis=-1)
    scaled = jnp.where((k > 0) & (k < v) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = before < jnp.asarray(top_p, jnp.float32)[..., None]
    keep = jnp.zeros_like(keep_sorted).at[..., :].set(False)
    keep = jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)
    probs = jnp.where(keep, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return jnp.where(t > 0, probs, greedy)


def sample(probs, exponentials):
    """Exponential race: argmax_v probs_v / E_v, E ~ Exp(1) (a sample from probs)."""
    return jnp.argmax(probs / exponentials, axis=-1).astype(jnp.int32)
