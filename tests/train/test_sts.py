"""Sequential temperature scaling recovers the temperature that calibrates a head."""

import numpy as np

from jdspark.train import sts


def test_fit_recovers_a_known_overconfidence():
    rng = np.random.default_rng(0)
    n, gamma, true_t = 20000, 3, 2.0
    z = rng.normal(0.0, 3.0, (n, gamma))
    accept_prob = 1 / (1 + np.exp(-z / true_t))  # the raw head is over-confident by a factor 2
    prefix = sts.prefix_accepted(accept_prob, rng)
    temperatures, before, after = sts.fit(z, prefix)
    assert all(abs(t - true_t) / true_t < 0.2 for t in temperatures), temperatures
    assert all(a < b / 2 for a, b in zip(after, before)), (before, after)


def test_ece_of_a_calibrated_predictor_is_small_and_of_a_wrong_one_large():
    rng = np.random.default_rng(1)
    p = rng.random(50000)
    observed = (rng.random(p.size) < p).astype(float)
    assert sts.ece(p, observed) < 0.01
    assert sts.ece(np.clip(p + 0.3, 0, 1), observed) > 0.2
