"""The sampling noise (`exponential_noise`, `uniform_noise`) and the race at the real vocabulary size.

The race argmax_v p_v / E_v is exact only if E ~ Exp(1) has no atom at 0: jax.random.exponential
gives E = 0 with probability 2^-23 per entry, and at V = 129,280 that hands ~1.5% of all draws to a
random token (issue 22). These tests draw their bits with the "rbg" PRNG (3x faster on the CPU
than threefry); the property under test is the map from uniform bits to noise, which does not
depend on where the bits come from.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jdspark.speculative.sampling import exponential_noise, sample, uniform_noise

V = 129_280  # the DeepSeek-V4 vocabulary
ROOT = pathlib.Path(__file__).resolve().parents[2]


def fast_key(seed):
    return jax.random.key(seed, impl="rbg")


@jax.jit
def _extremes(key):
    e = exponential_noise(key, (12_500_000,))
    u = uniform_noise(jax.random.fold_in(key, 1), (1_000_000,))
    return jnp.min(e), jnp.max(e), jnp.all(jnp.isfinite(e)), jnp.min(u), jnp.max(u)


def test_noise_has_no_zero_and_no_infinity_in_1e8_draws():
    """10^8 exponentials (8 chunks) are all in [2^-33, 22.9] and the uniforms in (0, 1).

    Mutation caught: the noise drawn with jax.random.exponential again (E = 0 with probability
    2^-23: ~12 zeros expected in 10^8 draws), or a uniform that can reach 0 or 1."""
    lo, hi = np.inf, 0.0
    for chunk in range(8):
        e_min, e_max, finite, u_min, u_max = (np.asarray(a) for a in _extremes(fast_key(chunk)))
        assert finite and e_min > 0 and 0 < u_min and u_max < 1, (chunk, e_min, e_max, u_min, u_max)
        lo, hi = min(lo, float(e_min)), max(hi, float(e_max))
    assert 2.0 ** -33 <= lo < 1e-6 and 15 < hi <= 33 * np.log(2) + 1e-4, (lo, hi)


def test_noise_is_the_midpoint_of_its_bits_bucket():
    """E = -log1p(-(n + 1/2) 2^-32) for the 32 random bits n (checked against float64 numpy), and
    Exp(1) in distribution (Kolmogorov-Smirnov).

    Mutation caught: the + 1/2 dropped (n = 0 gives E = 0 again) or replaced by rounding up
    (U in [tiny, 1) style: every E shifted one way, a bias of order support x grid step)."""
    key = fast_key(7)
    bits = np.asarray(jax.random.bits(key, (200_000,), jnp.uint32)).astype(np.float64)
    want = -np.log1p(-(bits + 0.5) * 2.0 ** -32)
    got = np.asarray(jax.jit(exponential_noise, static_argnums=1)(key, (200_000,)))
    np.testing.assert_allclose(got, want, rtol=4e-7)  # float32 rounding, at both ends of the range
    assert stats.kstest(got, "expon").pvalue > 1e-3


def _off_peak_count(noise_fn, rows, chunk=200):
    """Rows (of `rows`) whose race over the peaked row (logit 20 at token 0, 0 elsewhere) is not 0."""
    probs = jax.nn.softmax(jnp.zeros((V,), jnp.float32).at[0].set(20.0))
    count = jax.jit(lambda key: jnp.sum(sample(jnp.broadcast_to(probs, (chunk, V)), noise_fn(key, (chunk, V))) != 0))
    return sum(int(count(fast_key(1000 + i))) for i in range(rows // chunk))


ROWS = 1200
P_OFF = (V - 1) / (V - 1 + np.exp(20.0))  # exact P(token != 0) = 2.7e-4: 0.32 expected in 1200 rows
MAX_OFF = int(stats.binom.isf(1e-6, ROWS, P_OFF))  # 6: a count above it has probability < 1e-6


def test_a_peaked_distribution_at_the_full_vocabulary_is_sampled_exactly():
    """The race over V = 129,280 tokens with logits 20 at token 0 and 0 elsewhere: the off-peak
    count in 1200 rows is within the exact binomial (0.32 expected; at most 6, P(more) < 1e-6).

    Mutation caught: noise with an atom at E = 0 (jax.random.exponential): each entry wins
    outright with probability 2^-23, so ~1.5% of rows (18.5 of 1200 expected; P(<= 6) ~ 1e-3)
    return another token. Measured with these keys: 0 off-peak rows with `exponential_noise`, 12
    with jax.random.exponential."""
    count = _off_peak_count(exponential_noise, ROWS)
    assert count <= MAX_OFF, (count, MAX_OFF, ROWS * P_OFF)


def test_every_sampling_path_draws_through_the_noise_helpers():
    """No module of the package calls jax.random.exponential (or draws race noise another way):
    the prefill, decode, draft and verify paths all use `exponential_noise` / `uniform_noise`.

    Mutation caught: one path (e.g. the programs' verify noise) reverting to jax.random.exponential,
    which the small-vocabulary engine tests cannot see (the atom costs 16 x 2^-23 there)."""
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "jdspark").rglob("*.py")
                 if any(f"random.{name}(" in path.read_text() for name in ("exponential", "gumbel", "categorical"))]
    assert offenders == []
    for path in ("jdspark/engine/programs.py", "jdspark/drafter/dspark.py", "jdspark/speculative/verify.py"):
        assert "random.uniform(" not in (ROOT / path).read_text(), path
