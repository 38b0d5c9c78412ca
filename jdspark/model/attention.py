"""Attention sublayer (spec §5.3): low-rank query with per-head RMS, one shared K=V head over a
sliding window plus compressed entries (CSA: indexer-selected, HCA: all visible), a per-head sink,
de-rotation of the output at the query position, and the grouped low-rank output projection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model import quant_sim, state
from jdspark.model.compressor import Compressor
from jdspark.model.indexer import Indexer
from jdspark.model.layers import Keys, Linear, RMSNorm, rms_normalize
from jdspark.model.rope import apply_rope, layer_rope
from jdspark.model.state import LayerCache


def _sink_weights(logits: jax.Array, mask: jax.Array, sink: jax.Array) -> jax.Array:
    """Softmax weights [B, S, N, T] of fp32 logits over the keys in mask [B, S, T], with the sink's
    extra logit in the denominator."""
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a query with no visible key: only the sink remains
    e = jnp.exp(logits - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink.astype(jnp.float32)[:, None] - m))


def sink_attention(q: jax.Array, kv: jax.Array, mask: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """Softmax attention with one extra zero-valued logit per head (the sink), in fp32.

    q: [B, S, N, H]; kv: [B, T, H] (keys are values); mask: [B, S, T] bool; sink: [N].
    o = sum_t exp(s_t - M) kv_t / (sum_t exp(s_t - M) + exp(sink - M)), M = max_t s_t.
    """
    kv = kv.astype(jnp.float32)
    p = _sink_weights(jnp.einsum("bsnh,bth->bsnt", q.astype(jnp.float32), kv) * scale, mask, sink)
    return jnp.einsum("bsnt,bth->bsnh", p, kv).astype(q.dtype)


def sink_attention_selected(q: jax.Array, kv: jax.Array, mask: jax.Array, selected: jax.Array,
                            selected_mask: jax.Array, sink: jax.Array, scale: float) -> jax.Array:
    """`sink_attention` over the shared keys kv [B, T, H] (mask [B, S, T]) together with each query's
    own keys selected [B, S, K, H] (selected_mask [B, S, K]): one softmax over both sets, so a CSA
    query reads only its K gathered entries instead of scoring every compressed entry."""
    q32, kv, selected = q.astype(jnp.float32), kv.astype(jnp.float32), selected.astype(jnp.float32)
    logits = jnp.concatenate([jnp.einsum("bsnh,bth->bsnt", q32, kv),
                              jnp.einsum("bsnh,bskh->bsnk", q32, selected)], axis=-1) * scale
    p = _sink_weights(logits, jnp.concatenate([mask, selected_mask], axis=-1), sink)
    t = kv.shape[1]
    o = jnp.einsum("bsnt,bth->bsnh", p[..., :t], kv) + jnp.einsum("bsnk,bskh->bsnh", p[..., t:], selected)
    return o.astype(q.dtype)


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """[B, S, T]: key position within (q - window, q]."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    return (diff >= 0) & (diff < window)


class Attention(nnx.Module):
    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys, qat_sim: bool = False):
        c = config
        self.kind = c.layer_kind(layer_id)
        self.n_heads, self.head_dim, self.rope_dim = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim
        self.window, self.ratio, self.groups = c.sliding_window, c.layer_ratio(layer_id), c.o_groups
        self.eps, self.qat_sim = c.rms_norm_eps, qat_sim
        qat = qat_sim
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype=dtype)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)
        # wo_a: no activation rounding under QAT (the reference's bf16 einsum of the decoded weight).
        self.wo_a = Linear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                           dtype=dtype, rngs=rngs)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.attn_sink = nnx.Param(rngs.normal((c.num_attention_heads,), jnp.float32, 1.0))
        self.compressor = (Compressor(c, self.ratio, c.head_dim, indexer=False, dtype=dtype, rngs=rngs, qat_sim=qat)
                           if self.kind != "window" else None)
        self.indexer = Indexer(c, dtype=dtype, rngs=rngs, qat_sim=qat) if self.kind == "csa" else None
        self.rope = layer_rope(c, compressed=self.kind != "window")

    def query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q [B, S, N, H] rotated, qr [B, S, q_lora] — the indexer's query input)."""
        b, s, _ = x.shape
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim)
        q = rms_normalize(q, self.eps).astype(x.dtype)
        return apply_rope(q, positions, self.rope), qr

    def window_kv(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """The token's own K=V vector [B, S, H]: normed, rotated, nope part FP8-rounded under QAT."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), positions, self.rope)
        if self.qat_sim:
            kv = jnp.concatenate([quant_sim.fp8_sim(kv[..., :-self.rope_dim], 64), kv[..., -self.rope_dim:]], -1)
        return kv

    def output(self, o: jax.Array, positions: jax.Array) -> jax.Array:
        """De-rotate at the query position, grouped low-rank projection wo_a per group, then wo_b."""
        b, s = o.shape[:2]
        o = apply_rope(o, positions, self.rope, inverse=True)
        z = self.wo_a.grouped(o.reshape(b, s, self.groups, -1))
        return self.wo_b(z.reshape(b, s, -1))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Full sequence from position 0: x [B, S, D] (after attn_norm), positions [B, S]."""
        q, qr = self.query(x, positions)
        kv = self.window_kv(x, positions)
        mask = window_mask(positions, positions, self.window)
        entries = index_keys = None
        if self.compressor is not None:
            entries = self.compressor(x)  # [B, S // m, H]
        if self.indexer is not None:
            index_keys = self.indexer.compressor(x)
        return self._attend(x, q, qr, positions, kv, mask, entries, index_keys)

    def extend(self, x: jax.Array, positions: jax.Array, cache: LayerCache, length: jax.Array,
               n_valid: jax.Array) -> tuple[jax.Array, LayerCache]:
        """A chunk at positions [B, S] = length + arange(S), of which the first n_valid[b] are real.
        Window keys are the ring rows held before `length` plus the chunk's own rows; all caches
        are updated before attention (spec §5.3.7), so entries the chunk completes are visible to
        its later queries."""
        q, qr = self.query(x, positions)
        kv = self.window_kv(x, positions)
        ring_pos = state.ring_positions(length, cache.window.shape[1])
        key_pos = jnp.concatenate([ring_pos, positions], axis=1)
        mask = window_mask(positions, key_pos, self.window) & (key_pos >= 0)[:, None, :]
        keys = jnp.concatenate([cache.window, kv], axis=1)
        compressor = indexer = None
        if self.compressor is not None:
            compressor = self.compressor.extend(x, cache.compressor, length, n_valid)
        if self.indexer is not None:
            indexer = self.indexer.compressor.extend(x, cache.indexer, length, n_valid)
        out = self._attend(x, q, qr, positions, keys, mask,
                           None if compressor is None else compressor.entries,
                           None if indexer is None else indexer.entries)
        window = state.write_rows(cache.window, kv, length, n_valid)
        return out, LayerCache(window=window, compressor=compressor, indexer=indexer)

    def draft(self, x: jax.Array, positions: jax.Array, ring: jax.Array, length: jax.Array) -> jax.Array:
        """DSpark drafter attention (spec dspark.md §3.9 step 5): each of the S block rows sees the
        context rows of the last `window` positions before `length` (from the drafter's ring) and
        every block row, non-causally; sink, de-rotation and output as usual."""
        b, s, _ = x.shape
        q, _ = self.query(x, positions)
        kv = self.window_kv(x, positions)
        ring_pos = state.ring_positions(length, ring.shape[1])
        context = (ring_pos >= 0) & (ring_pos >= length[:, None] - self.window)
        mask = jnp.concatenate([jnp.broadcast_to(context[:, None, :], (b, s, ring.shape[1])),
                                jnp.ones((b, s, s), bool)], axis=-1)
        o = sink_attention(q, jnp.concatenate([ring, kv], axis=1), mask, self.attn_sink[...], self.head_dim ** -0.5)
        return self.output(o, positions)

    def _attend(self, x, q, qr, positions, keys, mask, entries, index_keys) -> jax.Array:
        """Sink attention over window keys (mask given) plus the visible compressed entries: all of
        them (HCA) or, gathered per query, only the indexer's top-k (CSA); then de-rotation and the
        output projection."""
        sink, scale = self.attn_sink[...], self.head_dim ** -0.5
        if entries is None:
            return self.output(sink_attention(q, keys, mask, sink, scale), positions)
        visible = jnp.arange(entries.shape[1]) < ((positions + 1) // self.ratio)[..., None]
        if index_keys is None:
            o = sink_attention(q, jnp.concatenate([keys, entries], axis=1),
                               jnp.concatenate([mask, visible], axis=-1), sink, scale)
        else:
            idx, valid = self.indexer.select(self.indexer.scores(x, qr, positions, index_keys), visible)
            selected = jnp.take_along_axis(entries[:, None], idx[..., None], axis=2, mode="promise_in_bounds")
            o = sink_attention_selected(q, keys, mask, selected, valid, sink, scale)  # selected [B, S, K, H]
        return self.output(o, positions)
