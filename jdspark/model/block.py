"""The DeepSeek-V4 block (spec §5.2): mHC around attention, then mHC around the MoE; the HC head
parameters; the MTP block (spec §5.7). Three ways to run a block: the full sequence from position 0
(`__call__`), chunks after a decode state (`extend`: one or more segments of rows, each over its own
slots), and a drafter block over a context ring (`draft`)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model.attention import Attention
from jdspark.model.hyper import HyperConnection, hc_head
from jdspark.model.layers import Keys, Linear, RMSNorm
from jdspark.model.moe import MoE
from jdspark.model.state import LayerCache


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
    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys, qat_sim: bool = False):
        c = config
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps, norm_eps=c.rms_norm_eps, rngs=rngs)
        self.hc_attn = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.hc_ffn = HyperConnection(c.hc_mult, c.hidden_size, **hc)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.attn = Attention(c, layer_id, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
        self.ffn = MoE(c, layer_id, dtype=dtype, rngs=rngs, qat_sim=qat_sim)

    def __call__(self, x: jax.Array, positions: jax.Array, ids: jax.Array) -> jax.Array:
        """x [B, S, C, D] streams -> streams (full sequence from position 0)."""
        u, post, comb = self.hc_attn.pre(x)
        x = HyperConnection.post(self.attn(self.attn_norm(u), positions), x, post, comb)
        return self._ffn(x, ids)

    def extend(self, xs: tuple[jax.Array, ...], positions: tuple[jax.Array, ...], ids: tuple[jax.Array, ...],
               caches: tuple[LayerCache, ...], lengths: tuple[jax.Array, ...],
               n_valids: tuple[jax.Array, ...]) -> tuple[list[jax.Array], tuple[LayerCache, ...]]:
        """Segments, each x [B_i, S_i, C, D] streams of a chunk after lengths[i] held tokens of its own
        slots -> (streams, updated cache) per segment. Attention runs per segment over its cache; the
        FFN (mHC, routed and shared experts) once over every segment's tokens (`tokenwise`)."""
        attended, new_caches = [], []
        for x, pos, cache, length, n_valid in zip(xs, positions, caches, lengths, n_valids):
            u, post, comb = self.hc_attn.pre(x)
            out, cache = self.attn.extend(self.attn_norm(u), pos, cache, length, n_valid)
            attended.append(HyperConnection.post(out, x, post, comb))
            new_caches.append(cache)
        kept = [jnp.arange(i.shape[1]) < n_valid[:, None] for i, n_valid in zip(ids, n_valids)]
        return tokenwise(self._ffn, attended, ids, kept), tuple(new_caches)

    def draft(self, x: jax.Array, positions: jax.Array, ids: jax.Array, ring: jax.Array,
              length: jax.Array) -> jax.Array:
        """A drafter block: the rows attend to each other (non-causally) and to the context ring."""
        u, post, comb = self.hc_attn.pre(x)
        out = self.attn.draft(self.attn_norm(u), positions, ring, length)
        return self._ffn(HyperConnection.post(out, x, post, comb), ids)

    def _ffn(self, x: jax.Array, ids: jax.Array, kept: jax.Array | None = None) -> jax.Array:
        u, post, comb = self.hc_ffn.pre(x)
        return HyperConnection.post(self.ffn(self.ffn_norm(u), ids, kept), x, post, comb)


def tokenwise(fn, *segments: list[jax.Array]) -> list[jax.Array]:
    """fn over every segment's tokens at once: each argument a list of per-segment arrays [B_i, S_i, ...],
    joined into [1, sum B_i S_i, ...] for one call (one read of fn's weights for all segments), the
    result split back per segment. A single segment runs as it is."""
    if len(segments[0]) == 1:
        return [fn(*(parts[0] for parts in segments))]
    joined = fn(*(jnp.concatenate([p.reshape(1, -1, *p.shape[2:]) for p in parts], axis=1) for parts in segments))
    ends = list(itertools.accumulate(p.shape[0] * p.shape[1] for p in segments[0]))
    return [joined[0, end - p.shape[0] * p.shape[1]:end].reshape(*p.shape[:2], *joined.shape[2:])
            for p, end in zip(segments[0], ends)]


def shared_extend():
    """A function like `Block.extend(block, ...)` that runs every block of the same structure through
    one jitted function (the graph of a block holds its kind, not its index), so a program traces and
    lowers each kind of layer once, not each layer: a 43-layer Flash has a handful of kinds. XLA
    inlines the calls, so the compiled program is the one the layers would make one by one. Make one
    per program: its trace cache lives as long as it, so code patched between programs is seen."""
    @functools.partial(jax.jit, static_argnums=0)
    def extend_one_kind(kind: _Kind, state, *args):
        return nnx.merge(kind.graphdef, state).extend(*args)

    def extend(block: Block, *args) -> tuple[list[jax.Array], tuple[LayerCache, ...]]:
        graphdef, state = nnx.split(block)
        return extend_one_kind(_Kind(graphdef), state, *args)
    return extend


class _Kind:
    """A block's graph as the shared function's static key. Graphs compare their static attributes
    by value, and 2 == 2.0 == True in Python, so two blocks whose settings differ only in type would
    share one trace: equal kinds also need equal reprs, which name the types' values apart."""

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef

    def __hash__(self) -> int:
        return hash(self.graphdef)

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Kind) and self.graphdef == other.graphdef
                and repr(self.graphdef) == repr(other.graphdef))


class MTPBlock(Block):
    """Multi-token prediction: (streams at t, token t+1) -> logits for token t+2 (window-only layer)."""

    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys, qat_sim: bool = False):
        super().__init__(config, layer_id, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
        d, qat = config.hidden_size, qat_sim
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
