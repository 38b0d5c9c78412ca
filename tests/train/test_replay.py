"""The replay of speculative decoding on a target sample: the renewal chain of block anchors and
the per-token acceptance probabilities it runs on."""

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.model.model import Model
from jdspark.train import drafter, replay
from tests.conftest import DSPARK_CONFIG

GAMMA = DSPARK_CONFIG.dspark.block_size


def simulate(alpha: np.ndarray, rng: np.random.Generator, runs: int) -> tuple[np.ndarray, float]:
    """Monte Carlo of the chain: per position the fraction of runs anchoring there, and tau."""
    length = alpha.shape[0]
    visits, steps, emitted = np.zeros(length), 0, 0
    for _ in range(runs):
        a = 0
        while a < length:
            visits[a] += 1
            accepted = 0
            while accepted < GAMMA and rng.random() < alpha[a, accepted]:
                accepted += 1
            steps, emitted = steps + 1, emitted + accepted + 1
            a += accepted + 1
    return visits / runs, emitted / steps


def test_the_anchor_chain_matches_a_monte_carlo_of_the_blocks():
    rng = np.random.default_rng(0)
    alpha = rng.uniform(0.2, 1.0, (40, GAMMA))
    result = replay.replayed_generation(jnp.asarray(alpha[None]))
    visits, tau = simulate(alpha, rng, 20000)
    np.testing.assert_allclose(np.asarray(result["anchors"][0]), visits, atol=0.02)
    np.testing.assert_allclose(float(result["tau"]), tau, rtol=0.02)


def test_the_chain_at_the_extremes():
    never = replay.replayed_generation(jnp.zeros((2, 12, GAMMA)))
    np.testing.assert_allclose(np.asarray(never["anchors"]), 1.0)  # every token is its own block
    assert float(never["tau"]) == 1.0
    always = replay.replayed_generation(jnp.ones((1, 14, GAMMA)))
    expected = np.zeros(14)
    expected[::GAMMA + 1] = 1.0
    np.testing.assert_allclose(np.asarray(always["anchors"][0]), expected)
    assert float(always["tau"]) == GAMMA + 1
    np.testing.assert_allclose(np.asarray(always["acceptance"]), 1.0)


def test_block_lengths_are_a_distribution():
    alpha = jnp.asarray(np.random.default_rng(1).uniform(0, 1, (3, 7, GAMMA)))
    lengths = np.asarray(replay.block_lengths(alpha))
    np.testing.assert_allclose(lengths.sum(-1), 1.0, rtol=1e-6)
    a = np.asarray(alpha)[0, 0]
    np.testing.assert_allclose(lengths[0, 0, 2], a[0] * a[1] * (1 - a[2]), rtol=1e-6)  # 2 accepted, 3 tokens


@pytest.mark.slow  # the target and the drafter compiled together: about 18 s
def test_token_acceptance_is_min_one_draft_over_target_probability():
    model = Model.random(DSPARK_CONFIG, "float32", seed=3)
    graphdef, params, frozen = nnx.split(model.module(), drafter.DRAFTER, ...)
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(4, DSPARK_CONFIG.vocab_size, (2, 24)), jnp.int32)
    anchors = jnp.asarray([[2, 9], [5, 11]], jnp.int32)

    @jax.jit
    def run(params):
        module = nnx.merge(graphdef, params, frozen)
        logp, features = drafter.target_outputs(module, ids)
        logits = drafter.block_outputs(module, features, ids, anchors)[0]
        return replay.token_acceptance(module, logp, features, ids, anchors), jax.nn.softmax(logits, -1), logp

    alpha, q, logp = (np.asarray(x) for x in run(params))
    assert alpha.shape == (2, 2, GAMMA)
    for b in range(2):
        for j in range(2):
            a = int(anchors[b, j])
            for k in range(GAMMA):
                x = int(ids[b, a + 1 + k])
                expected = min(1.0, q[b * 2 + j, k, x] / np.exp(logp[b, a + k, x]))
                np.testing.assert_allclose(alpha[b, j, k], expected, rtol=1e-5)
