"""The reference verifier: statistical losslessness of the first one and two emitted tokens (with a
biased sampler as a negative control), the greedy rule, mixed batches, width 0, the literal spec
recipe, and input validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jdspark.speculative.sampling import sample, warp_probs
from jdspark.speculative.verify import Verdict, ref_rejection_sample, rejection_sample

N = 20_000  # samples per distribution test (FreeToken's sampler tests use 20k too)
ALPHA = 1e-3
V = 8


def chi2_pvalue(cells, probs):
    """Chi-square p-value of observed cell ids against probabilities; cells with expected count < 5
    are pooled. A cell of probability 0 that is observed fails outright."""
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    counts = np.bincount(cells, minlength=len(probs))
    if counts[probs == 0].any():
        return 0.0
    expected = probs * len(cells)
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return scipy_stats.chisquare(observed, expected).pvalue


warp = jax.jit(warp_probs)
draw = jax.jit(sample)
reference = jax.jit(ref_rejection_sample)


@jax.jit
def biased_rejection_sample(target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature,
                            top_k, top_p, widths=None):
    """Negative control: after a rejection it samples p instead of the residual max(p - q, 0)."""
    n_acc, _, invalid = ref_rejection_sample(target_logits, draft_probs, draft_tokens, uniforms, exponentials,
                                             temperature, top_k, top_p, widths)
    p = warp_probs(target_logits, temperature[:, None], top_k[:, None], top_p[:, None])
    p_row = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]
    return Verdict(n_acc, sample(p_row, exponentials), invalid)


def draw_from(rng, probs):
    """Inverse-CDF draws in float64 numpy: independent of the race under test."""
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    u = rng.uniform(size=probs.shape[:-1] + (1,)) * cdf[..., -1:]
    return (u >= cdf).sum(-1).astype(np.int32)


def first_two_tokens(rng, target_logits, draft_logits, temperature, top_k, top_p, k, verifier):
    """N independent runs of up to two verification rounds from position 0 with per-position
    target logits [k+2, V] and draft logits [k+1, V] -> the first two emitted tokens [N, 2]."""
    params = (np.full(N, temperature, np.float32), np.full(N, top_k, np.int32), np.full(N, top_p, np.float32))
    q_all = np.asarray(warp(draft_logits, temperature, top_k, top_p))
    rounds = []
    for start in (0, 1):  # round two starts at position 1; it is used where round one emitted one token
        q = np.broadcast_to(q_all[start:start + k], (N, k, V))
        drafts = draw_from(rng, q)
        uniforms = rng.uniform(size=(N, k)).astype(np.float32)
        noise = rng.exponential(size=(N, V)).astype(np.float32)
        logits = np.broadcast_to(target_logits[start:start + k + 1], (N, k + 1, V))
        n_acc, token = (np.asarray(a) for a in verifier(logits, q, drafts, uniforms, noise, *params)[:2])
        emitted = np.concatenate([drafts, np.zeros((N, 1), np.int32)], axis=1)
        emitted[np.arange(N), n_acc] = token
        rounds.append((emitted, n_acc))
    (emitted, n_acc), (second_round, _) = rounds
    second = np.where(n_acc >= 1, emitted[:, min(1, k)], second_round[:, 0])
    return np.stack([emitted[:, 0], second], axis=1)


def moderate_overlap():
    p = np.log(np.array([0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]))
    q = np.log(np.array([0.1, 0.1, 0.4, 0.4, 1e-9, 1e-9, 1e-9, 1e-9]))
    return p, q


def logits_case(name, k):
    """(target logits [k+2, V], draft logits [k+1, V]) of a named case."""
    rng = np.random.default_rng(len(name) * 10 + k)
    if name == "moderate":
        p, q = moderate_overlap()
        target, draft = np.stack([p, np.roll(p, 3)] * (k + 2))[: k + 2], np.stack([q, np.roll(q, 3)] * (k + 2))[: k + 1]
    elif name == "nearly_disjoint":  # q puts 99.9% where p has 1%
        target = np.where(np.arange(V) < 4, 0.0, -4.0) + rng.normal(size=(k + 2, V)) * 0.3
        draft = np.where(np.arange(V) < 4, -7.0, 0.0) + rng.normal(size=(k + 1, V)) * 0.3
    elif name == "zero_q":  # the drafter can never propose tokens 5..7, which p likes
        target = rng.normal(size=(k + 2, V))
        draft = np.where(np.arange(V) >= 5, -np.inf, rng.normal(size=(k + 1, V)))
    elif name == "p_equals_q":  # every draft accepted; the bonus row decides
        target = rng.normal(size=(k + 2, V))
        draft = target[: k + 1]
    else:  # "random"
        target, draft = rng.normal(size=(k + 2, V)) * 1.5, rng.normal(size=(k + 1, V)) * 1.5
    return target.astype(np.float32), draft.astype(np.float32)


def expected_first_two(target_logits, temperature, top_k, top_p):
    p = np.asarray(warp(target_logits[:2], temperature, top_k, top_p), np.float64)
    return p[0], np.outer(p[0], p[1]).ravel()


def run_test(name, k, temperature=1.0, top_k=0, top_p=1.0, verifier=reference, seed=0):
    target, draft = logits_case(name, k)
    tokens = first_two_tokens(np.random.default_rng(seed), target, draft, temperature, top_k, top_p, k, verifier)
    p0, p01 = expected_first_two(target, temperature, top_k, top_p)
    return chi2_pvalue(tokens[:, 0], p0), chi2_pvalue(tokens[:, 0] * V + tokens[:, 1], p01)


@pytest.mark.parametrize("name, k", [("moderate", 1), ("moderate", 3), ("nearly_disjoint", 2),
                                     ("zero_q", 3), ("p_equals_q", 2), ("random", 5)])
def test_first_two_tokens_follow_the_target(name, k):
    first, pair = run_test(name, k)
    assert first > ALPHA and pair > ALPHA, (first, pair)


def test_first_two_tokens_follow_the_warped_target_at_t07_top_k_top_p():
    first, pair = run_test("random", 3, temperature=0.7, top_k=5, top_p=0.9)
    assert first > ALPHA and pair > ALPHA, (first, pair)


def test_width_zero_samples_the_first_row():
    first, _ = run_test("random", 0)
    assert first > ALPHA


@pytest.mark.parametrize("name", ["moderate", "nearly_disjoint"])
def test_negative_control_skipping_the_residual_fails(name):
    first, pair = run_test(name, 2, verifier=biased_rejection_sample)
    assert first < ALPHA and pair < ALPHA, (first, pair)


def random_inputs(b, k, vocab, seed, temperature=None, top_k=None, top_p=None):
    """Fresh random verifier inputs; drafts come from q, so acceptance runs are realistic."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(b, k + 1, vocab)) * 2).astype(np.float32)
    draft_logits = logits[:, :k] + rng.normal(size=(b, k, vocab)).astype(np.float32)
    t = rng.choice([0.0, 0.6, 1.0], size=b).astype(np.float32) if temperature is None else temperature
    tk = rng.choice([0, 3, 50], size=b).astype(np.int32) if top_k is None else top_k
    tp = rng.choice([1.0, 0.9, 0.3], size=b).astype(np.float32) if top_p is None else top_p
    t, tk, tp = (np.broadcast_to(a, (b,)).copy() for a in (t, tk, tp))
    q = np.asarray(warp(draft_logits, t[:, None], tk[:, None], tp[:, None]))
    drafts = np.asarray(draw(q, rng.exponential(size=q.shape).astype(np.float32)))
    uniforms = rng.uniform(size=(b, k)).astype(np.float32)
    noise = rng.exponential(size=(b, vocab)).astype(np.float32)
    return logits, q, drafts, uniforms, noise, t, tk, tp


def np_greedy(logits, drafts):
    argmax = logits.argmax(-1)
    n_acc = np.array([next((j for j in range(drafts.shape[1]) if drafts[b, j] != argmax[b, j]), drafts.shape[1])
                      for b in range(len(drafts))])
    return n_acc, argmax[np.arange(len(drafts)), n_acc]


def test_greedy_rows_follow_the_argmax_rule():
    logits, q, drafts, u, e, _, tk, tp = random_inputs(64, 4, 30, seed=5, temperature=0.0)
    argmax = logits.argmax(-1)
    drafts = np.where(np.random.default_rng(6).uniform(size=drafts.shape) < 0.8, argmax[:, :4], drafts)
    n_acc, token, _ = reference(logits, q, drafts, u, e, np.zeros(64, np.float32), tk, tp)
    want_n, want_token = np_greedy(logits, drafts)
    assert len(set(want_n)) == 5  # every acceptance length occurs
    np.testing.assert_array_equal(np.asarray(n_acc), want_n)
    np.testing.assert_array_equal(np.asarray(token), want_token)


def test_mixed_batch_rows_are_independent():
    args = random_inputs(24, 3, 40, seed=7)
    greedy = args[5] <= 0
    assert 0 < greedy.sum() < 24
    n_acc, token, _ = (np.asarray(a) for a in reference(*args))
    want_n, want_token = np_greedy(args[0], args[2])
    np.testing.assert_array_equal(n_acc[greedy], want_n[greedy])
    np.testing.assert_array_equal(token[greedy], want_token[greedy])
    sampled = np.flatnonzero(~greedy)
    alone = reference(*(a[sampled] for a in args))
    np.testing.assert_array_equal(np.asarray(alone[0]), n_acc[sampled])
    np.testing.assert_array_equal(np.asarray(alone[1]), token[sampled])


def test_width_zero_is_a_draw_from_the_first_row():
    logits, q, drafts, u, e, t, tk, tp = random_inputs(16, 0, 50, seed=8)
    n_acc, token, _ = reference(logits, q, drafts, u, e, t, tk, tp)
    p0 = warp(logits[:, 0], t, tk, tp)
    np.testing.assert_array_equal(np.asarray(n_acc), 0)
    np.testing.assert_array_equal(np.asarray(token), np.asarray(draw(p0, e)))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_a_row_at_its_own_width_equals_a_verification_at_that_width(implementation):
    """One K-wide call with per-row widths k_b gives, row by row, what a k_b-wide call on the first
    k_b + 1 logit rows, k_b drafts and uniforms gives (mixed greedy and sampled rows; row K + 1 and
    beyond poisoned with NaN: a row never reads past its own width)."""
    b, k = 30, 4
    logits, q, drafts, u, e, t, tk, tp = random_inputs(b, k, 25, seed=11)
    widths = np.arange(b) % (k + 1)
    argmax = logits.argmax(-1)
    drafts = np.where(np.random.default_rng(12).uniform(size=drafts.shape) < 0.7, argmax[:, :k], drafts)
    unused = np.arange(k + 1)[None, :] > widths[:, None]
    poisoned = np.where(unused[..., None], np.nan, logits).astype(np.float32)
    got = jax.jit(functools.partial(rejection_sample, implementation=implementation))(
        poisoned, q, drafts, u, e, t, tk, tp, widths)
    for w in range(k + 1):
        rows = np.flatnonzero(widths == w)
        want = reference(logits[rows, :w + 1], q[rows, :w], drafts[rows, :w], u[rows, :w], e[rows], t[rows],
                         tk[rows], tp[rows])
        for g, x in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g)[rows], np.asarray(x))
    assert not np.asarray(got.invalid).any()


@jax.jit
def spec_recipe(target_logits, draft_probs, draft_tokens, uniforms, exponentials, temperature, top_k, top_p):
    """Spec §5.8 written literally over the full warped p [B, K+1, V]."""
    b, k = draft_tokens.shape
    p = warp_probs(target_logits, temperature[:, None], top_k[:, None], top_p[:, None])
    p_tok = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], -1)[..., 0]
    q_tok = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    n_acc = jnp.sum(jnp.cumprod(~(p_tok <= uniforms * q_tok), axis=-1), axis=-1).astype(jnp.int32)
    p_row = p[jnp.arange(b), n_acc]
    q_row = jnp.concatenate([draft_probs, jnp.zeros_like(p[:, :1])], axis=1)[jnp.arange(b), n_acc]
    residual = jnp.maximum(p_row - q_row, 0.0)
    dist = jnp.where((residual.sum(-1) > 0)[:, None], residual, p_row)
    return n_acc, sample(dist, exponentials)


@pytest.mark.parametrize("b, k, vocab", [(32, 2, 20), (8, 5, 1000)])
def test_reference_equals_the_literal_spec_recipe(b, k, vocab):
    args = random_inputs(b, k, vocab, seed=b + k)
    for got, want in zip(reference(*args)[:2], spec_recipe(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_per_request_params_may_be_column_vectors():
    args = random_inputs(6, 2, 30, seed=10)
    columns = [*args[:5], *(a[:, None] for a in args[5:])]
    for got, want in zip(reference(*columns), reference(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_malformed_inputs_raise_clear_errors():
    logits, q, drafts, u, e, t, tk, tp = random_inputs(2, 3, 10, seed=9)
    with pytest.raises(ValueError, match=r"draft_probs has shape \(2, 2, 10\).*must be \(2, 3, 10\)"):
        ref_rejection_sample(logits, q[:, :2], drafts, u, e, t, tk, tp)
    with pytest.raises(ValueError, match=r"exponentials has shape \(2, 9\)"):
        ref_rejection_sample(logits, q, drafts, u, e[:, :9], t, tk, tp)
    with pytest.raises(TypeError, match="draft_tokens has dtype float32"):
        ref_rejection_sample(logits, q, drafts.astype(np.float32), u, e, t, tk, tp)
    with pytest.raises(TypeError, match="target_logits has dtype float16"):
        ref_rejection_sample(logits.astype(np.float16), q, drafts, u, e, t, tk, tp)
    with pytest.raises(ValueError, match=r"target_logits has shape \(2, 10\)"):
        ref_rejection_sample(logits[:, 0], q, drafts, u, e, t, tk, tp)
    with pytest.raises(ValueError, match=r"top_p has shape \(3,\)"):
        ref_rejection_sample(logits, q, drafts, u, e, t, tk, np.ones(3, np.float32))
