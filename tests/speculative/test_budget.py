"""The multi-request budget (Algorithm 1 over stale confidences): the single-request case is the
§6 selector, the allocation follows survival and stops before a cost cliff, and it reads nothing
but its inputs (non-anticipating)."""

import itertools

import numpy as np
import pytest

from jdspark.speculative.budget import allocate_widths, padded_cost
from jdspark.speculative.selector import choose_width


@pytest.mark.parametrize("c, d, v", [([0.9, 0.9], 0.0, [1, 1, 100]), ([0.5, 0.9], 0.0, [1, 1, 1.4]),
                                     ([1.0], 0.0, [1, 2]), ([0.8, 0.7, 0.6, 0.5, 0.4], 0.3, [1, 1.1, 1.3, 1.6, 2.0, 2.5])])
def test_one_request_is_the_single_request_selector(c, d, v):
    assert allocate_widths([c], padded_cost(d, v)).tolist() == [choose_width(c, d, v)]


def test_a_token_priced_budget_goes_to_the_most_confident_requests():
    confidences = [[0.95, 0.9, 0.9], [0.3, 0.9, 0.9], [0.8, 0.8, 0.1]]
    widths = allocate_widths(confidences, lambda tokens, widest: 1.0 + 0.35 * tokens)
    survival = np.cumprod(confidences, axis=1)
    taken = [survival[r, j] for r in range(3) for j in range(widths[r])]
    left = [survival[r, j] for r in range(3) for j in range(widths[r], 3)]
    assert taken and left and min(taken) >= max(left)  # the top of the survival ranking


def test_with_a_cost_of_tokens_it_is_the_best_of_all_allocations():
    """For a fixed token count the top survivals are optimal (spec §9.1), and the search covers
    every count: brute force over all 5^3 width vectors finds nothing better."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        c = rng.uniform(0.2, 1.0, size=(3, 4))
        per_token = np.cumsum(rng.uniform(0.05, 0.5, size=16))
        cost = lambda tokens, widest: 1.0 + per_token[tokens - 3]  # noqa: E731
        survival = np.cumprod(c, axis=1)

        def throughput(w):
            return (3 + sum(survival[r, :w[r]].sum() for r in range(3))) / cost(3 + sum(w), max(w))
        best = max(throughput(w) for w in itertools.product(range(5), repeat=3))
        assert throughput(allocate_widths(c, cost)) == pytest.approx(best, rel=1e-12)


def ref_allocate_widths(c, step_cost):
    """The allocation as the loop the paper writes: candidates best-first, every prefix priced."""
    c = np.asarray(c, np.float64)
    survival = np.cumprod(c, axis=1)
    r_index, j_index = np.nonzero(survival > 0)
    order = np.lexsort((j_index, r_index, -survival[r_index, j_index]))
    widths = np.zeros(c.shape[0], np.int64)
    best_widths, tokens, widest, tau = widths.copy(), c.shape[0], 0, float(c.shape[0])
    best = tau / float(step_cost(tokens, widest))
    for r, j in zip(r_index[order].tolist(), j_index[order].tolist()):
        widths[r] = j + 1
        tokens, widest, tau = tokens + 1, max(widest, j + 1), tau + survival[r, j]
        if tau / float(step_cost(tokens, widest)) > best:
            best, best_widths = tau / float(step_cost(tokens, widest)), widths.copy()
    return best_widths


def test_the_vectorized_search_is_the_loop():
    """64 requests as the engine's largest bucket sees them, padded and per-token costs, ties from
    repeated and 0 / 1 confidences: the same widths as the loop."""
    rng = np.random.default_rng(2)
    for trial in range(60):
        c = rng.random((64, 5))
        if trial % 3 == 0:
            c[: 20] = rng.integers(0, 2, (20, 5))
            c[20:30] = 0.5
        v = np.sort(rng.random(6)) * 3e-3
        for cost in (padded_cost(rng.random() * 2e-3, v), lambda tokens, widest: 1.0 + 0.01 * tokens):
            np.testing.assert_array_equal(allocate_widths(c, cost), ref_allocate_widths(c, cost))


def test_a_cost_cliff_stops_the_widest_request_before_it():
    widths = allocate_widths([[0.99] * 4, [0.99] * 4], padded_cost(0.0, [1, 1.01, 1.02, 50, 50]))
    assert widths.tolist() == [2, 2]


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        allocate_widths([0.5, 0.5, 0.5], padded_cost(0, [1, 1, 1, 1]))
    with pytest.raises(ValueError, match="probability"):
        allocate_widths([[0.5, float("nan")]], padded_cost(0, [1, 1, 1]))
    with pytest.raises(ValueError, match=r"step_cost\(1, 0\)=0"):
        allocate_widths([[0.5]], lambda tokens, widest: 0.0)
