"""Scripted acceptance (`EngineConfig.scripted_acceptance`, benchmarks only): a step accepts the
leading run of its verification uniforms below a, within each row's width, and reports confidences
of a; exact verification is untouched when it is None."""

import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.config.base import ConfigError
from jdspark.engine.engine import Engine
from jdspark.engine.programs import scripted_accepted
from jdspark.engine.request import SamplingParams

ACCEPTANCE = 0.7


def test_scripted_accepted_is_the_leading_run_below_a_within_each_width():
    u = jnp.array([[0.1, 0.2, 0.9, 0.1], [0.1, 0.1, 0.1, 0.1], [0.8, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]])
    width = jnp.array([4, 2, 4, 4])
    invalid = jnp.array([False, False, False, True])
    np.testing.assert_array_equal(scripted_accepted(u, width, 0.5, invalid), [2, 2, 0, 0])
    np.testing.assert_array_equal(scripted_accepted(u, width, 1.0, ~invalid), [0, 0, 0, 4])
    np.testing.assert_array_equal(scripted_accepted(u, width, 0.0, invalid), [0, 0, 0, 0])


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.8"])
def test_a_scripted_acceptance_outside_0_1_is_refused(value):
    with pytest.raises(ConfigError, match="scripted_acceptance"):
        EngineConfig(scripted_acceptance=value)


def test_a_scripted_engine_accepts_at_the_rate_it_was_given(dspark_model):
    """Width 5 on every step: the accepted counts follow P(n >= j) = a^j (within 3 sigma at each j,
    fixed seeds, a bound tight enough that a rate of a +- 0.1 fails), and every confidence a step
    read, past each request's first two (they read the prior: the second is issued before the
    first is read), is a: the random model, whose exact verification accepts almost
    nothing, does not decide."""
    config = EngineConfig(max_seq_len=256, gamma=5, max_batch=1, batch_buckets=(1,),
                          scripted_acceptance=ACCEPTANCE)
    engine = Engine(dspark_model, config, prefill_chunk=16, widths=(5,), width_policy=lambda confidence: 5)
    counts, seen = [], {}
    with engine.record_steps() as records:
        for seed in range(20):
            engine.complete([engine.add([0, 5, 6, 7], SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                                      ignore_eos=True))])
    for record in records:
        for row in record.rows:
            if row.width:
                assert row.width == 5
                counts.append(row.n_accepted)
                seen[row.request_id] = seen.get(row.request_id, 0) + 1
                if seen[row.request_id] > 2:
                    np.testing.assert_array_equal(row.stale_confidence, np.float32(ACCEPTANCE))
    counts = np.array(counts)
    assert len(counts) >= 300
    for j in range(1, 4):
        rate, n = np.mean(counts >= j), len(counts)
        bound = 3 * np.sqrt(ACCEPTANCE ** j * (1 - ACCEPTANCE ** j) / n)
        assert abs(rate - ACCEPTANCE ** j) < bound, (j, rate, ACCEPTANCE ** j, bound)
        assert bound < 0.1 * j * ACCEPTANCE ** (j - 1)  # the bound tells a from a +- 0.1
