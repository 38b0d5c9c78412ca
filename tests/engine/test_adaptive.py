"""Adaptive widths in the engine: injected costs steer the choice, exactness holds, a new request's
stale confidences start at ones or at the recent average, the breaker turns speculation off and on,
and the engine reports."""

import dataclasses
import logging

import numpy as np
import pytest

from jdspark.engine.engine import SpecOptions
from jdspark.engine.errors import EngineError
from jdspark.engine.request import SamplingParams
from jdspark.speculative.calibration import Calibration
from jdspark.speculative.selector import AdaptiveWidth
from tests.conftest import generate_to_end

# The session engine with every width (tests/conftest.py dspark_engine) is compiled for these: minutes on
# a 2-core CPU. `make test-fast` leaves them out; `make test` (CI) runs them.
pytestmark = pytest.mark.slow


PROMPT = [5, 9, 2, 14, 7, 7, 1, 12, 0, 4, 8, 11]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(dspark_engine):
    """The shared engine, restored to its defaults afterwards; each step reads its own call (no
    overlap), since these tests follow the width choice step by step."""
    saved = dspark_engine.policy()
    dspark_engine.set_policy(overlap=False)
    yield dspark_engine
    dspark_engine.set_policy(**saved)


def generate(engine, params=GREEDY, prompt=PROMPT):
    return generate_to_end(engine, prompt, params)


def generate_recorded(engine, policy, pause_steps=4):
    """(the target-only tokens, the Completion under `policy` with pauses of `pause_steps`, its steps)."""
    engine.set_policy(speculative=False)
    reference = generate(engine).token_ids
    engine.set_policy(speculative=True, width_policy=policy)
    engine.set_policy(options=SpecOptions(pause_steps=pause_steps, first_confidence="ones"))
    with engine.record_steps() as records:
        slot = generate(engine)
    return reference, slot, records


def join_after_three_steps(engine, policy, options=SpecOptions(first_confidence="ones")):
    """A request alone for three steps, then a second one beside it, both under `policy` and
    `options`; checks both get their target-only tokens. (their Completions, the step records)"""
    second, second_params = [3, 8, 8, 2, 13, 6], dataclasses.replace(GREEDY, max_tokens=20)
    engine.set_policy(speculative=False)
    references = [generate(engine).token_ids, generate(engine, second_params, second).token_ids]
    engine.set_policy(speculative=True, width_policy=policy)
    engine.set_policy(options=options)
    with engine.record_steps() as records:
        first = engine.add(PROMPT, GREEDY)
        for _ in range(3):
            engine.step()
        completions = engine.complete([first, engine.add(second, second_params)])
    assert [c.token_ids for c in completions] == references
    assert records and all(0.0 <= r.waited_s <= r.seconds and isinstance(r.ready, bool) for r in records)
    return completions, records


def test_startup_profile_measures_every_width_and_the_draft(engine):
    """The selector's D and V(k) come from the start-up measurement as S(k) = D + V(k) with
    D = S(0) - decode. The sign of D on a loaded 2-core CPU is noise, so the derivation is checked
    against the measurement (cached, so the same numbers), not a wall-time threshold."""
    measured = engine.measure_call_costs()
    costs, draft = engine.selector.verify_costs, engine.selector.draft_cost
    assert costs.shape == (6,) and (costs > 0).all()  # as measured: not forced non-decreasing
    assert draft == max(measured["step0"] - measured["decode"], 0.0)
    for k in range(6):
        assert costs[k] == pytest.approx(max(measured[f"step{k}"] - draft, 1e-6))
    # the prefill call is profiled too: what holding a prefill back weighs (`batch.prefill_waits`)
    assert measured["prefill"] > 0 and engine.live.prefill_s[max(engine.config.buckets)] == measured["prefill"]


def test_the_profile_runs_each_row_from_tokens_of_its_own(engine, monkeypatch, tmp_path):
    """Rows that start from one token route alike, so a MoE call of them reads one row's experts, not a
    batch's (the 8-layer Flash-dims model, 16 rows: a k = 5 verify profiled at 17.6 ms, served steps of
    8 distinct prompts took 21.9). Each profiled call's fresh rows start from anchors of their own and
    prefill prompts of their own. Mutation caught: the zeros the profile had started every row from."""
    from jdspark.engine import costs
    n, bucket, seen = 2, engine.exe.buckets[2], []

    def spy(program, prompts=False):
        def call(params, state, draft_cache, *inputs):
            fresh = np.asarray(state.length) == 0
            seen.append(np.asarray(inputs[0]) if prompts else np.asarray(state.anchor)[:n][fresh[:n]])
            return program(params, state, draft_cache, *inputs)
        return call

    monkeypatch.setattr(bucket, "decode", spy(bucket.decode))
    monkeypatch.setattr(bucket, "prefill", spy(bucket.prefill, prompts=True))
    monkeypatch.setitem(bucket.step, 5, spy(bucket.step[5]))
    monkeypatch.setattr(costs, "WARM_S", 0.0)
    monkeypatch.setattr(engine, "options", dataclasses.replace(engine.options, profile_runs=1,
                                                               cost_cache_dir=str(tmp_path)))
    costs.measure_bucket(engine, n)
    starts = [rows for rows in seen if rows.ndim == 1 and len(rows) == n]
    prompts = [rows for rows in seen if rows.ndim == 2]
    assert starts and prompts
    assert all(len(set(rows.tolist())) == n for rows in starts)
    assert all(len({tuple(row) for row in rows.tolist()}) == len(rows) for rows in prompts)


def test_expensive_wide_widths_make_the_engine_choose_narrow_ones(engine):
    engine.set_policy(speculative=False)
    reference = generate(engine).token_ids
    engine.set_policy(speculative=True,
                      width_policy=AdaptiveWidth([0.010, 0.011, 5.0, 5.0, 5.0, 5.0], 0.002, gamma=5))
    slot = generate(engine)
    assert slot.token_ids == reference
    widths = slot.stats.widths
    assert sum(widths[2:]) == 0 and widths[0] + widths[1] == slot.stats.steps > 0
    assert slot.stats.draft_cost_s == 0.002
    assert slot.stats.verify_costs_s[2] == 5.0


def test_where_drafting_does_not_pay_the_engine_decodes_and_probes(engine):
    """S(k) = 21.5 ms for every width, decode 4 ms: drafting pays only on confidences of 1 (E(5) = 6
    tokens per 21.5 ms, 1.12x of 1 per 4 ms: past `selector.DRAFT_MARGIN`). The new request drafts once, then decodes without
    drafting, drafts once after each pause to refresh its confidences, each pause twice the one
    before (4, 8, ... steps), and emits the target-only tokens. Mutation caught: no pause (every step
    drafts), a pause that never ends, no backoff, or a probe judged on the stale confidences that
    paused it (it would never draft again)."""
    policy = AdaptiveWidth([0.0115] * 6, 0.010, gamma=5, decode_cost=0.004)
    reference, slot, records = generate_recorded(engine, policy)
    assert slot.token_ids == reference
    drafted = [r.drafted_call for r in records]
    assert drafted[:17] == [True] + [False] * 5 + [True] + [False] * 9 + [True]
    assert slot.stats.pauses == drafted.count(True) - drafted[-1] >= 3
    engine.set_policy(options=SpecOptions(pause_steps=0))  # off: every step drafts
    with engine.record_steps() as records:
        assert generate(engine).token_ids == reference
    assert all(r.drafted_call for r in records)


def test_a_probe_that_could_not_pay_even_on_perfect_confidences_waits(engine):
    """D = V = 10 ms, decode 1 ms: not even confidences of 1 make a draft pay (6 tokens per 20 ms),
    so no step drafts, probes included. Mutation caught: probes that draft whatever the cost."""
    policy = AdaptiveWidth([0.010] * 6, 0.010, gamma=5, decode_cost=0.001)
    reference, slot, records = generate_recorded(engine, policy)
    assert slot.token_ids == reference
    assert not any(r.drafted_call for r in records) and slot.stats.pauses >= 1


def test_one_call_runs_every_row_so_the_step_is_priced_for_the_batch(engine):
    """S(k) = 21.5 ms for every width, decode 4 ms: a lone new request (confidences 1, E(5) = 6)
    drafts, 6 tokens per 21.5 ms beating 1 per 4 ms by more than `selector.DRAFT_MARGIN`, and any
    request with real confidences pauses. Next to a paused request a new one would still draft on its
    own terms, but the call would cost both rows 21.5 ms for 1 + 6 tokens against 2 tokens per 4 ms:
    the step decodes. Mutation
    caught: pricing rows one by one (the new request's steps draft). Tokens are the target-only ones."""
    policy = AdaptiveWidth([0.0115] * 6, 0.010, gamma=5, decode_cost=0.004)
    completions, records = join_after_three_steps(engine, policy, SpecOptions(pause_steps=64, first_confidence="ones"))
    assert records[0].drafted_call and not any(r.drafted_call for r in records[1:3])  # alone, then paused
    together = [r for r in records if len(r.rows) == 2]
    assert together and not any(r.drafted_call for r in together)
    assert completions[1].stats.pauses == 0  # declined by the step's price, not paused


def test_per_request_rows_verify_the_step_width_under_adaptive_widths(engine):
    """S(k) = 20, 20, 40, 40, 40, 40 ms: a request with real confidences chooses width 1 on its
    own, and a new one (confidences of 1) width 5. The executable is padded, so when the new one
    joins, the step's width is priced for both (5: more tokens per second than 1) and both verify
    it. Mutation caught: rows kept at their own widths in a padded step. Tokens: target-only."""
    policy = AdaptiveWidth([0.010, 0.010, 0.030, 0.030, 0.030, 0.030], 0.010, gamma=5)
    _, records = join_after_three_steps(engine, policy)
    joined = next(r for r in records if len(r.rows) == 2)
    assert [policy(row.stale_confidence) for row in joined.rows] == [1, 5]
    assert [row.width for row in joined.rows] == [5, 5]


def test_a_new_request_starts_at_ones_or_at_the_recent_confidences(engine):
    """"ones": each request's first choice sees confidences of 1 (it inherits nothing); "recent" (the
    default): it sees the engine's running average of the proposals so far. Within a request, step t
    sees step t-1's confidences. Mutation caught: a request that inherits the last one's confidences,
    or a prior that never moves from ones."""
    seen = []
    engine.set_policy(speculative=True, options=SpecOptions(first_confidence="ones"))
    engine.set_policy(width_policy=lambda confidence: seen.append(np.array(confidence)) or 3)
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    first = generate(engine, params[0])
    first_calls = len(seen)
    generate(engine, params[1])
    assert first_calls == first.stats.steps
    np.testing.assert_array_equal(seen[0], np.ones(5))
    np.testing.assert_array_equal(seen[first_calls], np.ones(5))  # the second request inherits nothing
    assert not np.allclose(seen[1], 1.0)  # within a request, step t sees step t-1's confidences
    assert not np.allclose(seen[first_calls + 1], 1.0)
    engine.set_policy(options=SpecOptions(first_confidence="recent"))
    prior, before = engine.prior.value.copy(), len(seen)
    generate(engine, params[2])
    np.testing.assert_array_equal(seen[before], prior)
    assert not np.allclose(prior, 1.0) and np.all((prior > 0) & (prior <= 1))
    assert not np.array_equal(engine.prior.value, prior)  # the third request's steps moved it


class SpyCalibration(Calibration):
    """The engine's calibration, recording what the width choice asked it and what it was taught."""

    def __init__(self, gamma):
        super().__init__(gamma)
        self.asked, self.taught = [], []

    def apply(self, stale, greedy):
        self.asked += [greedy[b] for b in stale]
        return super().apply(stale, greedy)

    def observe(self, rows, greedy):
        rows = list(rows)
        self.taught += [(row.width, g) for row, g in zip(rows, greedy)]
        super().observe(rows, greedy)


def test_the_selector_reads_calibrated_confidences_and_verified_rows_teach_them(engine):
    """Under the measured selector every step's choice reads each row's stale confidences through
    the engine's calibration (a greedy request as greedy) and every verified row is handed to it;
    with `calibrate=False`, or a policy of the caller's, the choice reads them as stated."""
    saved, spy = engine.calibration, SpyCalibration(engine.config.gamma)
    engine.calibration = spy
    try:
        engine.set_policy(speculative=True, width_policy=engine.selector, options=SpecOptions(pause_steps=0))
        with engine.record_steps() as records:
            generate(engine)
        verified = [row.width for r in records if r.drafted_call for row in r.rows]
        assert len(spy.asked) == len(records) > 0 and all(spy.asked)
        assert [w for w, _ in spy.taught] == verified and all(g for _, g in spy.taught)
        for options, policy in ((SpecOptions(pause_steps=0, calibrate=False), engine.selector),
                                (SpecOptions(pause_steps=0), AdaptiveWidth([0.01] * 6, 0.001, gamma=5))):
            engine.set_policy(width_policy=policy, options=options)
            asked = len(spy.asked)
            generate(engine)
            assert len(spy.asked) == asked
    finally:
        engine.calibration = saved


def test_the_confidence_prior_is_a_running_average_of_the_proposals():
    from jdspark.engine.sequence import ConfidencePrior
    prior = ConfidencePrior(gamma=2, weight=0.5)
    np.testing.assert_array_equal(prior.value, [1.0, 1.0])
    prior.update(np.array([[0.2, 0.4], [0.6, 0.0]], np.float32))  # mean [0.4, 0.2]
    np.testing.assert_allclose(prior.value, [0.7, 0.6])
    prior.update(np.array([[0.4, 0.2]], np.float32))
    np.testing.assert_allclose(prior.value, [0.55, 0.4])


def test_fallback_breaker_switches_to_target_only_and_back(engine):
    engine.set_policy(speculative=False)
    reference = generate(engine).token_ids
    engine.set_policy(speculative=True, width_policy=lambda confidence: 5)
    engine.set_policy(options=SpecOptions(fallback_threshold=0.9, fallback_min_drafted=10, fallback_cooldown=4))
    slot = generate(engine)
    assert slot.token_ids == reference
    assert slot.stats.fallback_trips >= 1 and slot.stats.widths[0] >= 4  # cooled down without drafting
    assert slot.stats.widths[5] >= 3  # and speculated again afterwards


def test_engine_logs_throughput_acceptance_widths_and_costs(engine, caplog):
    engine.set_policy(speculative=True, width_policy=engine.selector)
    engine.set_policy(options=SpecOptions(log_every=4))
    with caplog.at_level(logging.INFO, logger="jdspark.engine"):
        generate(engine, SamplingParams(max_tokens=30, temperature=1.0, seed=4, ignore_eos=True))
    lines = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]
    assert lines and all("acceptance" in line and "widths {" in line and "V=[" in line for line in lines)


def test_a_new_profile_measures_the_selectors_again_once(engine, tmp_path):
    """`SpecOptions.profile`: the selectors measured under the other profile ("synchronised": one call at
    a time, against the default "queued") replace the first ones, the adaptive policy follows them,
    switching back restores the first set without measuring, and a switch while a request runs is
    refused."""
    engine.set_policy(width_policy=engine.selector)  # the adaptive policy (another module's test may have left another)
    options, first = engine.options, engine.selector
    assert engine.width_policy is first and options.profile == "queued"
    engine.set_policy(options=dataclasses.replace(options, profile="synchronised", profile_runs=1, reprofile=True,
                                                  cost_cache_dir=str(tmp_path)))
    other = engine.selector
    assert other is not first and engine.width_policy is other and engine.selectors[max(engine.selectors)] is other
    assert np.all(np.isfinite(other.step_costs)) and other.decode_cost > 0
    assert len(list(tmp_path.glob("*.json"))) == len(engine.config.buckets)  # measured, under their own keys
    assert generate(engine).token_ids  # serves under the new selectors
    engine.set_policy(options=options)
    assert engine.selector is first and engine.width_policy is first  # kept, not measured again
    rid = engine.add(PROMPT, GREEDY).request_id
    with pytest.raises(EngineError, match="profile=.synchronised.: requests are running"):
        engine.set_policy(options=dataclasses.replace(options, profile="synchronised"))
    engine.cancel(rid)
    assert engine.options is options


def test_a_switch_cost_keeps_the_step_on_the_executable_issued_last(engine, monkeypatch):
    """Under the measured selector, with V(k) rising in k so that the choice follows the stale
    confidences, a lone request's steps change executables; with issuing another executable than
    the last priced at 1 s (`LiveCosts.switch_price`), every step repeats the first step's call.
    The call to stay on is the one the price names: told width 1 was issued last, every step verifies
    width 1; told nothing was (every call pays), the widest, until the request's last steps, where
    fewer drafts fit before max_tokens (`widths.within_room`). With `price_switches=False` the choice
    never asks for the price. (Confidences as stated: the calibration earlier tests taught would
    move them.)"""
    rising = AdaptiveWidth([0.010 + 0.004 * k for k in range(6)], 0.002, gamma=5, decode_cost=0.011)
    monkeypatch.setattr(engine.live, "policy", lambda bucket: rising)
    last, asked = engine.live.switch_price, []

    def calls_made(cost, options=SpecOptions(pause_steps=0, calibrate=False),
                   stay=lambda bucket, with_prompt=False: last(bucket, with_prompt)[0]):
        def switch_price(bucket, with_prompt=False):
            asked.append(bucket)
            return stay(bucket, with_prompt), cost
        monkeypatch.setattr(engine.live, "switch_price", switch_price)
        engine.set_policy(speculative=True, width_policy=engine.selector, options=options)
        with engine.record_steps() as records:
            generate(engine)
        return [(r.drafted_call, r.width) for r in records]

    assert len(set(calls_made(0.0))) > 1  # free switches: the calls follow the confidences
    assert len(set(calls_made(1.0))) == 1
    assert set(calls_made(1.0, stay=lambda *_: 1)) == {(True, 1)}
    paying = calls_made(1.0, stay=lambda *_: None)  # every call pays: the widest wins until the room left
    assert paying[0] == (True, 5) and paying == sorted(paying, key=lambda call: -call[1])  # narrows it at the end
    asked.clear()
    calls_made(1.0, SpecOptions(pause_steps=0, calibrate=False, price_switches=False))
    assert asked == []
