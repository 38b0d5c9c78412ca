"""Warp (temperature / top-k / top-p) against an independent float64 numpy implementation, its edge
cases (the greedy temperature floor, non-finite rows), the exponential race's distribution and its
tie rule. The noise itself: test_noise.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jdspark.speculative.sampling import MIN_TEMPERATURE, finite_rows, sample, warp_probs, warp_stats

warp = jax.jit(warp_probs)


def np_warp_row(x, temperature, top_k, top_p):
    """FreeToken's warp for one row, written directly in float64 numpy."""
    vocab = len(x)
    if temperature < MIN_TEMPERATURE:
        out = np.zeros(vocab)
        out[np.argmax(x)] = 1.0
        return out
    z = x.astype(np.float64) / temperature
    if 0 < top_k < vocab:
        z = np.where(z < np.sort(z)[::-1][top_k - 1], -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs, kind="stable")
        n_keep = min(int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1, vocab)
        keep = probs >= probs[order[n_keep - 1]]  # ties with the last kept value stay
        probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    return probs


def np_warp(logits, temperature, top_k, top_p):
    rows = logits.shape[:-1]
    t, k, p = (np.broadcast_to(a, rows) for a in (temperature, top_k, top_p))
    out = np.empty(logits.shape)
    for i in np.ndindex(rows):
        out[i] = np_warp_row(logits[i], t[i], int(k[i]), p[i])
    return out


def random_params(rng, rows):
    return (
        rng.choice([0.0, 0.5, 1.0, 1.7], size=rows).astype(np.float32),
        rng.choice([0, 1, 3, 20, 10_000], size=rows).astype(np.int32),
        rng.choice([1.0, 0.95, 0.6, 0.05], size=rows).astype(np.float32),
    )


@pytest.mark.parametrize("shape", [(16, 50), (4, 3, 257), (2, 2, 1000)])
def test_warp_matches_numpy(shape):
    rng = np.random.default_rng(sum(shape))
    logits = (rng.normal(size=shape) * 2).astype(np.float32)
    params = random_params(rng, shape[:-1])
    got = np.asarray(warp(logits, *params))
    want = np_warp(logits, *params)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same kept support
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


def test_per_batch_entry_params_broadcast_over_rows():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 4, 40)).astype(np.float32)
    t, k, p = (a[:, None] for a in random_params(rng, (3,)))
    np.testing.assert_allclose(np.asarray(warp(logits, t, k, p)), np_warp(logits, t, k, p), rtol=2e-5,
                               atol=1e-7)


def test_greedy_is_one_hot_at_the_lowest_tied_argmax():
    logits = np.array([[1.0, 5.0, 2.0, 5.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    got = np.asarray(warp(logits, 0.0, 0, 1.0))
    np.testing.assert_array_equal(got, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_temperatures_below_the_floor_are_greedy():
    """Mutation caught: the greedy test back at `temperature <= 0` (T = 1e-37 then divides the
    logits into inf - inf = NaN probabilities, and the race returns token 0)."""
    logits = np.random.default_rng(9).normal(size=(4, 50)).astype(np.float32) * 5
    greedy = np.eye(50, dtype=np.float32)[logits.argmax(-1)]
    for t in (1e-37, 1e-30, 1e-6, 9.9e-6):
        got = np.asarray(warp(logits, t, 0, 1.0))
        np.testing.assert_array_equal(got, greedy, err_msg=str(t))
    assert not np.array_equal(np.asarray(warp(logits, 0.05, 0, 1.0)), greedy)  # above the floor: sampled
    assert np.isfinite(np.asarray(warp(logits, MIN_TEMPERATURE, 0, 1.0))).all()


def test_non_finite_rows_are_reported():
    """NaN or +inf logits, an all -inf row or a NaN temperature make a row unusable: `finite_rows`
    says so (the verifier flags those requests); -inf entries alone are masks, not errors."""
    logits = np.zeros((6, 8), np.float32)
    logits[0, 3] = np.nan
    logits[1, 5] = np.inf
    logits[2] = -np.inf
    logits[3, :4] = -np.inf  # a mask: fine
    t = np.array([1.0, 1.0, 1.0, 1.0, np.nan, 0.0], np.float32)
    got = np.asarray(jax.jit(lambda x, t: finite_rows(warp_stats(x, t, 0, 1.0)))(logits, t))
    np.testing.assert_array_equal(got, [False, False, False, True, False, True])


def test_top_k_one_keeps_the_max_and_its_ties():
    logits = np.array([[1.0, 3.0, 2.0, 0.5], [3.0, 1.0, 3.0, 0.0]], np.float32)
    got = np.asarray(warp(logits, 1.0, 1, 1.0))
    np.testing.assert_array_equal(got, [[0, 1, 0, 0], [0.5, 0, 0.5, 0]])


def test_top_k_keeps_ties_at_the_kth_value():
    logits = np.array([[3.0, 2.0, 2.0, 1.0]], np.float32)
    got = np.asarray(warp(logits, 1.0, 2, 1.0))[0]
    assert (got[:3] > 0).all() and got[3] == 0


def test_tiny_top_p_keeps_only_the_top_token():
    logits = np.random.default_rng(2).normal(size=(5, 30)).astype(np.float32)
    got = np.asarray(warp(logits, 0.8, 0, 1e-6))
    np.testing.assert_array_equal(got, np.eye(30)[logits.argmax(-1)])


def test_top_k_at_or_above_vocab_and_top_p_one_are_off():
    logits = np.random.default_rng(3).normal(size=(4, 30)).astype(np.float32)
    plain = np.asarray(warp(logits, 0.9, 0, 1.0))
    for top_k in (30, 31, -1):
        np.testing.assert_array_equal(np.asarray(warp(logits, 0.9, top_k, 1.0)), plain)
    np.testing.assert_allclose(plain, np.asarray(jax.nn.softmax(logits / np.float32(0.9))), rtol=1e-6)


@pytest.mark.parametrize("filtering", [False, True], ids=["none-filters", "one-filters"])
def test_the_sort_is_skipped_only_where_no_row_filters(filtering):
    """On the CPU the threshold's sort runs only when some row filters (top-k or top-p); either way the
    thresholds are those of the sorted computation, bit for bit."""
    from jdspark.speculative.sampling import _filter_threshold, _sorted_threshold
    rng = np.random.default_rng(3)
    z = jnp.asarray(rng.normal(size=(4, 300)) * 2, jnp.float32)
    z_max = jnp.max(z, axis=-1)
    top_k = jnp.asarray([0, 300, 0, 7 if filtering else 0], jnp.int32)
    top_p = jnp.asarray([1.0, 1.0, 0.8 if filtering else 1.0, 1.0], jnp.float32)
    got = np.asarray(jax.jit(_filter_threshold)(z, z_max, top_k, top_p))
    want = np.asarray(jax.jit(_sorted_threshold)(z, z_max, top_k, top_p))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want).any() == filtering


def test_masked_vocabulary_entries_get_zero():
    logits = np.array([[0.5, -np.inf, 1.0, -np.inf]], np.float32)
    got = np.asarray(warp(logits, 1.0, 0, 0.999))[0]
    assert got[1] == got[3] == 0 and got[0] > 0 and got[2] > 0


def test_malformed_inputs_raise_clear_errors():
    logits = np.zeros((2, 3, 10), np.float32)
    with pytest.raises(ValueError, match=r"temperature has shape \(2,\).*\(2, 1\)"):
        warp_probs(logits, np.ones(2, np.float32), 0, 1.0)
    with pytest.raises(TypeError, match="logits has dtype bfloat16"):
        warp_probs(logits.astype(jnp.bfloat16), 1.0, 0, 1.0)
    with pytest.raises(TypeError, match="top_k has dtype float32"):
        warp_probs(logits, 1.0, np.float32(3), 1.0)
    with pytest.raises(ValueError, match="exponentials has shape"):
        sample(jnp.ones((2, 10)), jnp.ones((2, 9)))


def test_exponential_race_samples_the_distribution():
    probs = np.array([0.5, 0.0, 0.2, 0.25, 0.05], np.float32)  # unnormalised scale does not matter
    n = 20_000
    noise = jax.random.exponential(jax.random.key(0), (n, 5), jnp.float32)
    tokens = np.asarray(jax.jit(sample)(jnp.broadcast_to(probs * 3, (n, 5)), noise))
    counts = np.bincount(tokens, minlength=5)
    assert counts[1] == 0
    keep = probs > 0
    assert scipy_stats.chisquare(counts[keep], probs[keep] / probs.sum() * n).pvalue > 1e-3


def test_race_ties_go_to_the_lowest_index():
    probs = jnp.array([[0.0, 0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 0.0, 0.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(sample(probs, jnp.ones((2, 5), jnp.float32))), [1, 0])
