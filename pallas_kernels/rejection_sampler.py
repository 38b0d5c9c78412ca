"""Rejection sampler: the vocabulary-wide exponential race of exact verification, as a Pallas kernel.

Once the accepted prefix is known (n_accepted, computed in XLA by the caller's verifier), one token
is drawn per request from normalise(max(p_row - q_row, 0)): the residual at the first rejected row,
or, when all K drafts were accepted, the bonus row with q_row = 0. When that residual is all zero
the draw falls back to p_row (spec dspark.md §5.3). With E ~ Exp(1) per token the draw is the race
argmax_v r_v / E_v; both implementations compute it as argmax_v race_score(r_v, 1 / E_v), with
1 / E computed once by the caller in XLA.

`race` (Pallas: Triton on the GPU, interpret mode on CPU, one source) and `ref_race` (plain jnp)
return the same tokens bit for bit on any backend: the kernel applies only exactly rounded
operations to its inputs (subtract, max, multiply, compare) and reduces with max and then the
smallest index among the maxima, which is order-free and is jnp.argmax's lowest-index tie rule.

Kernel layout: grid (B, S). Program (b, s) races its share of request b's vocabulary in power-of-two
tiles (Triton needs power-of-two blocks); the last tile is shifted back to end at V, so no load is
out of bounds and no lane is masked (an element seen twice cannot change a max / lowest-index
result). It reads p_row, 1 / E and, unless the row is the bonus row, the draft row q[b, n_acc] once
each: 12 bytes per vocabulary entry. It runs the residual race and the p_row race (the fallback)
side by side; with no drafts (K = 0) the residual is p_row, so it runs one. The vocabulary is
split over S programs per request (by default one tile each) so that a batch of 1 still spreads
over the GPU: one program per request would leave all but B of the H200's 132 SMs idle. A [B, S]
combine in XLA picks each winner.

The full verification (warp, accept, then this race) is `jdspark.speculative.verify`; this module
imports nothing from `jdspark`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import interpret_mode

TILE = 2048  # vocabulary entries per tile by default: 8 KB of each input row
MIN_TILE = 512
PROGRAMS = 512  # small batches shrink the tile (down to MIN_TILE) to get about this many programs
_NO_INDEX = jnp.iinfo(jnp.int32).max


def race_score(weights: jax.Array, inv_exponentials: jax.Array) -> jax.Array:
    """Race key weights * (1 / E) where weights > 0, else -1 (never wins against a positive weight)."""
    return jnp.where(weights > 0, weights * inv_exponentials, -1.0)


def ref_race(p_row, draft_probs, n_accepted, inv_exponentials) -> jax.Array:
    """The race in plain jnp: p_row [B, V], draft_probs [B, K, V], n_accepted [B], 1/E [B, V] -> [B]."""
    k = draft_probs.shape[1]
    residual = p_row
    if k:
        row = jnp.minimum(n_accepted, k - 1)[:, None, None]
        q_row = jnp.take_along_axis(draft_probs, row, axis=1)[:, 0]
        q_row = jnp.where((n_accepted < k)[:, None], q_row, 0.0)
        residual = jnp.maximum(p_row - q_row, 0.0)
    residual_score = race_score(residual, inv_exponentials)
    has_residual = jnp.max(residual_score, axis=-1) >= 0
    return jnp.where(
        has_residual,
        jnp.argmax(residual_score, axis=-1),
        jnp.argmax(race_score(p_row, inv_exponentials), axis=-1),
    ).astype(jnp.int32)


def race(
    p_row,
    draft_probs,
    n_accepted,
    inv_exponentials,
    *,
    tile: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> jax.Array:
    """`ref_race` as a Pallas kernel. tile / splits / num_warps / num_stages tune it (None: defaults,
    see `layout`); interpret=None runs interpret mode exactly on the CPU (`interpret_mode`)."""
    batch, vocab = p_row.shape
    k = draft_probs.shape[1]
    tile, tiles_per_program, splits = layout(batch, vocab, tile, splits)
    interpret = interpret_mode(interpret)
    kernel = functools.partial(
        _race_kernel, k=k, vocab=vocab, tile=tile, tiles_per_program=tiles_per_program
    )
    partial = jax.ShapeDtypeStruct((batch, splits), jnp.float32)
    index = jax.ShapeDtypeStruct((batch, splits), jnp.int32)
    inputs = (n_accepted.astype(jnp.int32), p_row, inv_exponentials) + ((draft_probs,) if k else ())
    races = 2 if k else 1  # without drafts the residual is p_row itself: one race
    outputs = pl.pallas_call(
        kernel,
        out_shape=(partial, index) * races,
        grid=(batch, splits),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="rejection_race",
    )(*inputs)
    res_best, res_index = _combine(*outputs[:2])
    if not k:
        return res_index
    _, p_index = _combine(*outputs[2:])
    return jnp.where(res_best >= 0, res_index, p_index)


def layout(batch: int, vocab: int, tile: int | None, splits: int | None) -> tuple[int, int, int]:
    """(tile, tiles per program, programs per request). By default every program races one tile,
    and the tile (a power of two <= vocab) halves from TILE towards MIN_TILE while there are fewer
    than PROGRAMS programs, so that a small batch still spreads over the GPU's SMs; splits=1 gives
    one program per request. Splits are trimmed so that no program is empty."""
    if tile is None:
        tile = TILE
        while tile > MIN_TILE and batch * -(-vocab // tile) < PROGRAMS:
            tile //= 2
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile={tile} is not a power of two; Triton blocks must be (e.g. {TILE})")
    tile = min(tile, 1 << (vocab.bit_length() - 1))
    n_tiles = -(-vocab // tile)
    tiles_per_program = -(-n_tiles // min(splits or n_tiles, n_tiles))
    return tile, tiles_per_program, -(-n_tiles // tiles_per_program)


def _race_kernel(n_acc_ref, p_ref, inv_ref, *refs, k, vocab, tile, tiles_per_program):
    q_ref = refs[0] if k else None
    out_refs = refs[1:] if k else refs  # (best, index) of the residual race, then of the p race
    b, s = pl.program_id(0), pl.program_id(1)
    n_acc = n_acc_ref[b]
    lanes = jax.lax.iota(jnp.int32, tile)
    first = s * tiles_per_program
    last = jnp.minimum(first + tiles_per_program, -(-vocab // tile))

    def step(t, carry):
        # Every tile start is a multiple of gcd(tile, vocab): the hint lets Triton vectorise loads.
        start = pl.multiple_of(jnp.minimum(t * tile, vocab - tile), math.gcd(tile, vocab))
        p = p_ref[b, pl.ds(start, tile)]
        inv_e = inv_ref[b, pl.ds(start, tile)]
        scores = [race_score(p, inv_e)]
        if k:
            q_view = q_ref.at[b, jnp.minimum(n_acc, k - 1), pl.ds(start, tile)]
            q = pltriton.load(q_view, mask=n_acc < k, other=0.0)  # the bonus row reads no q
            scores.insert(0, race_score(jnp.maximum(p - q, 0.0), inv_e))
        index = start + lanes
        updated = []
        for score, (best, best_index) in zip(scores, carry):
            up = score > best  # strict: a lane keeps its earlier (lower) index on ties
            updated.append((jnp.where(up, score, best), jnp.where(up, index, best_index)))
        return tuple(updated)

    no_race = (jnp.full((tile,), -jnp.inf, jnp.float32), jnp.full((tile,), _NO_INDEX, jnp.int32))
    carry = jax.lax.fori_loop(first, last, step, (no_race,) * (len(out_refs) // 2))
    for (best, index), best_ref, index_ref in zip(carry, out_refs[::2], out_refs[1::2]):
        top = jnp.max(best)
        best_ref[b, s] = top
        index_ref[b, s] = jnp.min(jnp.where(best == top, index, _NO_INDEX))


def _combine(best, index):
    """Per request, the max over programs and the smallest index among the programs that reach it."""
    top = jnp.max(best, axis=1)
    return top, jnp.min(jnp.where(best == top[:, None], index, _NO_INDEX), axis=1)
