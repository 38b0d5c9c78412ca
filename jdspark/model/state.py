"""Decode state for a batch of sequence slots: "write ahead, commit by length" (spec dsv4.md §6.4).

Every buffer is indexed by absolute position, so rollback never copies or restores anything:
- window K=V rows and compressor rows live in rings indexed by position mod R, sized so that the
  rows a rolled-back call wrote can only land on slots no later query needs (a ring of exactly
  `sliding_window` is not safe: draft token p+j would overwrite p+j-128, which p+1 still reads);
- compressed entries (CSA, HCA, indexer keys) are append-only arrays indexed by entry number;
- `length[b]` is the number of tokens slot b holds. `extend` writes S rows at positions
  length..length+S-1 and advances `length`; `commit(n_keep)` moves it back to keep only the first
  n_keep of them. Rows and entries beyond `length` are invisible (masked by position) and are
  overwritten when those positions are written again.

A slot is recycled by setting its length to 0: masks by position hide everything it held.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jdspark.config import CSA_RATIO, DSV4Config, EngineConfig


@struct.dataclass
class CompressorCache:
    """Rows (a, z + ape) of the tokens the next entries still need, and the entries so far."""

    rows_a: jax.Array  # [B, R, coff*c] fp32, ring by position
    rows_z: jax.Array  # [B, R, coff*c] fp32, ring by position (ape already added)
    entries: jax.Array  # [B, max_seq_len // m, c], entry w pools positions [w*m, (w+1)*m)


@struct.dataclass
class LayerCache:
    window: jax.Array  # [B, R_w, head_dim] K=V rows, ring by position
    compressor: CompressorCache | None = None  # CSA and HCA layers
    indexer: CompressorCache | None = None  # CSA layers


@struct.dataclass
class DecodeState:
    layers: tuple[LayerCache, ...]
    length: jax.Array  # [B] int32: tokens held (committed + written by the last extend)
    written: jax.Array  # [B] int32: tokens the last extend wrote (what commit may roll back)
    # [B] int32: the token after the held ones, not yet written: the next block's first input. The engine's
    # calls set it from the token they sample, so a call can be issued before the host read the one before
    anchor: jax.Array

    @property
    def batch(self) -> int:
        return self.length.shape[0]


@dataclasses.dataclass(frozen=True)
class RingSizes:
    """Ring lengths for a model and engine config (each the minimum that is rollback-safe).

    At frontier P the state still needs window rows P-(W-1)..P-1 and compressor rows from the start
    of the previous window (CSA, up to 2m-1 rows back) or the current one (HCA, up to m-1 back). A
    call that writes rows and then rolls back up to `rollback_rows` of them overwrites the slots of
    positions at most R - rollback_rows behind its last kept row; R = needed + rollback_rows keeps those
    slots clear of everything still needed.
    """

    window: int
    compressor: dict[int, int]  # ratio -> ring length

    @classmethod
    def of(cls, config: DSV4Config, rollback_rows: int) -> "RingSizes":
        ratios = {r for r in config.compress_ratios[:config.num_hidden_layers] if r}
        return cls(window=config.sliding_window - 1 + rollback_rows,
                   compressor={m: (2 * m if m == CSA_RATIO else m) - 1 + rollback_rows for m in ratios})


def init_state(config: DSV4Config, engine: EngineConfig, dtype) -> DecodeState:
    """An empty state (all slots at length 0) with the shapes `engine` fixes. Buffers are zero /
    -inf initialised: nothing relies on uninitialised memory."""
    rings = RingSizes.of(config, engine.rollback_rows)
    b, t = engine.max_batch, engine.max_seq_len

    def compressor(ratio: int, head_dim: int) -> CompressorCache:
        width = (2 if ratio == CSA_RATIO else 1) * head_dim
        ring = rings.compressor[ratio]
        return CompressorCache(rows_a=jnp.zeros((b, ring, width), jnp.float32),
                               rows_z=jnp.full((b, ring, width), -jnp.inf, jnp.float32),
                               entries=jnp.zeros((b, t // ratio, head_dim), dtype))

    layers = []
    for layer in range(config.num_hidden_layers):
        kind, ratio = config.layer_kind(layer), config.layer_ratio(layer)
        layers.append(LayerCache(
            window=jnp.zeros((b, rings.window, config.head_dim), dtype),
            compressor=compressor(ratio, config.head_dim) if kind != "window" else None,
            indexer=compressor(CSA_RATIO, config.index_head_dim) if kind == "csa" else None))
    def zeros():  # a buffer each: all are donated
        return jnp.zeros((b,), jnp.int32)
    return DecodeState(layers=tuple(layers), length=zeros(), written=zeros(), anchor=zeros())


def commit(state: DecodeState, n_keep: jax.Array) -> DecodeState:
    """Keep the first n_keep[b] of the tokens the last extend wrote to slot b; roll back the rest."""
    n_keep = jnp.clip(jnp.asarray(n_keep, jnp.int32), 0, state.written)
    return state.replace(length=state.length - state.written + n_keep, written=jnp.zeros_like(state.written))


def reset_slots(state: DecodeState, slots: jax.Array) -> DecodeState:
    """Empty the slots where `slots` [B] is true (a finished request frees its slot)."""
    keep = jnp.logical_not(slots)
    return state.replace(length=jnp.where(keep, state.length, 0), written=jnp.where(keep, state.written, 0))


# ---- ring helpers (used by the attention and compressor extend paths) --------------------------

def ring_positions(length: jax.Array, ring: int) -> jax.Array:
    """[B, R]: the position ring slot r last held for a slot of `length` tokens, i.e. the largest
    position < length congruent to r mod R (negative: never written)."""
    last = length[:, None] - 1
    return last - jnp.mod(last - jnp.arange(ring), ring)


def write_rows(ring: jax.Array, rows: jax.Array, length: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Write rows[b, i] (position length[b] + i) into ring slot (position mod R) for i < n_valid[b].

    Of a chunk longer than the ring only the last R rows are written (the earlier ones would be
    overwritten anyway), so no two writes hit one slot and the scatter is deterministic."""
    b, s = rows.shape[:2]
    size = ring.shape[1]
    i = jnp.arange(s)
    keep = (i < n_valid[:, None]) & (i >= n_valid[:, None] - size)
    slot = jnp.where(keep, jnp.mod(length[:, None] + i, size), size)  # size: out of range, dropped
    return ring.at[jnp.arange(b)[:, None], slot].set(rows.astype(ring.dtype), mode="drop")


def gather_rows(ring: jax.Array, positions: jax.Array) -> jax.Array:
    """ring[b, positions[b, f] mod R] -> [B, F, ...] (callers mask positions the ring does not hold)."""
    slot = jnp.mod(positions, ring.shape[1])
    return jnp.take_along_axis(ring, slot.reshape(*slot.shape, *([1] * (ring.ndim - 2))), axis=1)
