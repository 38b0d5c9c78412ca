"""Width selector (spec dspark.md §6.4 vectors and rules) and the fallback breaker (§8)."""

import numpy as np
import pytest

from jdspark.speculative import selector
from jdspark.speculative.selector import AdaptiveWidth, FallbackBreaker, choose_width, floored_costs


@pytest.mark.parametrize("confidences,draft_cost,verify_costs,expected", [
    ([0.9, 0.9], 0.0, [1, 1, 100], 1),  # stops before an expensive bucket (cliff)
    ([0.5, 0.9], 0.0, [1, 1, 1.4], 1),  # cumulative survival 0.45, not the raw 0.9 (which gives 2)
    ([1.0], 0.0, [1, 2], 0),  # ties keep the smaller width
    ([0.3, 0.2, 0.9, 0.8, 0.7], 3.0, [1] * 6, 5),  # a flat curve admits the whole prefix
    ([1e-3] * 5, 0.0, [1] * 6, 5),  # ... for any positive confidence
    ([0.0] * 5, 0.0, [1] * 6, 0),  # zero survival: every width ties at E = 1
])
def test_reference_vectors(confidences, draft_cost, verify_costs, expected):
    assert choose_width(confidences, draft_cost, verify_costs) == expected


def test_draft_cost_favours_longer_widths():
    c, v = [0.6, 0.6, 0.6], [1.0, 1.5, 2.0, 2.5]
    assert choose_width(c, 0.0, v) < choose_width(c, 20.0, v) == 3


def test_cost_curve_is_taken_as_measured():
    np.testing.assert_array_equal(floored_costs([2.0, 1.0, 3.0, 0.0]), [2.0, 1.0, 3.0, 1e-6])
    # width 2's executable measured as cheap as width 0's: it verifies more for the same cost and wins
    # (E(2)/V(2) = 1.55); a running max would have priced it at V = 2 and kept width 0
    assert choose_width([0.5, 0.1], 0.0, [1.0, 2.0, 1.0]) == 2


@pytest.mark.parametrize("args,message", [
    (([0.5, 0.5], 1.0, [1, 1]), "verify_costs has 2 values but 2 confidences need 3"),
    (([0.5, float("nan")], 1.0, [1, 1, 1]), "each must be a probability"),
    (([0.5, 1.5], 1.0, [1, 1, 1]), "each must be a probability"),
    (([0.5, 0.5], -1.0, [1, 1, 1]), "draft_cost=-1.0: must be finite and >= 0"),
    (([0.5, 0.5], float("inf"), [1, 1, 1]), "draft_cost=inf"),
    (([0.5, 0.5], 1.0, [1, -1, 1]), "verify_costs=.*must be finite and >= 0"),
    (([0.5, 0.5], 1.0, [1, float("nan"), 1]), "verify_costs=.*must be finite and >= 0"),
])
def test_malformed_inputs_raise_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        choose_width(*args)


def test_choice_is_the_argmax_of_expected_tokens_per_second_on_random_inputs():
    rng = np.random.default_rng(0)
    for _ in range(500):
        c, d, v = rng.random(5), rng.random() * 2e-3, np.sort(rng.random(6)) * 5e-3
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(c))])
        throughput = expected / (d + v)
        assert choose_width(c, d, v) == int(np.argmax(throughput))  # argmax: the first of ties
        assert AdaptiveWidth(v, d, gamma=5)(c) == choose_width(c, d, v)


def test_widths_of_a_batch_are_the_per_row_choices():
    """The vectorized path the engine takes for many rows: the same width per row, ties included
    (confidences of 0 and 1, flat and steep costs), and the same errors."""
    rng = np.random.default_rng(1)
    for costs in ([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], np.sort(rng.random(6)) * 5e-3, [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]):
        policy = AdaptiveWidth(costs, 1e-3, gamma=5)
        c = rng.random((300, 5))
        c[:40] = rng.integers(0, 2, (40, 5))  # exact 0 / 1 confidences: exact ties
        c[40:60] = 0.5
        np.testing.assert_array_equal(policy.widths(c), [policy(row) for row in c])
    with pytest.raises(ValueError, match="pass \\[rows, gamma=5\\]"):
        policy.widths(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="nan"):
        policy.widths(np.full((1, 5), np.nan))


def test_drafting_pays_where_the_best_width_beats_a_plain_decode_by_the_margin():
    """Mutation caught: no margin (rows priced between 1 and 1 + DRAFT_MARGIN times decoding)."""
    rng = np.random.default_rng(3)
    v, d, decode = np.sort(rng.random(6)) * 5e-3 + 1e-3, 2e-3, 2e-3
    c = rng.random((200, 5))
    best = (1.0 + np.concatenate([np.zeros((200, 1)), np.cumsum(np.cumprod(c, axis=1), axis=1)], axis=1)) / (d + v)
    pays = AdaptiveWidth(v, d, gamma=5, decode_cost=decode).drafting_pays(c)
    np.testing.assert_array_equal(pays, best.max(axis=1) > (1 + selector.DRAFT_MARGIN) / decode)
    assert (best.max(axis=1) > 1 / decode).sum() > pays.sum()  # the margin keeps some rows decoding
    assert 0 < pays.sum() < 200  # both answers occur
    assert AdaptiveWidth(v, d, gamma=5).drafting_pays(c).all()  # no decode cost: never pauses
    with pytest.raises(ValueError, match="decode_cost=0.0"):
        AdaptiveWidth(v, d, gamma=5, decode_cost=0.0)


def test_adaptive_width_chooses_with_the_measured_costs():
    policy = AdaptiveWidth([1.0, 1.0, 50.0, 50.0], 0.3, gamma=3)
    assert policy([0.9, 0.9, 0.9]) == 1 == choose_width([0.9, 0.9, 0.9], 0.3, [1.0, 1.0, 50.0, 50.0])
    assert AdaptiveWidth([1.0, 1.0, 50.0, 50.0], 200.0, gamma=3)([0.9, 0.9, 0.9]) == 3  # a costly draft: verify it all
    with pytest.raises(ValueError, match="need V\\(0..3\\): 4 verify costs, got 3"):
        AdaptiveWidth([1, 1, 1], 0.0, gamma=3)
    with pytest.raises(ValueError, match="confidences=\\[0.5, nan, 0.5\\]"):
        policy([0.5, float("nan"), 0.5])
    with pytest.raises(ValueError, match="2 confidences, the drafter proposes gamma=3"):
        policy([0.5, 0.5])


def test_breaker_trips_cools_down_probes_and_resets_its_window():
    breaker = FallbackBreaker(0.6, min_drafted=10, cooldown=3)
    for _ in range(2):  # 10 drafted, 4 accepted: rate 0.4 < 0.6 -> trip at the second record
        assert breaker.should_speculate()
        breaker.record(2, 5)
    assert breaker.trips == 1 and breaker.cooldown_left == 3
    decisions = [breaker.should_speculate() for _ in range(4)]
    assert decisions == [False, False, False, True]  # exactly `cooldown` target-only steps
    assert breaker.probe  # the first resumed step is the probe
    breaker.record(5, 5)  # counters were reset at the trip: 5 < min_drafted, no evaluation yet
    assert not breaker.probe and breaker.cooldown_left == 0
    breaker.record(1, 5)  # 6 / 10 = 0.6 >= threshold: no trip, window reset
    assert breaker.trips == 1 and breaker.drafted == 0
    breaker.record(0, 10)
    assert breaker.trips == 2


@pytest.mark.parametrize("kwargs,message", [
    (dict(threshold=0.0), "threshold=0.0: must be in \\(0, 1\\]"),
    (dict(threshold=1.5), "threshold=1.5"),
    (dict(threshold=0.6, min_drafted=0), "min_drafted=0 and cooldown=64 must be >= 1"),
    (dict(threshold=0.6, cooldown=0), "cooldown=0 must be >= 1"),
])
def test_breaker_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FallbackBreaker(**kwargs)
    with pytest.raises(ValueError, match="accepted=3, drafted=2"):
        FallbackBreaker(0.5).record(3, 2)


def test_expected_tokens_reuses_only_the_same_rows():
    """The last E(k) is kept for the same confidences (an engine step asks three times), never
    handed back for other rows. Mutation caught: a cache keyed on the rows' shape alone."""
    policy = AdaptiveWidth([1.0] * 6, 0.5, 5)
    sure, unsure = np.full((1, 5), 0.9), np.full((1, 5), 0.5)
    first = policy.expected_tokens(sure)
    assert policy.expected_tokens(sure.copy()) is first
    again = policy.expected_tokens(unsure)
    np.testing.assert_allclose(again[0, :3], [1.0, 1.5, 1.75])
    np.testing.assert_allclose(policy.expected_tokens(np.full((2, 5), 0.9)), np.repeat(first, 2, axis=0))
    with pytest.raises(ValueError):
        policy.expected_tokens(np.full((1, 5), 1.5))


def test_a_repriced_policy_chooses_at_its_new_costs_and_keeps_the_rows_memo():
    """`repriced` (what `live_costs.LiveCosts` does after every step): the costs and choices of a policy
    built at the new costs, the original unchanged, and E(k) of the same rows not computed again."""
    rng = np.random.default_rng(5)
    old = AdaptiveWidth([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], 0.5, 5, decode_cost=0.9)
    rows = rng.uniform(0.3, 1.0, (8, 5))
    memo = old.expected_tokens(rows)
    new_costs = [0.2, 0.4, 0.6, 3.0, 4.0, 5.0]
    repriced = old.repriced(new_costs, 0.3)
    fresh = AdaptiveWidth(new_costs, 0.5, 5, decode_cost=0.3)
    assert repriced.step_costs == fresh.step_costs and repriced.decode_cost == 0.3
    np.testing.assert_array_equal(repriced.widths(rows), fresh.widths(rows))
    np.testing.assert_array_equal(repriced.drafting_pays(rows), fresh.drafting_pays(rows))
    assert not np.array_equal(repriced.widths(rows), old.widths(rows))  # the new costs matter
    assert old.step_costs == [1.5, 1.6, 1.7, 1.8, 1.9, 2.0] and old.decode_cost == 0.9
    assert repriced.expected_tokens(rows.copy()) is memo
