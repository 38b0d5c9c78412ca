"""Token warping (temperature, top-k, top-p) and the exponential race (spec dspark.md §5.6, §5.8).

The drafter samples q with these functions and the verifier evaluates p with them, so p and q are
warped identically by construction. A warped row is described by a few per-row numbers
(`WarpStats`); the probability of a token is an elementwise function of its logit and those numbers
(`stats_probs`). The verifier therefore evaluates p only at the draft tokens and on the one row it
samples from, and gets the same values `warp_probs` gives for the whole row.

Shapes: logits [..., V] float32. `temperature`, `top_k` and `top_p` are per-row values: scalars,
or arrays with one axis per row axis that broadcast to logits.shape[:-1] — [B] for [B, V] logits,
[B, 1] (one value per batch entry) or [B, R] for [B, R, V] logits. A [B] array with [B, R, V]
logits is an error, not a silent broadcast along R.

The warp (FreeToken's, spec §5.6), per row:
- temperature < MIN_TEMPERATURE (1e-5, vLLM's floor; NaN excepted): one-hot at the argmax of the raw
  logits (ties -> lowest index). Smaller temperatures would overflow logits / T;
- otherwise z = logits * (1 / T); top_k in 1..V-1 keeps tokens with z >= the k-th largest z (ties at the
  k-th value are kept; top_k <= 0 or >= V is off); softmax; top_p < 1 then keeps the smallest
  descending-probability prefix whose mass reaches top_p (the first token always; ties with the
  last kept value are kept too) and renormalises.
A row whose logits hold NaN or +inf (or are all -inf), or whose temperature is NaN, has a
non-finite `z_max`: `finite_rows` says which rows are usable, and the verifier flags the others.

Randomness: `exponential_noise` and `uniform_noise` are the only sources of sampling noise (the
prefill, decode, draft and verify paths all draw through them); see `exponential_noise` for why
jax.random.exponential is not used.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.rejection_sampler import race_score

MIN_TEMPERATURE = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_BITS_SCALE = 2.0 ** -32
_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1


class WarpStats(NamedTuple):
    """The numbers that define each warped row; every field has the shape logits.shape[:-1].

    Per-row divisions are stored as reciprocals and applied by multiplication: XLA rewrites
    x / broadcast(s) into x * broadcast(1 / s), so a division would round differently when a row
    is evaluated whole than when single tokens are gathered first.
    """

    greedy: jax.Array  # bool: temperature < MIN_TEMPERATURE, the row is one-hot at `argmax`
    argmax: jax.Array  # int32: argmax of the raw logits, lowest index on ties
    inv_temperature: jax.Array  # f32: 1 / temperature (1 on greedy rows); z = logits * this
    z_max: jax.Array  # f32: max of z
    threshold: jax.Array  # f32: a token is kept iff z >= threshold
    inv_norm: jax.Array  # f32: 1 / (sum over kept tokens of exp(z - z_max))


def check_logits(logits: jax.Array, name: str = "logits") -> None:
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} has shape {logits.shape}; it needs a non-empty vocabulary axis last")
    if logits.dtype != jnp.float32:
        raise TypeError(f"{name} has dtype {logits.dtype}; pass float32 (cast with .astype(jnp.float32))")


def per_row(value, rows: tuple[int, ...], name: str, integer: bool) -> jax.Array:
    """`value` as an int32 / float32 array of shape `rows`, or an error naming it and the fix."""
    arr = jnp.asarray(value)
    if integer and not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} has dtype {arr.dtype}; pass integers")
    if not integer and not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise TypeError(f"{name} has dtype {arr.dtype}; pass real numbers")
    if arr.ndim in (0, len(rows)) and all(a in (1, r) for a, r in zip(arr.shape, rows)):
        return jnp.broadcast_to(arr.astype(jnp.int32 if integer else jnp.float32), rows)
    one_per_entry = rows[:1] + (1,) * (len(rows) - 1)
    raise ValueError(
        f"{name} has shape {arr.shape}, which does not match the logits' rows {rows}; pass one value "
        f"per row (shape {rows}), per batch entry (shape {one_per_entry}) or a scalar"
    )


def warp_stats(logits, temperature, top_k, top_p) -> WarpStats:
    """Per-row description of the warped distribution of `logits` (see the module docstring)."""
    check_logits(logits)
    rows = logits.shape[:-1]
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # a NaN's index if the row has one
    t = per_row(temperature, rows, "temperature", integer=False)
    greedy = t < MIN_TEMPERATURE
    inv_t = 1.0 / jnp.where(greedy, 1.0, t)
    z = logits * inv_t[..., None]
    # Scaling by inv_t > 0 is monotone under rounding, so this is exactly max(z).
    z_max = jnp.take_along_axis(logits, argmax[..., None], axis=-1)[..., 0] * inv_t
    k = per_row(top_k, rows, "top_k", integer=True)
    p = per_row(top_p, rows, "top_p", integer=False)
    threshold = _filter_threshold(z, z_max, k, p)
    kept = jnp.where(z >= threshold[..., None], jnp.exp(z - z_max[..., None]), 0.0)
    stats = WarpStats(greedy, argmax, inv_t, z_max, threshold, 1.0 / jnp.sum(kept, axis=-1))
    # XLA may fuse the reductions above differently, and so sum in a different order, depending on
    # what consumes them; behind the barrier every program computes the same stats.
    return WarpStats(*jax.lax.optimization_barrier(tuple(stats)))


def _filter_threshold(z, z_max, top_k, top_p):
    """The smallest kept z per row under top-k then top-p (-inf where neither filters). On the CPU
    the vocabulary-wide sort runs only when some row filters: it was 40% of the embedded model's
    speculative step there (docs/BENCHMARKS.md); a GPU step keeps it unconditional, since a
    conditional would leave the step's CUDA graph."""
    vocab = z.shape[-1]
    if jax.default_backend() != "cpu":
        return _sorted_threshold(z, z_max, top_k, top_p)
    filters = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1))
    return jax.lax.cond(filters, _sorted_threshold, lambda z, *_: jnp.full(z.shape[:-1], -jnp.inf, z.dtype),
                        z, z_max, top_k, top_p)


def _sorted_threshold(z, z_max, top_k, top_p):
    """`_filter_threshold` from the row sorted in descending order."""
    vocab = z.shape[-1]
    zs = jnp.flip(jnp.sort(z, axis=-1), axis=-1)  # descending
    kth = jnp.take_along_axis(zs, (jnp.clip(top_k, 1, vocab) - 1)[..., None], axis=-1)[..., 0]
    thr_k = jnp.where((top_k > 0) & (top_k < vocab), kth, -jnp.inf)
    e = jnp.where(zs >= thr_k[..., None], jnp.exp(zs - z_max[..., None]), 0.0)
    cum = jnp.cumsum(e * (1.0 / jnp.sum(e, axis=-1, keepdims=True)), axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    # mass_before never decreases, so the kept positions are a prefix of the sorted row.
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[..., None], axis=-1), 1)
    last_kept = jnp.take_along_axis(zs, (n_keep - 1)[..., None], axis=-1)[..., 0]
    thr_p = jnp.where(top_p < 1, last_kept, -jnp.inf)
    return jnp.maximum(thr_k, thr_p)


def stats_probs(logits, stats: WarpStats) -> jax.Array:
    """Probabilities of `logits` under the sampled (non-greedy) warp that `stats` describes.

    Elementwise: the stats fields must broadcast against `logits` (expand them with [..., None]
    to evaluate whole rows, or gather them to evaluate single tokens).
    """
    z = logits * stats.inv_temperature
    return jnp.where(z >= stats.threshold, jnp.exp(z - stats.z_max) * stats.inv_norm, 0.0)


def finite_rows(stats: WarpStats) -> jax.Array:
    """bool [rows]: the row's logits and temperature were usable (no NaN, no +inf, not all -inf)."""
    return jnp.isfinite(stats.z_max)


def warp_probs(logits, temperature, top_k, top_p) -> jax.Array:
    """The warped distribution of every row of `logits`, float32 [..., V] (NaN rows: see
    `finite_rows`)."""
    stats = warp_stats(logits, temperature, top_k, top_p)
    one_hot = (jnp.arange(logits.shape[-1]) == stats.argmax[..., None]).astype(jnp.float32)
    probs = stats_probs(logits, jax.tree.map(lambda a: a[..., None], stats))
    return jnp.where(stats.greedy[..., None], one_hot, probs)


def sample(probs, exponentials) -> jax.Array:
    """One token per row by the exponential race argmax_v probs_v / E_v, E ~ Exp(1) passed in
    (draw it with `exponential_noise`).

    Equal in distribution to sampling from probs / sum(probs); no normalisation needed. Computed
    as race_score(probs, 1 / E), the same expression the verifier's race uses. A row without a
    positive finite entry (all zero, or NaN) returns token 0: callers that can meet such rows check
    `finite_rows` (the verifier flags them).
    """
    check_logits(probs, "probs")
    if exponentials.shape != probs.shape or exponentials.dtype != jnp.float32:
        raise ValueError(
            f"exponentials has shape {exponentials.shape} and dtype {exponentials.dtype}; pass float32 "
            f"Exp(1) noise of the probabilities' shape {probs.shape}"
        )
    return jnp.argmax(race_score(probs, 1.0 / exponentials), axis=-1).astype(jnp.int32)


def exponential_noise(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Exp(1) noise for the race, float32, with no atom at 0 (nor at infinity).

    E = -log(1 - W) with W = (n + 1/2) * 2^-32 for 32 random bits n: the midpoint of n's bucket.
    It is computed as -log1p(-W) for W < 1/2 and as -log of 1 - W = (~n + 1/2) * 2^-32 otherwise,
    so every value is the float32 rounding of the exact one (relative error ~2^-23) and
    2^-33 <= E <= 32 log 2 + log 2 (22.9): 1 / E is finite and no token wins the race outright.

    Why not jax.random.exponential: it is -log1p(-u) of a uniform on a grid of 2^-23 that includes
    0, so E = 0 with probability 2^-23 per entry and that token wins (excess mass ~ support x 2^-23:
    1.5% at V = 129,280). A grid that merely avoids 0 (U in [tiny, 1)) rounds every E the same way
    and biases the race by the same order in the other direction; midpoints cancel that to first
    order.

    Remaining discretisation bound: the grid of 2^-32 moves each E by at most 2^-33 near 0, and
    float32 rounding moves every score by a relative 2^-23 at most. A race over S tokens of
    positive weight then returns a token whose distribution is within about S * 2^-32 + 2^-22 of the
    exact one in total variation (<= 3.1e-5 at S = V = 129,280). Tokens less likely than ~2^-32
    times the winner are under-sampled; that mass is inside the bound.
    """
    bits = jax.random.bits(key, shape, jnp.uint32)
    low = bits < jnp.uint32(2 ** 31)
    w = (bits.astype(jnp.float32) + 0.5) * _BITS_SCALE  # used where < 1/2
    one_minus_w = ((~bits).astype(jnp.float32) + 0.5) * _BITS_SCALE  # used where <= 1/2
    return jnp.where(low, -jnp.log1p(-jnp.minimum(w, 0.5)), -jnp.log(jnp.minimum(one_minus_w, 0.5)))


def uniform_noise(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform(0, 1) noise, float32, on the midpoints of a grid of 2^-32 (so in (0, 1) strictly):
    the acceptance test p > u * q then errs by at most 2^-32 (plus float32 rounding) per draft."""
    bits = jax.random.bits(key, shape, jnp.uint32)
    return jnp.minimum((bits.astype(jnp.float32) + 0.5) * _BITS_SCALE, _BELOW_ONE)
