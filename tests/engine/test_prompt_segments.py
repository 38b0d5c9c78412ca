"""Prompt segments (`Engine(prompt_segment=N)`): beside running requests the oldest pending prompt comes
in the verify call, N tokens a call, extended in the same model pass as the verify rows
(`DSV4.extend_segments`) instead of in a prefill call of its own. On one 4-slot engine with buckets 2 and
4 and width 5 (each with and without a segment): the requests emit what they emit alone, in a bucket
whose gather puts the segment's slot among the verify call's padding rows and in the full bucket that
has no gather; nothing compiles after warm-up. (tests/model/test_segments.py tests the model's part.)"""

import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine
from jdspark.engine.options import SpecOptions
from jdspark.engine.executables import Executables
from jdspark.engine.live_costs import LiveCosts
from jdspark.engine.request import SamplingParams
from jdspark.speculative.selector import AdaptiveWidth

pytestmark = pytest.mark.slow  # compiles its own engine

SEGMENT = 8
PROMPTS = [np.array([5, 9, 2, 14, 7], np.int32), np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], np.int32),
           np.arange(2, 16, dtype=np.int32)]
LONG = np.tile(np.arange(2, 12, dtype=np.int32), 3)  # 30 tokens: 4 segments of 8
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)


def own_width(confidence) -> int:
    """Each request its own width, from its own stale confidences (0..5)."""
    return min(5, int(confidence[0] * 6))


@pytest.fixture(scope="module")
def engine(dspark_model):
    """A new request's first width from confidences of ones (not the engine's recent ones), so a sampled
    request's widths, and with them its noise, are those it has alone."""
    return Engine(dspark_model, EngineConfig(max_seq_len=96, gamma=5, max_batch=4, batch_buckets=(2, 4)),
                  prefill_chunk=8, widths=(5,), width_policy=own_width, prompt_segment=SEGMENT,
                  options=SpecOptions(first_confidence="ones"))


@pytest.fixture(scope="module")
def alone(engine):
    """{(prompt index or "long", sampled): tokens} of each request alone (its prompt in prefill calls)."""
    out = {}
    for key, prompt in [*enumerate(PROMPTS), ("long", LONG)]:
        for sampled in (False, True):
            out[key, sampled] = engine.complete([engine.add(prompt, SAMPLED if sampled else GREEDY)])[0].token_ids
    return out


@pytest.fixture
def prefills(engine, monkeypatch):
    """The slots of every prefill call the engine issues meanwhile."""
    calls, issue = [], engine._issue_prefill
    monkeypatch.setattr(engine, "_issue_prefill", lambda live: calls.append(live) or issue(live))
    return calls


def _run(engine, got: dict, steps: int = 80) -> list:
    """Step until nothing runs, the tokens gathered into `got`; the steps' records."""
    with engine.record_steps() as records:
        for _ in range(steps):
            if not engine.running:
                break
            for rid, delta in engine.step().items():
                got.setdefault(rid, []).extend(delta.tokens)
    assert not engine.running
    return records


def test_a_prompt_beside_a_running_request_comes_in_the_verify_calls_segments(engine, alone, prefills,
                                                                               compile_counter, monkeypatch):
    """A 30-token prompt admitted beside a running request: no prefill call, 8 tokens a verify call (its
    slot emptied at the first, its first token drawn after the last with the prefill's keys), the running
    request decoding in every step, each emitting what it emits alone (bucket 2: the segment's slot is
    the verify call's padding row); the target state and the drafter's context of its slot equal in
    length; nothing compiled; the live costs told that exactly the reads of the calls that carried it paid
    for a prompt (overlapped, each is read a step after it is issued). Mutations caught: the segment's
    write before the verify rows' (the padding row's stale state wins), its slot not emptied."""
    engine.complete(engine.add_many([(PROMPTS[0], GREEDY), (PROMPTS[2], GREEDY)]))  # slots 0, 1: old state
    before = compile_counter.count
    running = engine.add(PROMPTS[1], GREEDY)
    got = {running.request_id: list(running.tokens)}
    prefills.clear()
    new = engine.admit([(LONG, SAMPLED)])[0]
    slot = engine.slot_of(new)
    paid, observe = [], engine.live.observe
    monkeypatch.setattr(engine.live, "observe", lambda *a: paid.append(a[5]) or observe(*a))
    with engine.record_steps() as records:
        for step in range(20):
            if new in got:
                break
            deltas = engine.step()
            assert running.request_id in deltas or not step  # it emitted in every step meanwhile (overlapped)
            for rid, delta in deltas.items():
                got.setdefault(rid, []).extend(delta.tokens)
    assert not prefills and len(records) == -(-len(LONG) // SEGMENT)  # the 4 calls that carried it
    assert sum(r.prompt_tokens for r in records) == len(LONG) and {r.bucket for r in records} == {2}
    assert paid == [True] * len(records)
    assert slot == 1  # a slot that held an earlier request's state and drafter context
    assert np.asarray(engine.draft_cache.length)[slot] == np.asarray(engine.state.length)[slot]
    _run(engine, got)
    assert paid[len(records):] and not any(paid[len(records):])
    assert got[running.request_id] == alone[1, False] and got[new] == alone["long", True]
    assert compile_counter.count == before


def test_a_segment_beside_a_full_bucket(engine, alone, prefills):
    """Three running requests and a prompt admitted: it comes in the segments of bucket-4 calls (every
    slot a row, no gather: the segment's slot is one of the verify call's padding rows), no prefill call;
    all four emit what they emit alone."""
    requests = [engine.add(p, GREEDY) for p in PROMPTS]
    got = {d.request_id: list(d.tokens) for d in requests}
    prefills.clear()
    new = engine.admit([(LONG, GREEDY)])[0]
    records = _run(engine, got)
    assert not prefills and 4 in {r.bucket for r in records}
    assert [got[d.request_id] for d in requests] == [alone[i, False] for i in range(3)]
    assert got[new] == alone["long", False]


def test_the_oldest_prompt_comes_in_the_segments_the_others_in_prefill_calls(engine, alone, prefills):
    """Two prompts admitted beside a running request: the oldest in the segments, the other in prefill
    calls (the CPU's budget: a chunk a step); all three emit what they emit alone."""
    running = engine.add(PROMPTS[1], GREEDY)
    got = {running.request_id: list(running.tokens)}
    prefills.clear()
    first, second = engine.admit([(LONG, GREEDY), (PROMPTS[2], SAMPLED)])
    slot = engine.slot_of(second)
    _run(engine, got)
    assert prefills and {b for call in prefills for b in call} == {slot}
    assert got[running.request_id] == alone[1, False]
    assert got[first] == alone["long", False] and got[second] == alone[2, True]


def test_segments_off_the_prompt_takes_prefill_calls(engine, alone, prefills, monkeypatch):
    """`segment_prompts` off (and riding): the executables stay, the prompt comes in prefill calls, whose time
    lies outside the verify windows (reading a prefill restarts the step clock): no window is told it paid
    for a prompt."""
    monkeypatch.setattr(engine, "segment_prompts", False)
    monkeypatch.setattr(engine, "ride_prompts", 0)
    running = engine.add(PROMPTS[1], GREEDY)
    got = {running.request_id: list(running.tokens)}
    prefills.clear()
    new = engine.admit([(LONG, GREEDY)])[0]
    paid, observe = [], engine.live.observe
    monkeypatch.setattr(engine.live, "observe", lambda *a: paid.append(a[5]) or observe(*a))
    records = _run(engine, got)
    assert prefills and not any(r.prompt_tokens for r in records)
    assert paid and not any(paid)
    assert got[running.request_id] == alone[1, False] and got[new] == alone["long", False]


def test_target_only_steps_carry_the_segment_in_their_decode_call(engine, alone, prefills):
    """Speculation off: the decode call with a segment takes the prompt beside a running request (no prefill
    call); both emit what they emit target-only alone (greedy: what they emit speculating, too)."""
    engine.set_policy(speculative=False)
    try:
        reference = engine.complete([engine.add(LONG, SAMPLED)])[0].token_ids
        running = engine.add(PROMPTS[1], GREEDY)
        got = {running.request_id: list(running.tokens)}
        prefills.clear()
        new = engine.admit([(LONG, SAMPLED)])[0]
        records = _run(engine, got)
    finally:
        engine.set_policy(speculative=True)
    assert not prefills and sum(r.prompt_tokens for r in records) == len(LONG)
    assert not any(r.drafted_call for r in records)
    assert got[running.request_id] == alone[1, False] and got[new] == reference


def test_the_segment_executables_are_counted_and_checked(engine, dspark_model):
    """Each bucket's decode and step[5] twice (with a segment and without); a segment needs a second slot
    and gamma + 1 to max_seq_len tokens."""
    assert engine.exe.count == 2 * (1 + 2 * 2)  # per bucket: prefill; decode, step[5], each with a segment
    assert set(engine.exe.largest.with_prompt) == {"decode", 5}
    for config, segment in ((EngineConfig(max_batch=1), 8), (EngineConfig(max_batch=2, gamma=5), 5),
                            (EngineConfig(max_seq_len=16, max_batch=2), 17)):
        with pytest.raises(ValueError, match="prompt_segment="):
            Executables(dspark_model, config, 8, "xla", (5,), False, segment)


def test_a_window_with_a_segment_teaches_the_live_costs_nothing():
    """A verify call with a prompt segment is another executable whose window pays the prompt: it feeds
    neither the verify offset nor the switch cost, and the plain call after it is a switch."""
    live = LiveCosts({1: AdaptiveWidth([0.002] * 6, 0.001, gamma=5, decode_cost=0.0015)})
    live.issued(1, 5)
    live.observe(1, True, 5, 0.004)
    live.issued(1, 5, with_prompt=True)
    live.observe(1, True, 5, 1.0, prompt=True)
    assert live.windows == {1: {"same": 1, "switched": 0}} and live.offsets[1]["verify"] == pytest.approx(0.001)
    live.issued(1, 5)
    live.observe(1, True, 5, 0.004)
    assert live.windows == {1: {"same": 1, "switched": 1}}


def test_a_repeated_call_is_told_apart_by_its_segment():
    """The call a step would repeat (`LiveCosts.switch_price`) is the same width only with the same kind of
    call: a segment call after a segment call, a plain one after a plain one (else every width, the one
    repeated too, would be priced as a switch while a long prompt streams in)."""
    live = LiveCosts({1: AdaptiveWidth([0.002] * 6, 0.001, gamma=5, decode_cost=0.0015)})
    live.issued(1, 5, with_prompt=True)
    assert live.switch_price(1, with_prompt=True)[0] == 5 and live.switch_price(1)[0] is None
    live.issued(1, "decode", with_prompt=True)
    assert live.switch_price(1, with_prompt=True)[0] == "decode"
    live.issued(1, 5)
    assert live.switch_price(1)[0] == 5 and live.switch_price(1, with_prompt=True)[0] is None
