"""How a step's rows get their widths (`engine/widths.py`) and which batch buckets a config
compiles: pure functions, no engine."""

import functools
import types

import numpy as np
import pytest

from jdspark.config import ConfigError, EngineConfig
from jdspark.engine.errors import EngineError
from jdspark.engine.options import SpecOptions
from jdspark.engine.request import SamplingParams
from jdspark.engine.sequence import Sequence
from jdspark.engine.widths import executable_width, price_for_the_batch, price_the_step, row_widths
from jdspark.speculative.selector import DRAFT_MARGIN, AdaptiveWidth, FallbackBreaker

STALE = {0: np.array([0.9, 0.9, 0.9]), 3: np.array([0.2, 0.5, 0.5]), 5: np.array([1.0, 1.0, 0.1])}
SPECULATING = {0: True, 3: True, 5: False}  # slot 5's breaker is cooling down


def own_width(confidence):
    return int(confidence[0] * 3)


def test_per_request_rows_keep_their_own_widths_and_a_cooling_row_verifies_none():
    assert row_widths("per_request", STALE, SPECULATING, own_width, None) == {0: 2, 3: 0, 5: 0}


def test_padded_rows_all_verify_the_widest_choice():
    assert row_widths("padded", STALE, SPECULATING, own_width, None) == {0: 2, 3: 2, 5: 2}


def test_the_budget_spends_drafts_on_the_confident_request():
    costs = AdaptiveWidth([1.0, 1.05, 1.1, 1.15], 0.1, gamma=3)
    widths = row_widths("budget", STALE, SPECULATING, own_width, costs)
    assert widths[5] == 0 and widths[0] >= widths[3] and widths[0] > 0
    with pytest.raises(EngineError, match="batch_widths='budget'.*adaptive widths"):
        row_widths("budget", STALE, SPECULATING, own_width, None)


def test_a_width_runs_in_the_narrowest_compiled_executable_that_holds_it():
    assert executable_width({0: 1, 1: 3}, {0: None, 2: None, 5: None}) == 5
    assert executable_width({0: 0, 1: 2}, {0: None, 2: None, 5: None}) == 2
    with pytest.raises(EngineError, match="chose k=4, but only widths \\[1, 2\\]"):
        executable_width({0: 4}, {1: None, 2: None})


def test_batch_buckets_default_to_powers_of_4_up_to_max_batch_and_are_checked():
    assert EngineConfig(max_batch=1).buckets == (1,)
    assert EngineConfig(max_batch=16).buckets == (1, 4, 16)
    assert EngineConfig(max_batch=20).buckets == (1, 4, 16, 20)
    config = EngineConfig(max_batch=8, batch_buckets=(8, 2))
    assert config.buckets == (2, 8) and config.bucket(1) == 2 and config.bucket(3) == 8
    with pytest.raises(ConfigError, match="batch_buckets=\\(1, 4\\).*max_batch itself"):
        EngineConfig(max_batch=8, batch_buckets=(1, 4))
    with pytest.raises(ConfigError, match="batch_buckets=\\(0, 8\\)"):
        EngineConfig(max_batch=8, batch_buckets=(0, 8))


def test_prefill_buckets_default_to_the_batch_buckets_and_are_checked():
    assert EngineConfig(max_batch=16).prefill_buckets == (1, 4, 16)
    config = EngineConfig(max_batch=16, batch_buckets=(16,), prefill_batch_buckets=(16, 1, 4))
    assert config.buckets == (16,) and config.prefill_buckets == (1, 4, 16)
    assert config.prefill_bucket(1) == 1 and config.prefill_bucket(2) == 4 and config.bucket(1) == 16
    with pytest.raises(ConfigError, match="prefill_batch_buckets=\\(1, 4\\).*max_batch itself"):
        EngineConfig(max_batch=8, prefill_batch_buckets=(1, 4))


def test_an_unknown_batch_widths_mode_is_refused():
    with pytest.raises(ValueError, match="batch_widths='ragged': use one of per_request, padded, budget"):
        SpecOptions(batch_widths="ragged")


COMPILED = {0: None, 1: None, 2: None, 3: None}


def test_a_drafting_step_is_priced_for_every_row_it_runs():
    """S(k) = 10 ms at every width, decode 3.5 ms. Two confident rows draft (2 x 4 tokens per 10 ms
    beats 2 per 3.5 ms); a row that wants width 3 next to one cooling down does not (1 + 4 tokens
    per 10 ms), and gets the decode call, unless the engine's pauses are off (then every
    speculative step drafts)."""
    costs = AdaptiveWidth([0.004] * 4, 0.006, gamma=3, decode_cost=0.0035)
    sure, cool = np.ones(3), np.full(3, 0.1)
    assert price_the_step({0: 3, 1: 3}, {0: sure, 1: sure}, costs, COMPILED, may_decode=True) == (3, {0: 3, 1: 3})
    assert price_the_step({0: 3, 1: 0}, {0: sure, 1: cool}, costs, COMPILED, may_decode=True) == (None, {0: 0, 1: 0})
    assert price_the_step({0: 3, 1: 0}, {0: sure, 1: cool}, costs, COMPILED, may_decode=False) == (3, {0: 3, 1: 0})


def test_a_drafting_step_must_be_priced_above_decoding_by_the_margin():
    """Two sure rows at width 3 (4 tokens each), decode 1 s: S(3) priced at 1.05x decoding's tokens a
    second decodes, at 1.15x it drafts (`selector.DRAFT_MARGIN` = 0.10). Mutation caught:
    no margin."""
    sure = np.ones(3)
    for gain, width in ((1.05, None), (1.15, 3)):
        costs = AdaptiveWidth([4.0 / gain] * 4, 0.0, gamma=3, decode_cost=1.0)
        assert price_the_step({0: 3, 1: 3}, {0: sure, 1: sure}, costs, COMPILED, may_decode=True)[0] == width


def test_a_probe_drafts_only_where_its_best_case_could_make_the_draft_pay():
    """The costs above. A probing row (back from a pause) is judged at confidences of 1: next to a
    confident row, 4 + 4 tokens per 10 ms would beat decoding, so the step drafts (and the probe
    refreshes its confidences); next to a row that cools down, even 1 + 4 tokens per 10 ms lose to 2
    per 3.5 ms, so the step decodes and the probe waits."""
    costs = AdaptiveWidth([0.004] * 4, 0.006, gamma=3, decode_cost=0.0035)
    sure, cool = np.ones(3), np.full(3, 0.1)
    assert price_the_step({0: 3, 1: 0}, {0: sure, 1: cool}, costs, COMPILED, may_decode=True,
                          probing={1}) == (3, {0: 3, 1: 0})
    assert price_the_step({0: 0, 1: 0}, {0: cool, 1: cool}, costs, COMPILED, may_decode=True,
                          probing={1}) == (None, {0: 0, 1: 0})


def test_a_probe_is_judged_where_new_requests_start():
    """The costs above, a lone probing row: at confidences of 1 (4 tokens per 10 ms against 1 per
    3.5 ms) it drafts; at the engine's recent confidences of 0.5 (E(3) = 1.875 per 10 ms) even its
    probe cannot pay, so the step decodes and the probe waits. Mutation caught: a probe judged at
    ones whatever `probe_confidence` says."""
    costs = AdaptiveWidth([0.004] * 4, 0.006, gamma=3, decode_cost=0.0035)
    cool = np.full(3, 0.1)
    assert price_the_step({0: 0}, {0: cool}, costs, COMPILED, may_decode=True, probing={0})[0] is not None
    assert price_the_step({0: 0}, {0: cool}, costs, COMPILED, may_decode=True, probing={0},
                          probe_confidence=np.full(3, 0.5)) == (None, {0: 0})


def test_a_wide_row_is_clipped_where_its_width_costs_the_batch_more_than_it_brings():
    """V(3) is five times V(1): three rows that want width 1 and one that wants 3 verify at most 1
    (4 x 1.9 tokens per 2 ms beats 3 x 1.9 + 3.44 per 6 ms); with a flat V the wide row keeps its 3."""
    stale = {b: np.full(3, 0.9) for b in range(4)}
    steep = AdaptiveWidth([0.001, 0.001, 0.003, 0.005], 0.001, gamma=3, decode_cost=0.002)
    widths = {0: 1, 1: 1, 2: 1, 3: 3}
    assert price_the_step(widths, stale, steep, COMPILED, may_decode=True) == (1, {0: 1, 1: 1, 2: 1, 3: 1})
    flat = AdaptiveWidth([0.001] * 4, 0.001, gamma=3, decode_cost=0.002)
    assert price_the_step(widths, stale, flat, COMPILED, may_decode=True) == (3, widths)


def test_a_lone_row_keeps_its_own_width():
    """One row: its own width already maximises E(k) / S(k), and where it drafts the pause found
    drafting pays; pricing the step changes nothing (fresh random confidences and costs)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        costs = AdaptiveWidth(np.sort(rng.uniform(0.001, 0.01, 4)), rng.uniform(0, 0.01), gamma=3,
                              decode_cost=rng.uniform(0.001, 0.02))
        c = rng.uniform(0, 1, (1, 3))
        if not costs.drafting_pays(c)[0]:
            continue
        width = int(costs.widths(c)[0])
        assert price_the_step({7: width}, {7: c[0]}, costs, COMPILED, may_decode=True) == (width, {7: width})


def priced_one_row_at_a_time(widths, stale, policy, compiled, may_decode, probing, lifted, probe_confidence, switch,
                             typical):
    """`price_the_step` as its docstring says it, in plain Python loops: the oracle of the test below."""
    def expected(c):
        table, survival = [1.0], 1.0
        for x in c:
            survival *= float(x)
            table.append(table[-1] + survival)
        return table

    stay, switch_cost = switch
    cost = [c + (switch_cost if k != stay else 0.0) for k, c in enumerate(policy.step_costs)]

    def rate(k, tables, probe_table=None):
        tokens = [probe_table[k] if probe_table is not None and b in probing
                  else tables[b][k if b in lifted else min(widths[b], k)] for b in widths]
        return sum(tokens) / cost[k]

    tables = {b: expected(stale[b]) for b in widths}
    first = min(k for k in compiled if k >= max(widths.values()))
    ks = [first, *sorted(k for k in compiled if k != first and (lifted & set(widths) or k < first))]
    best = max(ks, key=lambda k: rate(k, tables))
    if may_decode and policy.decode_cost is not None:
        judge = tables if typical is None else {b: expected(typical[b]) for b in widths}
        could = max(rate(k, judge) for k in ks)
        if probing & set(widths):
            start = expected(np.ones(len(cost) - 1) if probe_confidence is None else probe_confidence)
            could = max(rate(k, judge, start) for k in sorted(compiled))
        if len(widths) * (1 + DRAFT_MARGIN) / (policy.decode_cost + switch_cost * (stay != "decode")) >= could:
            return None, dict.fromkeys(widths, 0)
    return best, {b: best if b in lifted else min(w, best) for b, w in widths.items()}


def test_the_step_price_matches_a_row_by_row_reading_of_its_rule():
    """Fresh random batches (rows lifted, clipped, probing; switch costs; typical proposals; confidences
    of exactly 0 and 1, whose flat E(k) at the flat V(k) of a host-paced bucket make ties) priced by
    `price_the_step` and by the oracle above."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        gamma, rows = int(rng.choice([3, 5])), int(rng.integers(1, 7))
        verify = rng.uniform(0.001, 0.004, gamma + 1) if rng.uniform() < 0.6 else np.full(gamma + 1, 0.002)
        policy = AdaptiveWidth(verify, rng.uniform(0, 0.002), gamma=gamma, decode_cost=rng.uniform(0.0005, 0.003))
        compiled = dict.fromkeys(sorted({gamma, *rng.choice(gamma, int(rng.integers(0, gamma)), replace=False)}))
        slots = rng.choice(16, rows, replace=False).tolist()
        confidences = lambda: rng.choice([0.0, 1.0, *rng.uniform(0, 1, 4)], gamma)  # noqa: E731
        stale = {b: confidences() for b in slots}
        widths = {b: int(rng.integers(0, gamma + 1)) for b in slots}
        pick = lambda p: {b for b in slots if rng.uniform() < p}  # noqa: E731
        lifted, probing = pick(0.5), pick(0.2)
        switch = [(None, 0.0), (int(rng.choice(list(compiled))), 0.0005), ("decode", 0.0005)][int(rng.integers(3))]
        typical = {b: confidences() for b in slots} if rng.uniform() < 0.5 else None
        probe_confidence = rng.uniform(0.3, 1, gamma) if rng.uniform() < 0.5 else None
        args = (widths, stale, policy, compiled, bool(rng.integers(2)), probing, lifted, probe_confidence, switch,
                typical)
        assert price_the_step(*args[:4], may_decode=args[4], probing=probing, lifted=lifted,
                              probe_confidence=probe_confidence, switch=switch,
                              typical=typical) == priced_one_row_at_a_time(*args)


def test_rows_are_lifted_to_the_step_width_where_it_costs_nothing():
    """per_request under adaptive widths: the executable is padded, so every speculating row
    verifies the step's width, which may exceed every row's own choice; a row that is not
    speculating keeps 0. With a flat V the batch verifies 3 (4 x 3.44 tokens per 2 ms); with the
    steep one of the clipping test every row verifies 1 (4 x 1.9 tokens per 2 ms)."""
    stale = {b: np.full(3, 0.9) for b in range(4)}
    widths, every = {0: 1, 1: 1, 2: 1, 3: 3}, {0, 1, 2, 3}
    flat = AdaptiveWidth([0.001] * 4, 0.001, gamma=3, decode_cost=0.002)
    steep = AdaptiveWidth([0.001, 0.001, 0.003, 0.005], 0.001, gamma=3, decode_cost=0.002)
    assert price_the_step(widths, stale, flat, COMPILED, may_decode=True, lifted=every) == (3, dict.fromkeys(every, 3))
    assert price_the_step(widths, stale, steep, COMPILED, may_decode=True,
                          lifted=every) == (1, dict.fromkeys(every, 1))
    assert price_the_step({0: 1, 1: 1}, stale, flat, COMPILED, may_decode=True, lifted={0, 1}) == (3, {0: 3, 1: 3})
    cool = {0: stale[0], 1: np.full(3, 0.1)}
    assert price_the_step({0: 1, 1: 0}, cool, flat, COMPILED, may_decode=True, lifted={0}) == (3, {0: 3, 1: 0})


def test_a_paused_row_verifies_the_width_a_drafting_step_pays_for_and_a_cooling_one_does_not():
    """Under per_request a row paused by the adaptive pause, next to rows that draft, is lifted to
    the step's width (its drafts cost the step nothing more) and counts in the step's price; a row
    whose breaker cools down keeps 0. Under "padded" neither is lifted. Mutation caught: paused rows
    left at width 0 (run B of the thirteenth session verified k = 5 steps with 8.5 tokens where
    fixed5 emitted 10.0)."""
    flat = AdaptiveWidth([0.001] * 4, 0.001, gamma=3, decode_cost=0.002)
    stale = {0: np.full(3, 0.9), 1: np.full(3, 0.9), 2: np.full(3, 0.3), 3: np.full(3, 0.3)}
    speculating = {0: True, 1: True, 2: False, 3: False}
    sequences = {b: types.SimpleNamespace(probing=False, pausing=b == 2) for b in stale}
    own = {0: 3, 1: 3, 2: 0, 3: 0}
    assert price_for_the_batch(own, stale, flat, COMPILED, sequences, SpecOptions(pause_steps=4),
                               speculating) == (3, {0: 3, 1: 3, 2: 3, 3: 0})
    assert price_for_the_batch(own, stale, flat, COMPILED, sequences, SpecOptions(pause_steps=4, batch_widths="padded"),
                               speculating) == (3, {0: 3, 1: 3, 2: 0, 3: 0})


def test_a_sequence_says_pausing_while_a_pause_holds_it_not_while_its_breaker_cools_down():
    """`Sequence.pausing` (what lifts a paused row): set by `pause` and on each step the pause holds,
    cleared on the probe after it; a breaker's cooldown is not a pause."""
    params = SamplingParams(max_tokens=8)
    seq = Sequence(0, 4, params, seed=0, gamma=3, eos_token_id=None, tokenizer=None, breaker=None)
    assert seq.speculates() and not seq.pausing
    seq.pause(2)
    assert seq.pausing
    assert [(seq.speculates(), seq.pausing) for _ in range(3)] == [(False, True), (False, True), (True, False)]
    breaker = FallbackBreaker(0.5, min_drafted=1, cooldown=2)
    breaker.record(0, 3)
    cooling = Sequence(1, 4, params, seed=0, gamma=3, eos_token_id=None, tokenizer=None, breaker=breaker)
    assert (cooling.speculates(), cooling.pausing) == (False, False)


def test_a_switch_cost_keeps_the_call_issued_last_unless_another_gains_more():
    """A lone row at confidences 0.9, widths 1 and 3 compiled, S(1) = 2 ms, S(3) = 3.4 ms, decode
    1.1 ms: width 3 brings 3.44 tokens per 3.4 ms (1.01 per ms) against 1.9 per 2 ms (0.95) and 1
    per 1.1 ms (0.91). With free switches width 3 wins from wherever; at 0.5 ms a switch, a step
    issued last at width 1 stays (3.44 / 3.9 = 0.88 per ms), and so does one that decoded last; at
    0.1 ms width 3 pays for the switch (0.98); issued last at 3, or when every call is a switch, 3."""
    costs = AdaptiveWidth([0.001, 0.001, 0.001, 0.0024], 0.001, gamma=3, decode_cost=0.0011)
    compiled = {0: None, 1: None, 3: None}
    price = functools.partial(price_the_step, {0: 3}, {0: np.full(3, 0.9)}, costs, compiled, may_decode=True,
                              lifted={0})
    assert price() == (3, {0: 3})
    assert price(switch=(1, 0.0005)) == (1, {0: 1})
    assert price(switch=(1, 0.0001)) == (3, {0: 3})
    assert price(switch=(3, 0.0005)) == (3, {0: 3})
    assert price(switch=("decode", 0.0005)) == (None, {0: 0})
    assert price(switch=(None, 0.0005)) == (3, {0: 3})


def test_pauses_and_the_decode_price_judge_the_requests_typical_proposals():
    """`Sequence.typical` averages a request's proposals (TYPICAL_WEIGHT on the newest), here (nothing
    seeds it) from its first one read; a pause resets it. One low proposal after high ones
    leaves a drafting request drafting (`judged` hands the pause and the decode call's price the
    average), where its stale proposal alone pauses it; steadily low ones pause it. Mutation caught:
    either judging the stale proposal (a lone request on an H100 paused a third of its steps, 0.92
    of fixed width 5; priced on it, a step decodes and no proposal comes to correct it)."""
    from jdspark.engine.sequence import TYPICAL_WEIGHT
    from jdspark.engine.stats import RowRecord, StepRecord
    from jdspark.engine.widths import choose, judged
    seq = Sequence(0, 4, SamplingParams(max_tokens=64), seed=0, gamma=3, eos_token_id=None, tokenizer=None,
                   breaker=None)
    assert seq.typical is None

    def read(confidence):
        step = StepRecord(3, 0.001, (RowRecord(0, seq.confidence, 3, (1, 2, 3, 4), 3),), 0.0, None, 1)
        seq.record(step, step.rows[0], np.array(confidence, np.float32))

    for _ in range(6):
        read([0.95] * 3)
    read([0.1] * 3)
    np.testing.assert_allclose(seq.typical, TYPICAL_WEIGHT * 0.1 + (1 - TYPICAL_WEIGHT) * 0.95, atol=1e-6)
    policy = AdaptiveWidth([0.0016] * 4, 0.0, gamma=3, decode_cost=0.0009)  # drafting pays above 1.8 tokens
    options, compiled = SpecOptions(pause_steps=32, calibrate=False), dict.fromkeys(range(4))

    def step(with_typical=True):
        stale, typical = judged({0: seq.confidence}, {0: seq}, None, options, True)
        return choose(stale, {0: seq.speculates()}, policy, True, compiled, {0: seq}, options, None,
                      typical=typical if with_typical else None)[0]

    assert step() == 3 and not seq.pausing  # drafts (the width from the stale proposal: flat costs, the widest)
    assert step(with_typical=False) is None and seq.pausing  # the stale proposal alone pauses it
    seq.paused_left, seq.pauses_in_a_row, seq.pausing, seq.typical = 0, 0, False, seq.confidence * 0 + 0.95
    for _ in range(6):
        read([0.1] * 3)
    assert step() is None and seq.pausing and seq.typical is None  # steadily low: paused, the average reset


def test_a_new_requests_first_proposals_are_judged_beside_the_engines_recent_average():
    """A request started at the engine's recent average (`first_confidence="recent"`) has it as its
    typical proposal: one low first proposal moves it TYPICAL_WEIGHT of the way, and drafting still
    pays; steadily low ones pause it. Started without one (ones), its first proposal alone is judged.
    Mutation caught: a new request's average from its first proposal alone (an H100, one request at a
    time: 20 of 32 pauses within a request's first 4 verify steps)."""
    from jdspark.engine.stats import RowRecord, StepRecord
    from jdspark.engine.widths import choose, judged
    policy = AdaptiveWidth([0.0016] * 4, 0.0, gamma=3, decode_cost=0.0009)  # drafting pays above 1.8 tokens
    options, compiled = SpecOptions(pause_steps=32, calibrate=False), dict.fromkeys(range(4))

    def paused_after(proposals, confidence):
        seq = Sequence(0, 4, SamplingParams(max_tokens=64), seed=0, gamma=3, eos_token_id=None, tokenizer=None,
                       breaker=None, confidence=confidence)
        for c in proposals:
            step = StepRecord(3, 0.001, (RowRecord(0, seq.confidence, 3, (1, 2, 3, 4), 3),), 0.0, None, 1)
            seq.record(step, step.rows[0], np.full(3, c, np.float32))
        stale, typical = judged({0: seq.confidence}, {0: seq}, None, options, True)
        choose(stale, {0: seq.speculates()}, policy, True, compiled, {0: seq}, options, None, typical=typical)
        return seq.pausing

    recent = np.full(3, 0.9, np.float32)
    assert not paused_after([], recent) and not paused_after([0.1], recent)
    assert paused_after([0.1] * 6, recent)
    assert paused_after([0.1], None)


def test_drafts_past_a_requests_max_tokens_are_priced_at_nothing():
    """A request of max_tokens 10 with 6 tokens and one call unread (it emits at least one) has room
    for 10 - 6 - 1 - 1 = 2 drafts in its next call: `within_room` zeroes its confidences past them, in
    the stale proposal and in the typical one, so E(k) stops growing at k = 2; a request far from its
    end keeps its own. Mutations caught: no clipping; the unread call not counted (room 3)."""
    from jdspark.engine.widths import within_room
    near, far = (Sequence(i, 4, SamplingParams(max_tokens=m), seed=0, gamma=5, eos_token_id=None, tokenizer=None,
                          breaker=None) for i, m in ((0, 10), (1, 64)))
    near.tokens, far.tokens = [7] * 6, [7] * 6
    near.issued(3)
    assert near.draft_room() == 2 and far.draft_room() == 64 - 6 - 1
    confidences = {0: np.full(5, 0.9, np.float32), 1: np.full(5, 0.9, np.float32)}
    stale, typical = within_room(confidences, {0: np.full(5, 0.7, np.float32), 1: confidences[1]}, {0: near, 1: far})
    np.testing.assert_array_equal(stale[0], np.float32([0.9, 0.9, 0, 0, 0]))
    np.testing.assert_array_equal(typical[0], np.float32([0.7, 0.7, 0, 0, 0]))
    np.testing.assert_array_equal(stale[1], confidences[1])
    assert stale[0].dtype == np.float32
    expected = AdaptiveWidth([0.001] * 6, 0.0, gamma=5).expected_tokens(np.array([stale[0]]))[0]
    np.testing.assert_allclose(expected, [1, 1.9, 2.71, 2.71, 2.71, 2.71], rtol=1e-6)
    far.tokens = []
    assert within_room(confidences, None, {0: far, 1: far}) == (confidences, None)


def test_near_its_end_a_request_is_priced_on_its_room_but_not_paused_for_it():
    """Drafting pays above ~2.5 tokens a step here. A lone request at confidences 0.9 with room for one
    draft: the step decodes (E(k) <= 1.9 whatever the width), yet the request is not paused (a pause
    would count its length, not its acceptance), nor priced as a probe at confidences of 1 (its probe
    could not use them). Far from its end it drafts at width 5. Mutations caught: clipping before the
    pause; no clipping; a probe near its end priced at ones."""
    from jdspark.engine.widths import choose
    policy = AdaptiveWidth([0.0016] * 6, 0.0, gamma=5, decode_cost=0.0007)
    options, compiled = SpecOptions(pause_steps=32, calibrate=False), dict.fromkeys(range(6))

    def step(seq, probing=False):
        seq.probing = probing
        speculating = {0: True}
        return choose({0: seq.confidence}, speculating, policy, True, compiled, {0: seq}, options, None)[0]

    seq = Sequence(0, 4, SamplingParams(max_tokens=64), seed=0, gamma=5, eos_token_id=None, tokenizer=None,
                   breaker=None, confidence=np.full(5, 0.9, np.float32))
    assert step(seq) == 5
    seq.tokens = [7] * 62  # room for 64 - 62 - 0 - 1 = 1 draft
    assert step(seq) is None and not seq.pausing and seq.paused_left == 0
    assert step(seq, probing=True) is None


def test_the_choice_stacks_many_rows_once_and_leaves_few_as_dicts():
    """`judged` hands the choice stacked rows past `calibration.ROWS_ONE_BY_ONE` rows (a dict at fewer:
    stacking costs a lone request more than it saves), with each row's `Sequence.typical` where it has one."""
    from jdspark.engine.widths import judged
    from jdspark.speculative.stacked import StackedRows
    rng, gamma = np.random.default_rng(4), 5
    options = SpecOptions(pause_steps=32, calibrate=False)
    for count, kind in ((3, dict), (6, StackedRows)):
        sequences = {b: Sequence(b, 4, SamplingParams(max_tokens=64), seed=0, gamma=gamma, eos_token_id=None,
                                 tokenizer=None, breaker=None) for b in range(count)}
        sequences[1].typical = np.full(gamma, 0.25, np.float32)
        stale = {b: rng.random(gamma).astype(np.float32) for b in range(count)}
        stale, typical = judged(stale, sequences, None, options, True)
        assert isinstance(stale, kind) and isinstance(typical, kind)
        np.testing.assert_array_equal(typical[1], sequences[1].typical)
        np.testing.assert_array_equal(typical[0], stale[0])  # no average yet: its stale proposal


def test_a_steps_averages_move_as_each_rows_would_alone():
    from jdspark.engine.sequence import TYPICAL_WEIGHT, moved_averages
    rng = np.random.default_rng(5)
    gamma = 5
    before = [None, rng.random(gamma).astype(np.float32), rng.random(gamma).astype(np.float32)]
    proposed = rng.random((3, gamma)).astype(np.float32)
    after = moved_averages(before, proposed)
    assert after.dtype == np.float32
    np.testing.assert_array_equal(after[0], proposed[0])
    for i in (1, 2):
        np.testing.assert_array_equal(after[i], before[i] + TYPICAL_WEIGHT * (proposed[i] - before[i]))


def test_a_paused_request_that_drafted_beside_others_resumes_where_those_proposals_pay():
    """A paused row lifted into other rows' drafting steps proposes on each; after RESUME_PROPOSALS of them
    its pause is judged again on them (its typical, rebuilt since the pause): high ones end it (it drafts
    this step, `pausing` cleared, the back-off reset; not while its breaker cools down), low ones keep it, and
    fewer are not judged. Mutation caught: paused rows never judged again (an H100 at c = 64: four paused
    requests a level decoded alone in the level's tail for 18-19 steps)."""
    from jdspark.engine.sequence import RESUME_PROPOSALS
    from jdspark.engine.stats import RowRecord, StepRecord
    from jdspark.engine.widths import pause_where_drafting_does_not_pay
    policy = AdaptiveWidth([0.0016] * 4, 0.0, gamma=3, decode_cost=0.0009)  # drafting pays above 1.8 tokens

    def paused_after(proposals, confidence, breaker=None):
        seq = Sequence(0, 4, SamplingParams(max_tokens=64), seed=0, gamma=3, eos_token_id=None, tokenizer=None,
                       breaker=breaker)
        seq.pause(32)
        for _ in range(proposals):  # a step drafting for others lifts it: it proposes, and its pause counts down
            assert not seq.speculates() and seq.pausing
            step = StepRecord(3, 0.001, (RowRecord(0, seq.confidence, 3, (1, 2, 3, 4), 3),), 0.0, None, 1)
            seq.record(step, step.rows[0], np.full(3, confidence, np.float32),
                       np.full(3, confidence, np.float32))
        if breaker is not None:  # tripped: cooling down
            breaker.cooldown_left = 8
        speculating = {0: seq.speculates()}
        pause_where_drafting_does_not_pay(policy, {0: seq.typical if seq.typical is not None else seq.confidence},
                                          speculating, {0: seq}, 32)
        return seq, speculating[0]

    seq, drafts = paused_after(RESUME_PROPOSALS, 0.95)
    assert drafts and not seq.pausing and seq.paused_left == 0 and seq.pauses_in_a_row == 0
    seq, drafts = paused_after(RESUME_PROPOSALS, 0.1)
    assert not drafts and seq.pausing and seq.paused_left > 0
    seq, drafts = paused_after(RESUME_PROPOSALS - 1, 0.95)
    assert not drafts and seq.pausing
    seq, drafts = paused_after(RESUME_PROPOSALS, 0.95, FallbackBreaker(0.5))
    assert not drafts and not seq.pausing and seq.breaker.cooldown_left == 7  # one cooldown step spent, as unpaused
