"""CSA / HCA KV compressors (spec §5.3.3): gated pooling of m consecutive tokens into one entry.

Each token t contributes a row (a_t, z_t + ape[t mod m]) of width coff*c (coff = 2 for the
overlapping ratio-4 CSA compressor, else 1). HCA entry w pools window w's m rows; CSA entry w pools
8 slots: the first-half channels of window w-1 and the second-half channels of window w. The pooled
entry is cast to the model dtype, RMS-normed and rotated at position w*m.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import CSA_RATIO, DSV4Config
from jdspark.model import quant_sim, state
from jdspark.model.layers import Keys, Linear, RMSNorm
from jdspark.model.rope import apply_rope, layer_rope
from jdspark.model.state import CompressorCache


class Compressor(nnx.Module):
    def __init__(self, config: DSV4Config, ratio: int, head_dim: int, *, indexer: bool, dtype, rngs: Keys,
                 qat_sim: bool = False):
        self.ratio, self.head_dim, self.indexer = ratio, head_dim, indexer
        self.overlap = ratio == CSA_RATIO
        width = (2 if self.overlap else 1) * head_dim
        d = config.hidden_size
        self.ape = nnx.Param(rngs.normal((ratio, width), jnp.float32, 1.0))
        self.wkv = Linear(d, width, dtype=dtype, rngs=rngs, compute_dtype=jnp.float32)
        self.wgate = Linear(d, width, dtype=dtype, rngs=rngs, compute_dtype=jnp.float32)
        self.norm = RMSNorm(head_dim, config.rms_norm_eps, dtype=dtype)
        self.rope = layer_rope(config, compressed=True)
        self.rope_dim = config.qk_rope_head_dim
        self.qat_sim = qat_sim

    def rows(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-token (a, z) in fp32, [..., S, coff*c]; `ape` is added later by in-window offset."""
        x = x.astype(jnp.float32)
        return self.wkv(x), self.wgate(x)

    def pool(self, a: jax.Array, z: jax.Array, prev_a: jax.Array | None, prev_z: jax.Array | None) -> jax.Array:
        """Pool complete windows. a, z: [B, n, m, coff*c] with ape added; prev_*: the window before
        the first one ([B, m, coff*c]; zeros and -inf at sequence start; CSA only, else None).
        Returns fp32 [B, n, c]."""
        if self.overlap:
            c = self.head_dim
            prev_a = jnp.concatenate([prev_a[:, None], a[:, :-1]], axis=1)[..., :c]
            prev_z = jnp.concatenate([prev_z[:, None], z[:, :-1]], axis=1)[..., :c]
            a = jnp.concatenate([prev_a, a[..., c:]], axis=2)  # [B, n, 2m, c]
            z = jnp.concatenate([prev_z, z[..., c:]], axis=2)
        return jnp.sum(a * jax.nn.softmax(z, axis=2), axis=2)

    def finish(self, pooled: jax.Array, first_entry: jax.Array | int, dtype) -> jax.Array:
        """Cast, norm, rotate at position w*m (and the QAT rounding). pooled: [B, n, c] fp32;
        first_entry: the index of entry 0, scalar or per slot [B]."""
        kv = self.norm(pooled.astype(dtype))
        positions = (jnp.asarray(first_entry)[..., None] + jnp.arange(kv.shape[1])) * self.ratio
        kv = apply_rope(kv, jnp.broadcast_to(positions, kv.shape[:2]), self.rope)
        if self.qat_sim:
            if self.indexer:
                kv = quant_sim.fp4_sim(quant_sim.hadamard(kv), 32)
            else:
                kv = jnp.concatenate([quant_sim.fp8_sim(kv[..., :-self.rope_dim], 64), kv[..., -self.rope_dim:]], -1)
        return kv

    def __call__(self, x: jax.Array) -> jax.Array:
        """Entries of a full sequence from position 0: x [B, S, D] -> [B, S // m, c] in x.dtype."""
        b, s, _ = x.shape
        m, n = self.ratio, s // self.ratio
        if n == 0:
            return jnp.zeros((b, 0, self.head_dim), x.dtype)
        a, z = self.rows(x[:, :n * m])
        a = a.reshape(b, n, m, -1)
        z = z.reshape(b, n, m, -1) + self.ape[...]
        if not self.overlap:
            return self.finish(self.pool(a, z, None, None), 0, x.dtype)
        start_a = jnp.zeros((b, m, a.shape[-1]), jnp.float32)
        start_z = jnp.full((b, m, z.shape[-1]), -jnp.inf, jnp.float32)
        return self.finish(self.pool(a, z, start_a, start_z), 0, x.dtype)

    def extend(self, x: jax.Array, cache: CompressorCache, length: jax.Array,
               n_valid: jax.Array) -> CompressorCache:
        """Add tokens x [B, S, D] at positions length..length+S-1 (the first n_valid[b] of them count).

        The pooling frame starts at the window before the open one (CSA; the open one for HCA) and
        takes rows before `length` from the ring and the rest from this chunk; every window the
        chunk completes becomes an entry (entries the chunk does not complete are not written).
        """
        b, s, _ = x.shape
        m, coff = self.ratio, 2 if self.overlap else 1
        positions = length[:, None] + jnp.arange(s)
        a, z = self.rows(x)
        z = z + self.ape[...][jnp.mod(positions, m)]

        n_windows = coff + (s + m - 2) // m  # covers the open window's held rows plus the chunk
        frame = ((length // m - (coff - 1)) * m)[:, None] + jnp.arange(n_windows * m)  # [B, F]
        in_ring = ((frame >= 0) & (frame < length[:, None]))[..., None]
        in_chunk = ((frame >= length[:, None]) & (frame < (length + n_valid)[:, None]))[..., None]
        at = jnp.clip(frame - length[:, None], 0, s - 1)[..., None]
        frame_a = jnp.where(in_ring, state.gather_rows(cache.rows_a, frame),
                            jnp.where(in_chunk, jnp.take_along_axis(a, at, axis=1), 0.0))
        frame_z = jnp.where(in_ring, state.gather_rows(cache.rows_z, frame),
                            jnp.where(in_chunk, jnp.take_along_axis(z, at, axis=1), -jnp.inf))
        frame_a = frame_a.reshape(b, n_windows, m, -1)
        frame_z = frame_z.reshape(b, n_windows, m, -1)
        if self.overlap:
            pooled = self.pool(frame_a[:, 1:], frame_z[:, 1:], frame_a[:, 0], frame_z[:, 0])
        else:
            pooled = self.pool(frame_a, frame_z, None, None)

        first = length // m  # the open window: the first entry this call can complete
        entries = self.finish(pooled, first, cache.entries.dtype)
        index = first[:, None] + jnp.arange(entries.shape[1])
        complete = (index + 1) * m <= (length + n_valid)[:, None]
        index = jnp.where(complete, index, cache.entries.shape[1])  # out of range: dropped
        return CompressorCache(
            rows_a=state.write_rows(cache.rows_a, a, length, n_valid),
            rows_z=state.write_rows(cache.rows_z, z, length, n_valid),
            entries=cache.entries.at[jnp.arange(b)[:, None], index].set(entries, mode="drop"))
