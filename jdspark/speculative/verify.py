"""Exact verification of K drafts per request (spec dspark.md §5.2-5.4, §5.8).

p = warp(target_logits) with the warp q was sampled under. Draft j is accepted iff
p_j(x_j) > u_j * q_j(x_j) (the spec's "reject iff p <= u q", except that NaN rejects); n_accepted is
the accepted prefix. The emitted token is drawn from normalise(max(p_n - q_n, 0)) at the first
rejected row n (from p_n when that residual is all zero), or from the bonus row p_K when all K
drafts were accepted (K = 0: no drafts, a draw from p_0). Greedy rows (temperature below
`sampling.MIN_TEMPERATURE`) accept while x_j == argmax p_j and emit the argmax of the first
mismatching row or of row K. Only (n_accepted, token, invalid) leave the device; EOS / stop tokens
are the engine's business.

Non-finite inputs: a request whose target logits hold NaN or +inf in any of its K+1 rows (or are
all -inf, or whose temperature is NaN), or whose draft probability at a draft token is NaN or
infinite, is `invalid`: it accepts nothing and its token is INVALID_TOKEN (-1, outside every
vocabulary). The caller turns `invalid` into an error for that request; the other rows of the
batch are unaffected.

Two stages. Stage A (XLA, here) computes the warp statistics of every row, p at the draft tokens,
n_accepted, the greedy tokens, the one row p_row = p[n_accepted] that is sampled from, and 1 / E;
it ends in an optimization barrier so both implementations receive identical values. Stage B is
the vocabulary-wide race: `ref_race` (jnp) or `race` (Pallas) from
`pallas_kernels.rejection_sampler`, which agree bit for bit, chosen by `implementation` ("auto",
"pallas" or "xla": `pallas_kernels.resolve_implementation`).

Shapes: target_logits [B, K+1, V] f32, draft_probs [B, K, V] f32 (the exact distributions the
drafts were sampled from), draft_tokens [B, K] int, uniforms [B, K] f32 in (0, 1),
exponentials [B, V] f32 Exp(1) noise (draw both with `sampling.uniform_noise` and
`sampling.exponential_noise`), temperature / top_p [B] f32, top_k [B] int (or [B, 1], or
scalars). K (0..gamma) is static, from the shapes.

Per-row widths: `widths` [B] int in 0..K verifies row b at its own k_b <= K (None: every row at K).
Row b then reads only its first k_b + 1 logit rows and k_b drafts, and takes the bonus from row k_b
when all k_b are accepted; with causal attention those rows are exactly a k_b-wide verification's,
so one K-wide call verifies a batch whose requests chose different widths.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jdspark.speculative.sampling import check_logits, finite_rows, per_row, stats_probs, warp_stats
from pallas_kernels import resolve_implementation
from pallas_kernels.rejection_sampler import race, ref_race

INVALID_TOKEN = -1  # the token of an invalid request (non-finite inputs)


class Verdict(NamedTuple):
    """One verification's result per request."""

    n_accepted: jax.Array  # [B] int32: accepted drafts (0 where invalid)
    token: jax.Array  # [B] int32: the emitted residual / bonus token (INVALID_TOKEN where invalid)
    invalid: jax.Array  # [B] bool: non-finite target logits, temperature or draft probabilities


class RaceInputs(NamedTuple):
    """Stage A's output: what the race reads, and the greedy rows' answer."""

    n_accepted: jax.Array  # [B] int32
    invalid: jax.Array  # [B] bool
    greedy: jax.Array  # [B] bool
    greedy_token: jax.Array  # [B] int32: argmax of row n_accepted
    p_row: jax.Array  # [B, V] f32: p[n_accepted] under the sampled warp
    inv_exponentials: jax.Array  # [B, V] f32: 1 / E


def ref_rejection_sample(
    target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p, widths=None,
) -> Verdict:
    """The reference verifier: `rejection_sample` with the jnp race."""
    return rejection_sample(target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k,
                            top_p, widths, implementation="xla")


def rejection_sample(
    target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p, widths=None,
    *, implementation: str = "auto",
) -> Verdict:
    """Verification with the race in the Pallas kernel or in jnp (`implementation`); identical results."""
    check_inputs(target_logits, draft_probs, draft_tokens, uniforms, exponentials)
    race_fn = race if resolve_implementation(implementation) == "pallas" else ref_race
    k = draft_tokens.shape[1]
    widths = jnp.full((target_logits.shape[0],), k, jnp.int32) if widths is None else jnp.asarray(widths, jnp.int32)
    if widths.shape != (target_logits.shape[0],):
        raise ValueError(f"widths has shape {widths.shape}; pass one width in 0..K={k} per request, "
                         f"shape ({target_logits.shape[0]},)")
    inputs = race_inputs(target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p,
                         widths)
    # The race draws the residual of row n_accepted iff n_accepted < K: a row that accepted all its
    # own k_b drafts is sent as K, so it draws the bonus from p_row (= p[k_b]).
    race_row = jnp.where(inputs.n_accepted >= widths, k, inputs.n_accepted)
    sampled = race_fn(inputs.p_row, draft_probs, race_row, inputs.inv_exponentials)
    token = jnp.where(inputs.greedy, inputs.greedy_token, sampled)
    return Verdict(inputs.n_accepted, jnp.where(inputs.invalid, INVALID_TOKEN, token).astype(jnp.int32),
                   inputs.invalid)


def race_inputs(
    target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p, widths=None,
) -> RaceInputs:
    """Stage A: warp statistics, acceptance, and the row to sample from (see the module docstring);
    row b reads only its first widths[b] + 1 logit rows and widths[b] drafts."""
    batch, k1 = target_logits.shape[:2]
    widths = jnp.full((batch,), k1 - 1, jnp.int32) if widths is None else widths
    row_used = jnp.arange(k1)[None, :] <= widths[:, None]  # [B, K+1]

    def per_request(value, name, integer):  # scalar, [B] or [B, 1] -> [B, 1]
        value = jnp.asarray(value)
        return per_row(value[:, 0] if value.shape[1:] == (1,) else value, (batch,), name, integer)[:, None]

    stats = warp_stats(
        target_logits,
        per_request(temperature, "temperature", False),
        per_request(top_k, "top_k", True),
        per_request(top_p, "top_p", False),
    )
    drafted = jax.tree.map(lambda a: a[:, :-1], stats)  # the K rows that check a draft
    tokens = draft_tokens.astype(jnp.int32)[..., None]
    p_tok = stats_probs(jnp.take_along_axis(target_logits[:, :-1], tokens, axis=-1)[..., 0], drafted)
    q_tok = jnp.take_along_axis(draft_probs, tokens, axis=-1)[..., 0]
    draft_used = row_used[:, 1:]  # draft j is verified iff j < widths[b]
    invalid = (~jnp.all(finite_rows(stats) | ~row_used, axis=-1)
               | ~jnp.all(jnp.isfinite(q_tok) | ~draft_used, axis=-1))
    accept = jnp.where(drafted.greedy, tokens[..., 0] == drafted.argmax, p_tok > uniforms * q_tok)  # NaN: False
    n_accepted = accepted_prefix(~accept | ~draft_used | invalid[:, None])
    row_stats = jax.tree.map(lambda a: _at_row(a, n_accepted)[:, None], stats)
    logits_row = jnp.take_along_axis(target_logits, n_accepted[:, None, None], axis=1)[:, 0]
    return RaceInputs(
        *jax.lax.optimization_barrier((
            n_accepted,
            invalid,
            row_stats.greedy[:, 0],
            row_stats.argmax[:, 0],
            stats_probs(logits_row, row_stats),
            1.0 / exponentials,
        ))
    )


def accepted_prefix(reject):
    """Length of the leading run of False in each row of reject [B, K] -> [B] int32."""
    return jnp.sum(jnp.cumprod(~reject, axis=-1), axis=-1).astype(jnp.int32)


def _at_row(per_row_values, row):
    """per_row_values [B, R] at row[b] -> [B]."""
    return jnp.take_along_axis(per_row_values, row[:, None], axis=1)[:, 0]


def check_inputs(target_logits, draft_probs, draft_tokens, uniforms, exponentials) -> None:
    """Shapes and dtypes at the Python boundary; each error names the argument and the fix."""
    check_logits(target_logits, "target_logits")
    if target_logits.ndim != 3:
        raise ValueError(f"target_logits has shape {target_logits.shape}; pass [B, K+1, V] (K drafts)")
    batch, k1, vocab = target_logits.shape
    k = k1 - 1
    expected = {
        "draft_probs": ((batch, k, vocab), "float32"),
        "draft_tokens": ((batch, k), "integer"),
        "uniforms": ((batch, k), "float32"),
        "exponentials": ((batch, vocab), "float32"),
    }
    given = dict(draft_probs=draft_probs, draft_tokens=draft_tokens, uniforms=uniforms,
                 exponentials=exponentials)
    for name, (shape, kind) in expected.items():
        value = given[name]
        if tuple(value.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; with target_logits {target_logits.shape} "
                f"(B={batch}, K={k}, V={vocab}) it must be {shape}"
            )
        ok = jnp.issubdtype(value.dtype, jnp.integer) if kind == "integer" else value.dtype == jnp.float32
        if not ok:
            raise TypeError(f"{name} has dtype {value.dtype}; pass {kind}")
