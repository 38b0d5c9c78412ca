"""The DeepSeek-V4 network (spec §5): embed -> C streams -> blocks (mHC around attention and MoE)
-> HC head -> norm -> fp32 head; plus the MTP block(s) (spec §5.7).

Module attribute names follow the official checkpoint, so a tensor name maps to a parameter path
(see `jdspark.checkpoint.names`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model.attention import Attention
from jdspark.model.hyper import HyperConnection, hc_head
from jdspark.model.layers import Embedding, Keys, Linear, RMSNorm
from jdspark.model.moe import MoE
from jdspark.model.state import DecodeState, LayerCache


class HyperHead(nnx.Module):
    """Parameters of the final stream collapse: fn [C, C*D], base [C], scale [1] (fp32)."""

    def __init__(self, config: DSV4Config, *, rngs: Keys):
        c, d = config.hc_mult, config.hidden_size
        self.fn = nnx.Param(rngs.normal((c, c * d), jnp.float32, (c * d) ** -0.5))
        self.base = nnx.Param(jnp.zeros((c,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return hc_head(x, self.fn[...], self.base[...], self.scale[...], self.hc_eps, self.norm_eps)


class Block(nnx.Module):
    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys):
        c = config
        self.layer_id = layer_id
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, rngs=rngs)
        self.hc_attn = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.hc_ffn = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.attn = Attention(c, layer_id, dtype=dtype, rngs=rngs)
        self.ffn = MoE(c, layer_id, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, ids: jax.Array) -> jax.Array:
        """x [B, S, C, D] streams -> streams (full sequence from position 0)."""
        u, post, comb = self.hc_attn.pre(x)
        x = HyperConnection.post(self.attn(self.attn_norm(u), positions), x, post, comb)
        return self._ffn(x, ids)

    def extend(self, x: jax.Array, positions: jax.Array, ids: jax.Array, cache: LayerCache,
               length: jax.Array, n_valid: jax.Array) -> tuple[jax.Array, LayerCache]:
        """x [B, S, C, D] streams of a chunk after `length` held tokens -> (streams, updated cache)."""
        u, post, comb = self.hc_attn.pre(x)
        out, cache = self.attn.extend(self.attn_norm(u), positions, cache, length, n_valid)
        return self._ffn(HyperConnection.post(out, x, post, comb), ids), cache

    def _ffn(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        u, post, comb = self.hc_ffn.pre(x)
        return HyperConnection.post(self.ffn(self.ffn_norm(u), ids), x, post, comb)


class MTPBlock(Block):
    """Multi-token prediction: (streams at t, token t+1) -> logits for token t+2 (window-only layer)."""

    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys):
        super().__init__(config, layer_id, dtype=dtype, rngs=rngs)
        d, qat = config.hidden_size, config.qat_sim
        self.e_proj = Linear(d, d, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.h_proj = Linear(d, d, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.enorm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.hc_head = HyperHead(config, rngs=rngs)

    def streams(self, x: jax.Array, next_embed: jax.Array, positions: jax.Array, next_ids: jax.Array) -> jax.Array:
        """x [B, S, C, D] target streams, next_embed [B, S, D] -> this block's output streams."""
        x0 = self.e_proj(self.enorm(next_embed))[..., None, :] + self.h_proj(self.hnorm(x))
        return super().__call__(x0, positions, next_ids)


class DSV4(nnx.Module):
    def __init__(self, config: DSV4Config, *, dtype=jnp.bfloat16, rngs: Keys):
        c = config
        self.config = c
        self.dtype = jnp.dtype(dtype)
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(c, i, dtype=dtype, rngs=rngs) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.head = Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs, compute_dtype=jnp.float32)
        self.hc_head = HyperHead(c, rngs=rngs)
        self.mtp = nnx.List([MTPBlock(c, c.num_hidden_layers + i, dtype=dtype, rngs=rngs)
                             for i in range(c.num_nextn_predict_layers)])

    def streams(self, ids: jax.Array, feature_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array | None]:
        """Final residual streams [B, S, C, D] (before the HC head) for tokens [B, S] from position 0,
        and the drafter features of `feature_layers` (see `extend`)."""
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = self._embed_streams(ids)
        features = []
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, ids)
            if i in feature_layers:
                features.append(_stream_mean(x))
        return x, _concat(features)

    def extend(self, ids: jax.Array, decode: DecodeState, n_valid: jax.Array,
               feature_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array | None, DecodeState]:
        """Run tokens ids [B, S] after the tokens each slot holds; the first n_valid[b] are real.

        Returns (logits [B, S, V] fp32, features, new state). features [B, S, len(feature_layers)*D]
        (None without feature layers) are the outputs of those layers averaged over the HC streams
        and concatenated: the DSpark drafter's context input (spec dspark.md §3.9).
        """
        length = decode.length
        positions = length[:, None] + jnp.arange(ids.shape[1])
        x = self._embed_streams(ids)
        caches, features = [], []
        for i, layer in enumerate(self.layers):
            x, cache = layer.extend(x, positions, ids, decode.layers[i], length, n_valid)
            caches.append(cache)
            if i in feature_layers:
                features.append(_stream_mean(x))
        logits = self.logits_from_streams(x, self.hc_head, self.norm)
        new = DecodeState(layers=tuple(caches), length=length + n_valid, written=n_valid)
        return logits, _concat(features), new

    def _embed_streams(self, ids: jax.Array) -> jax.Array:
        """Token embeddings copied into the C residual streams: [B, S, C, D]."""
        h = self.embed(ids).astype(self.dtype)
        return jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], self.config.hc_mult, h.shape[-1]))

    def logits_from_streams(self, x: jax.Array, head_block: HyperHead, norm: RMSNorm) -> jax.Array:
        """HC head -> norm -> fp32 logits [B, S, V]."""
        return self.head(norm(head_block(x)).astype(jnp.float32))

    def __call__(self, ids: jax.Array, feature_layers: tuple[int, ...] = ()):
        """(logits [B, S, V] fp32, final streams [B, S, C, D], features of `feature_layers` or None)."""
        x, features = self.streams(ids, feature_layers)
        return self.logits_from_streams(x, self.hc_head, self.norm), x, features

    def mtp_logits(self, x: jax.Array, next_ids: jax.Array, depth: int = 0) -> jax.Array:
        """MTP block `depth` on target streams x [B, S, C, D] and the next tokens [B, S]: logits for
        the token after next at every row (row t: streams at t and token t+1 -> token t+2)."""
        block = self.mtp[depth]
        positions = jnp.broadcast_to(jnp.arange(next_ids.shape[1]), next_ids.shape)
        y = block.streams(x, self.embed(next_ids).astype(self.dtype), positions, next_ids)
        return self.logits_from_streams(y, block.hc_head, block.norm)


def _stream_mean(x: jax.Array) -> jax.Array:
    """A layer's output averaged over the HC streams (fp32 mean): [B, S, C, D] -> [B, S, D]."""
    return jnp.mean(x.astype(jnp.float32), axis=2).astype(x.dtype)


def _concat(features: list[jax.Array]) -> jax.Array | None:
    return jnp.concatenate(features, axis=-1) if features else None
