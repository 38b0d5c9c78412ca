"""The DeepSeek-V4 network (spec §5): embed -> C streams -> blocks (mHC around attention and MoE)
-> HC head -> norm -> fp32 head; plus the extra layers `mtp.*`: MTP blocks (spec §5.7), or the
DSpark drafter's stages when the config has a drafter (spec dspark.md §3.9).

Module attribute names follow the official checkpoint, so a tensor name maps to a parameter path
(see `jdspark.checkpoint.names`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model import quant_sim
from jdspark.model.block import Block, HyperHead, MTPBlock, shared_extend, tokenwise
from jdspark.model.draft import DraftStage
from jdspark.model.layers import Embedding, Keys, Linear, RMSNorm
from jdspark.model.state import DecodeState


class DSV4(nnx.Module):
    def __init__(self, config: DSV4Config, *, dtype=jnp.bfloat16, rngs: Keys, qat_sim: bool = False):
        """`qat_sim` (a build option, not part of the checkpoint config): simulate the reference's
        FP8 / FP4 QAT rounding (spec §5.8); the config's head dims must suit its blocks."""
        c = config
        if qat_sim:
            quant_sim.check_dims(c)
        self.config, self.qat_sim = c, bool(qat_sim)
        self.dtype = jnp.dtype(dtype)
        self.embed = Embedding(c.vocab_size, c.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(c, i, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
                                for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.head = Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs, compute_dtype=jnp.float32)
        self.hc_head = HyperHead(c, rngs=rngs)
        if c.dspark is None:
            self.mtp = nnx.List([MTPBlock(c, c.num_hidden_layers + i, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
                                 for i in range(c.num_nextn_predict_layers)])
        else:
            self.mtp = nnx.List([DraftStage(c, i, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
                                 for i in range(c.dspark.num_stages)])

    def streams(self, ids: jax.Array, feature_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array | None]:
        """Final residual streams [B, S, C, D] (before the HC head) for tokens [B, S] from position 0,
        and the drafter features of `feature_layers` (see `extend`)."""
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = self.embed_streams(ids)
        features = []
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, ids)
            if i in feature_layers:
                features.append(_stream_mean(x))
        return x, _concat(features)

    def extend(self, ids: jax.Array, decode: DecodeState, n_valid: jax.Array, feature_layers: tuple[int, ...] = (),
               last_logits: bool = False) -> tuple[jax.Array, jax.Array | None, DecodeState]:
        """Run tokens ids [B, S] after the tokens each slot holds; the first n_valid[b] are real.

        Returns (logits [B, S, V] fp32, features, new state). features [B, S, len(feature_layers)*D]
        (None without feature layers) are the outputs of those layers averaged over the HC streams
        and concatenated: the DSpark drafter's context input (spec dspark.md §3.9). `last_logits`: logits
        [B, 1, V] of each row's last real token (n_valid - 1, row 0 where none) alone: a prompt chunk's
        (`extend_segments`).
        """
        (result,) = self.extend_segments(((ids, decode, n_valid),), feature_layers, (last_logits,))
        return result

    def extend_segments(self, segments: tuple[tuple[jax.Array, DecodeState, jax.Array], ...],
                        feature_layers: tuple[int, ...] = (), last_logits: tuple[bool, ...] = ()
                        ) -> list[tuple[jax.Array, jax.Array | None, DecodeState]]:
        """`extend` of several segments in one pass, each (ids [B_i, S_i], the state of its own slots,
        n_valid [B_i]), e.g. a verify block of k + 1 rows a slot beside a prompt chunk of many: attention
        runs per segment over its state, the FFN and the head once over every segment's tokens
        (`block.tokenwise`), so the segments read each routed expert once (a Flash-dims prompt chunk
        selects most of a layer's experts, which a 16-row verify block reads anyway). One (logits,
        features, new state) per segment, as `extend` returns them; a segment whose `last_logits` is True
        gets the logits of each row's last real token alone, [B_i, 1, V] (a prompt chunk needs no others:
        the head's work and the fp32 logits of a 16 x 256 prefill at Flash's vocabulary, 2.1 GB, skipped)."""
        ids = tuple(i for i, _, _ in segments)
        lengths = tuple(decode.length for _, decode, _ in segments)
        n_valids = tuple(n for _, _, n in segments)
        positions = tuple(length[:, None] + jnp.arange(i.shape[1]) for i, length in zip(ids, lengths))
        xs = [self.embed_streams(i) for i in ids]
        caches, features, extend_block = [], [], shared_extend()
        for layer_index, layer in enumerate(self.layers):
            layer_caches = tuple(decode.layers[layer_index] for _, decode, _ in segments)
            xs, layer_caches = extend_block(layer, tuple(xs), positions, ids, layer_caches, lengths, n_valids)
            caches.append(layer_caches)
            if layer_index in feature_layers:
                features.append([_stream_mean(x) for x in xs])
        last = tuple(last_logits) + (False,) * (len(segments) - len(last_logits))
        xs = [last_rows(x, n) if only_last else x for x, n, only_last in zip(xs, n_valids, last)]
        logits = tokenwise(lambda x: self.logits_from_streams(x, self.hc_head, self.norm), xs)
        return [(logits[s], _concat([f[s] for f in features]),
                 decode.replace(layers=tuple(c[s] for c in caches), length=lengths[s] + n_valids[s],
                                written=n_valids[s]))
                for s, (_, decode, _) in enumerate(segments)]

    def embed_streams(self, ids: jax.Array) -> jax.Array:
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


def last_rows(x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Each row's entry at its last real token: [B, S, ...] -> [B, 1, ...] (position 0 where n_valid is 0)."""
    index = jnp.maximum(n_valid - 1, 0).reshape(-1, *(1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)


def _stream_mean(x: jax.Array) -> jax.Array:
    """A layer's output averaged over the HC streams (fp32 mean): [B, S, C, D] -> [B, S, D]."""
    return jnp.mean(x.astype(jnp.float32), axis=2).astype(x.dtype)


def _concat(features: list[jax.Array]) -> jax.Array | None:
    return jnp.concatenate(features, axis=-1) if features else None
