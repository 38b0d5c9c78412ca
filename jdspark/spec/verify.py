"""Temporary stand-in for the sampler helper's module (same interface)."""

from __future__ import annotations

import jax.numpy as jnp

from jdspark.spec.sampling import sample, warp_probs


def ref_rejection_sample(target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p):
    b, k1, v = target_logits.shape
    k = k1 - 1
    p = warp_probs(target_logits, temperature[:, None], top_k[:, None], top_p[:, None])
    if k == 0:
        return jnp.zeros((b,), jnp.int32), sample(p[:, 0], exponentials)
    p_tok = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], -1)[..., 0]
    q_tok = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    greedy = (temperature <= 0)[:, None]
    accept = jnp.where(greedy, p_tok > 0.5, p_tok > uniforms * q_tok)
    n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    row = jnp.minimum(n_acc, k - 1)
    p_row = jnp.take_along_axis(p, row[:, None, None], 1)[:, 0]
    q_row = jnp.take_along_axis(draft_probs, row[:, None, None], 1)[:, 0]
    residual = jnp.maximum(p_row - q_row, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_row)
    residual = jnp.where(greedy, p_row, residual)
    dist = jnp.where((n_acc < k)[:, None], residual, p[:, k])
    return n_acc.astype(jnp.int32), sample(dist, exponentials)


def rejection_sample(*args, use_kernel: bool = False):
    return ref_rejection_sample(*args)
