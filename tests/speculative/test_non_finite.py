"""Non-finite inputs to the verifier, with the jnp race and the Pallas kernel: NaN or +inf target
logits, an all -inf row, NaN or infinite draft probabilities and a NaN temperature make their
request invalid (nothing accepted, token -1) and leave its batch-mates' results unchanged; a
temperature below the floor (1e-37) is greedy, not NaN."""

import functools

import jax
import numpy as np
import pytest

from jdspark.speculative.verify import INVALID_TOKEN, rejection_sample
from tests.speculative.test_verify import random_inputs

B, K, VOCAB = 8, 2, 30


def verifier(implementation):
    return jax.jit(functools.partial(rejection_sample, implementation=implementation))


def poisoned_inputs():
    """Rows 1-5 and 7 each hold one kind of bad value; rows 0 and 6 are clean (row 6: T = 1e-37)."""
    logits, q, drafts, u, e, t, tk, tp = (np.array(a) for a in random_inputs(B, K, VOCAB, seed=3, temperature=1.0))
    q = np.ascontiguousarray(q)
    logits[1, 1, 4] = np.nan  # a NaN in the second target row
    q[2, 0, drafts[2, 0]] = np.nan  # the draft's own probability is NaN
    logits[3, 0, 7] = np.inf  # +inf target logit
    logits[4, 2] = -np.inf  # the bonus row all masked
    q[5, 1, drafts[5, 1]] = np.inf
    t[6] = 1e-37  # below the floor: greedy
    t[7] = np.nan
    return [logits, q, drafts, u, e, t, tk, tp]


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_non_finite_inputs_make_only_their_request_invalid(implementation):
    """Mutation caught: the acceptance test back at `reject iff p <= u q` (False for NaN, so NaN
    accepts every draft) with the race's silent token 0 for a NaN row, and any flag that leaks
    to batch-mates."""
    args = poisoned_inputs()
    n_acc, token, invalid = (np.asarray(a) for a in verifier(implementation)(*args))
    bad = np.array([False, True, True, True, True, True, False, True])
    np.testing.assert_array_equal(invalid, bad)
    np.testing.assert_array_equal(n_acc[bad], 0)
    np.testing.assert_array_equal(token[bad], INVALID_TOKEN)
    for b in np.flatnonzero(~bad):  # clean rows: what they get verified alone
        alone = [np.asarray(a) for a in verifier(implementation)(*(a[b:b + 1] for a in args))]
        assert (n_acc[b], token[b], invalid[b]) == (alone[0][0], alone[1][0], alone[2][0])


def test_a_temperature_below_the_floor_is_greedy():
    """T = 1e-37 verifies exactly as T = 0 (accept while the draft is the argmax, emit the argmax)."""
    args = poisoned_inputs()
    clean = [a[[0, 6]] for a in args]
    tiny = [np.asarray(a) for a in verifier("xla")(*clean[:5], np.array([1e-37, 1e-37], np.float32), *clean[6:])]
    zero = [np.asarray(a) for a in verifier("xla")(*clean[:5], np.zeros(2, np.float32), *clean[6:])]
    for a, b in zip(tiny, zero):
        np.testing.assert_array_equal(a, b)
    assert not tiny[2].any()
