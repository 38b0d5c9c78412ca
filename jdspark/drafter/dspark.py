"""The DSpark drafter in its DeepSeek-V4 production form (spec dspark.md §3.9, §4).

The drafter never runs the prompt. Each committed position t contributes one context row per
stage: main_x_t = main_norm(main_proj . f_t) from the target features f_t, then that stage's window
K=V projection rotated at t (`push_context`). A draft block is [anchor, noise x (gamma-1)] at
positions start..start+gamma-1; every stage attends to the last `window` context rows plus all
block rows; the HC head's pre-norm output h gives the base logits U = head(norm(h)) through the
target's head. Tokens are then sampled left to right with the Markov bias W2 . W1[prev], and the
distribution each token was drawn from is returned as q (what exact verification needs). The
confidence c_k = sigmoid(w . [h_k; W1[prev_k]]) reads the pre-norm h.

Training (`jdspark.train.drafter`) runs these same functions: `context_rows` and `cache_after` give
the cache the engine would hold at an anchor, `draft_hidden` the block, and `teacher_forced_logits`
the logits `propose` warps when the previous tokens are given instead of drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jdspark.config import DSV4Config
from jdspark.model import state
from jdspark.model.dsv4 import DSV4
from jdspark.speculative.sampling import sample, warp_probs


@struct.dataclass
class DraftCache:
    """Per stage a ring of context K=V rows indexed by position; only committed positions are
    written, so a ring of exactly `sliding_window` rows suffices and nothing is ever rolled back."""

    windows: tuple[jax.Array, ...]  # per stage [B, window, head_dim]
    length: jax.Array  # [B] int32: positions 0..length-1 have context rows (= the anchor's position)


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, gamma] int32
    q: jax.Array  # [B, gamma, V] fp32: the warped distribution token k was drawn from
    confidence: jax.Array  # [B, gamma] fp32: P(draft k accepted | drafts < k accepted)


def init_draft_cache(config: DSV4Config, batch: int, dtype) -> DraftCache:
    shape = (batch, config.sliding_window, config.head_dim)
    return DraftCache(windows=tuple(jnp.zeros(shape, dtype) for _ in range(config.dspark.num_stages)),
                      length=jnp.zeros((batch,), jnp.int32))


def push_context(model: DSV4, cache: DraftCache, features: jax.Array, n_valid: jax.Array) -> DraftCache:
    """Append the context rows of features [B, S, F] (positions length..length+S-1; the first
    n_valid[b] are committed and written)."""
    positions = cache.length[:, None] + jnp.arange(features.shape[1])
    rows = context_rows(model, features, positions)
    windows = tuple(state.write_rows(ring, r, cache.length, n_valid) for ring, r in zip(cache.windows, rows))
    return DraftCache(windows=windows, length=cache.length + n_valid)


def context_rows(model: DSV4, features: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
    """Per stage the context K=V rows [B, S, head_dim] of features [B, S, F] at positions [B, S]:
    main_norm(main_proj . f), then the stage's window projection rotated at each position."""
    first = model.mtp[0]
    main_x = first.main_norm(first.main_proj(features.astype(model.dtype)))
    return tuple(stage.attn.window_kv(main_x, positions) for stage in model.mtp)


def cache_after(config: DSV4Config, rows: tuple[jax.Array, ...], sequence: jax.Array,
                length: jax.Array) -> DraftCache:
    """The cache `push_context` leaves in slot n after positions 0..length[n]-1 of sequence[n] were
    pushed, gathered from the context rows of whole sequences (`context_rows` at 0..S-1): ring slot
    r holds the last position < length[n] congruent to r mod the window. A slot never written holds
    position 0's row instead of the engine's zeros; attention masks both."""
    held = state.ring_positions(length, config.sliding_window)
    return DraftCache(windows=tuple(r[sequence[:, None], jnp.maximum(held, 0)] for r in rows), length=length)


def reset_draft_slots(cache: DraftCache, slots: jax.Array) -> DraftCache:
    return cache.replace(length=jnp.where(slots, 0, cache.length))


def draft_hidden(model: DSV4, cache: DraftCache, anchor: jax.Array) -> jax.Array:
    """The pre-norm HC-head output h [B, gamma, D] of the block [anchor, noise x (gamma-1)]."""
    dspark = model.config.dspark
    b, gamma = anchor.shape[0], dspark.block_size
    ids = jnp.concatenate([anchor[:, None], jnp.full((b, gamma - 1), dspark.noise_token_id, jnp.int32)], axis=1)
    positions = cache.length[:, None] + jnp.arange(gamma)
    x = model.embed_streams(ids)
    for stage, ring in zip(model.mtp, cache.windows):
        x = stage.draft(x, positions, ids, ring, cache.length)
    return model.mtp[-1].hc_head(x)


def propose(model: DSV4, cache: DraftCache, anchor: jax.Array, temperature: jax.Array, top_k: jax.Array,
            top_p: jax.Array, exponentials: jax.Array) -> Proposal:
    """Draft gamma tokens after `anchor` [B] (the token at position cache.length). Sampling
    parameters are per slot [B]; exponentials [B, gamma, V] are the race noise for each draw."""
    h = draft_hidden(model, cache, anchor)
    base = base_logits(model, h)  # [B, gamma, V]

    def step(prev, inputs):
        base_k, noise_k = inputs
        e = markov_embed(model, prev)  # [B, r]
        q = warp_probs(base_k + markov_bias(model, e), temperature, top_k, top_p)
        token = sample(q, noise_k)
        return token, (token, q, e)

    scan_in = (jnp.swapaxes(base, 0, 1), jnp.swapaxes(exponentials, 0, 1))
    _, (tokens, q, prev_embed) = jax.lax.scan(step, anchor.astype(jnp.int32), scan_in, unroll=True)  # no device loop
    tokens, q, prev_embed = (jnp.swapaxes(a, 0, 1) for a in (tokens, q, prev_embed))
    return Proposal(tokens=tokens, q=q, confidence=confidence(model, h, prev_embed))


def base_logits(model: DSV4, h: jax.Array) -> jax.Array:
    """U = head(norm(h)) [..., V] fp32: the draft logits before the Markov bias."""
    return model.head(model.mtp[-1].norm(h).astype(jnp.float32))


def markov_embed(model: DSV4, prev: jax.Array) -> jax.Array:
    """W1[prev] [..., r] fp32 for the previous tokens prev [...]."""
    return model.mtp[-1].markov_head.embed.weight[...].astype(jnp.float32)[prev]


def markov_bias(model: DSV4, prev_embed: jax.Array) -> jax.Array:
    """W2 . W1[prev] [..., V] from prev_embed = W1[prev]."""
    return model.mtp[-1].markov_head.head(prev_embed)


def teacher_forced_logits(model: DSV4, h: jax.Array, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(draft logits [..., gamma, V], W1[prev]) with the Markov bias of given previous tokens prev
    [..., gamma] (prev[k] is the token before draft k): what `propose` warps at draft k when it drew
    prev[k] itself. Training supervises these."""
    prev_embed = markov_embed(model, prev)
    return base_logits(model, h) + markov_bias(model, prev_embed), prev_embed


def confidence_logits(model: DSV4, h: jax.Array, prev_embed: jax.Array) -> jax.Array:
    """Raw confidence logits z [..., gamma] from the pre-norm h and W1[prev] (before STS)."""
    conf_in = jnp.concatenate([h.astype(jnp.float32), prev_embed], axis=-1)
    return model.mtp[-1].confidence_head.proj(conf_in)[..., 0]


def confidence(model: DSV4, h: jax.Array, prev_embed: jax.Array) -> jax.Array:
    """c_k = sigmoid(z_k / T_k) with the config's STS temperatures (spec dspark.md §10)."""
    z = confidence_logits(model, h, prev_embed)
    temperatures = model.config.dspark.confidence_temperatures
    if temperatures is not None:
        z = z / jnp.asarray(temperatures, jnp.float32)
    return jax.nn.sigmoid(z)
