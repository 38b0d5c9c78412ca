"""Speculative decoding replayed on a target sample: where blocks start and what tau generation gets.

Exact verification emits a sequence distributed as the target's samples whatever the drafter does,
so a generation run is a target sample x plus block boundaries. Given x, draft k of a block
anchored at a was accepted with probability alpha_k(a) = min(1, q_k(x_{a+k}) / p(x_{a+k})): of the
ways the emitted token can be x_{a+k}, accepting the draft has probability min(q, p)(x) and
rejecting it max(0, p - q)(x), out of p(x). The blocks then form a renewal chain over the
positions of x: a block anchored at a ends at a + j (the first rejection at draft j, whose
residual sample is the next anchor) or at a + gamma + 1 (all accepted, the bonus). Replaying that
chain with teacher-forced drafter outputs at every position gives, without sampling noise, the
anchor distribution generation meets (mostly tokens the drafter under-predicted) and its tau —
uniform anchors over-state both (docs/BENCHMARKS.md, "Where generation's blocks start").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.model.dsv4 import DSV4
from jdspark.train import drafter


def token_acceptance(module: DSV4, target_logp: jax.Array, features: jax.Array, ids: jax.Array,
                     anchors: jax.Array) -> jax.Array:
    """alpha [B, A, gamma]: P(draft k accepted | the emitted token is ids[a + k]) at T = 1 for the
    blocks at anchors [B, A] (Markov head teacher-forced, as the prefix that reaches k was)."""
    logits, _, labels, (row, offsets) = drafter.block_outputs(module, features, ids, anchors)
    logq = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]
    logp = target_logp[row[:, None], offsets, labels]
    return jnp.exp(jnp.minimum(logq - logp, 0.0)).reshape(*anchors.shape, -1)


def block_lengths(alpha: jax.Array) -> jax.Array:
    """[..., gamma + 1]: P(the block emits j + 1 tokens), j = 0..gamma accepted drafts."""
    reach = jnp.cumprod(jnp.concatenate([jnp.ones_like(alpha[..., :1]), alpha], axis=-1), axis=-1)
    stop = jnp.concatenate([1 - alpha, jnp.ones_like(alpha[..., :1])], axis=-1)
    return reach * stop


def anchor_probabilities(lengths: jax.Array) -> jax.Array:
    """pi [B, L]: P(position l is a block's anchor) given the block lengths [B, L, gamma + 1]
    (`block_lengths`; a block anchored at l puts the next anchor at l + 1 + j) at consecutive
    positions, the first of which is an anchor (the prompt's last token)."""
    span = lengths.shape[-1]

    def step(incoming, lengths_l):  # incoming [B, span]: mass arriving at l, l + 1, ...
        pi = incoming[:, 0]
        shifted = jnp.concatenate([incoming[:, 1:], jnp.zeros_like(incoming[:, :1])], axis=1)
        return shifted + pi[:, None] * lengths_l, pi

    start = jnp.zeros((lengths.shape[0], span), lengths.dtype).at[:, 0].set(1.0)
    _, pi = jax.lax.scan(step, start, jnp.swapaxes(lengths, 0, 1))
    return jnp.swapaxes(pi, 0, 1)


def replayed_generation(alpha: jax.Array) -> dict[str, jax.Array]:
    """tau (emitted tokens per verification, bonus included) and the fraction of blocks whose
    accepted prefix reaches each draft position, over the blocks the chain visits; alpha [B, L,
    gamma] at consecutive positions from an anchor, as `token_acceptance` gives them."""
    lengths = block_lengths(alpha)
    pi = anchor_probabilities(lengths)
    steps = jnp.sum(pi)
    emitted = jnp.sum(pi[..., None] * lengths * jnp.arange(1, alpha.shape[-1] + 2))
    reached = jnp.sum(pi[..., None] * jnp.cumprod(alpha, axis=-1), axis=(0, 1)) / steps
    return {"tau": emitted / steps, "acceptance": reached, "anchors": pi}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def sample_acceptance(draft_params, frozen, ids: jax.Array, anchors: jax.Array, *, graphdef) -> jax.Array:
    """`token_acceptance` of the drafter on ids [B, S] (target samples), the target run here too."""
    module = nnx.merge(graphdef, draft_params, frozen)
    target_logp, features = drafter.target_outputs(module, ids)
    return token_acceptance(module, target_logp, features, ids, anchors)
