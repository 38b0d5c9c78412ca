"""Batch buckets, per-request widths and prefill spread over steps, on one 16-slot engine compiled
for buckets 1, 4 and 16 and widths 2 and 5 (a row's width rounds up to the executable that holds
it): a lone request runs the bucket-1 executables and emits what it emits in a full batch next to
rows of other widths and sampling parameters; a prompt admitted while others run is prefilled a
chunk per step while they keep decoding, and a wave admitted with nothing running in one call of
the largest bucket it fills; nothing compiles after warm-up. A second, target-only engine prefills in
buckets of its own (1 and 4) beside a decode bucket of 4."""

import collections

import jax
import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.engine import costs
from jdspark.engine.engine import Engine
from jdspark.engine.live_costs import LiveCosts
from jdspark.engine.request import SamplingParams

pytestmark = pytest.mark.slow  # compiles its own 16-slot engine

PROMPTS = [np.array([5, 9, 2, 14, 7], np.int32), np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], np.int32),
           np.array([7], np.int32), np.arange(2, 16, dtype=np.int32)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = np.tile(np.arange(2, 12, dtype=np.int32), 4)  # 40 tokens: 5 chunks of 8


def own_width(confidence) -> int:
    """Each request its own width, from its own stale confidences (0..5)."""
    return min(5, int(confidence[0] * 6))


@pytest.fixture(scope="module")
def engine(dspark_model):
    """Prompts ride only where a test turns it on (`ride_prompts`): the others test prefill calls."""
    return Engine(dspark_model, EngineConfig(max_seq_len=96, gamma=5, max_batch=16, batch_buckets=(1, 4, 16)),
                  prefill_chunk=8, widths=(2, 5), width_policy=own_width, ride_prompts=0)


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt's greedy tokens, target-only, one request at a time."""
    engine.set_policy(speculative=False)
    out = [engine.complete([engine.add(p, GREEDY)])[0].token_ids for p in PROMPTS]
    engine.set_policy(speculative=True)
    return out


def test_a_lone_request_runs_the_bucket_1_executables(engine, alone):
    with engine.record_steps() as records:
        got = engine.complete([engine.add(PROMPTS[0], GREEDY)])[0].token_ids
    assert got == alone[0]
    assert {r.bucket for r in records} == {1} and {r.width for r in records} <= {2, 5}


def test_greedy_rows_in_a_full_batch_of_mixed_widths_and_sampling_emit_what_they_emit_alone(engine, alone):
    sampled = [SamplingParams(max_tokens=24, temperature=t, top_k=k, top_p=p, seed=i, ignore_eos=True)
               for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.8)] * 4)]
    requests = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[i % 4], s) for i, s in enumerate(sampled)]
    with engine.record_steps() as records:
        done = engine.complete(engine.add_many(requests))
    assert [c.token_ids for c in done[:4]] == alone
    assert records[0].bucket == 16
    assert any(len({row.width for row in step.rows}) > 1 for step in records)  # rows of different widths


def test_a_new_prompt_is_prefilled_a_chunk_per_step_while_others_decode(engine, alone):
    """... and its first verify runs in the step of its last chunk, so the step that reads its first
    token also reads that verify's tokens (one Delta: 1 + 1..6 tokens). Mutation caught: the
    request verifying only from the step after (a first Delta of one token)."""
    reference = engine.complete([engine.add(LONG, GREEDY)])[0].token_ids
    running = engine.add(PROMPTS[1], GREEDY)
    got = {running.request_id: list(running.tokens)}
    new = engine.admit([(LONG, GREEDY)])[0]
    steps_to_first = 0
    while new not in got and steps_to_first < 20:
        deltas = engine.step()
        assert running.request_id in deltas or not steps_to_first  # it decoded in every step of the prefill
        steps_to_first += 1
        for rid, d in deltas.items():
            got.setdefault(rid, []).extend(d.tokens)
    assert steps_to_first == len(LONG) // 8 + 1  # overlapped: each step reads the calls of the step before
    assert len(got[new]) >= 2
    while engine.running:
        for rid, d in engine.step().items():
            got[rid].extend(d.tokens)
    assert got[running.request_id] == alone[1] and got[new] == reference


def _beside_a_running_request(engine, monkeypatch, ride_prompts: int):
    """Riding on (prompts with at most `ride_prompts` tokens left), the engine's prefill calls recorded, and a
    running greedy request: (the prefill calls' slots, that request, {request id: tokens so far})."""
    monkeypatch.setattr(engine, "ride_prompts", ride_prompts)
    prefills = []
    issue = engine._issue_prefill
    monkeypatch.setattr(engine, "_issue_prefill", lambda live: prefills.append(live) or issue(live))
    running = engine.add(PROMPTS[1], GREEDY)
    return prefills, running, {running.request_id: list(running.tokens)}


def test_a_short_prompt_rides_in_the_verify_calls_while_others_decode(engine, alone, monkeypatch):
    """`ride_prompts`: a prompt admitted beside a running request takes no prefill call of its own but
    rides in the verify calls, the step's width + 1 tokens a call (its slot emptied at the first, its
    first token drawn after the last), and both requests emit what they emit alone. Mutation caught:
    the rows' prompt tokens ignored (the request then starts from an empty state: other tokens), and
    the slot not emptied at the first chunk (it continues the state of the request before it), nor its
    drafter context (its length then differs from the target state's: the tokens cannot show it). A
    sampled request's tokens too: its first is drawn with the prefill's keys (mutation caught: the
    verify's keys)."""
    sampled = [SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True) for seed in (7, 8, 9)]
    sampled_alone = [engine.complete([engine.add(PROMPTS[3], params)])[0].token_ids for params in sampled]
    engine.complete(engine.add_many([(PROMPTS[0], GREEDY), (PROMPTS[2], GREEDY)]))  # slots 0 and 1 hold old state
    prefills, running, got = _beside_a_running_request(engine, monkeypatch, 16)
    new, *others = engine.admit([(PROMPTS[3], GREEDY), *((PROMPTS[3], p) for p in sampled)])  # 14 tokens: they ride
    prefills.clear()
    steps_to_first = 0
    with engine.record_steps() as records:
        while new not in got and steps_to_first < 20:
            deltas = engine.step()
            assert running.request_id in deltas or not steps_to_first  # it decoded in every step meanwhile
            steps_to_first += 1
            for rid, d in deltas.items():
                got.setdefault(rid, []).extend(d.tokens)
    assert not prefills and 3 <= steps_to_first < 20  # no prefill call; 14 tokens, at most 6 a call
    assert sum(r.prompt_tokens for r in records) == 4 * len(PROMPTS[3])  # the steps' records count them
    slots = [engine.slot_of(rid) for rid in (new, *others)]
    assert engine.slot_of(new) in (0, 1)  # a slot that held an earlier request's state and drafter context
    # the target's state and the drafter's context of each rider's slot start together at its first chunk
    np.testing.assert_array_equal(np.asarray(engine.draft_cache.length)[slots], np.asarray(engine.state.length)[slots])
    while engine.running:
        for rid, d in engine.step().items():
            got.setdefault(rid, []).extend(d.tokens)
    assert got[running.request_id] == alone[1] and got[new] == alone[3]
    assert [got[rid] for rid in others] == sampled_alone


def test_a_rider_cancelled_mid_prompt_leaves_its_slot_to_the_next_request(engine, alone, monkeypatch):
    """A riding prompt cancelled after its first chunk (that call still unread: overlapped steps) and a
    sampled request admitted into its slot: the newcomer's first chunk empties the slot again and it
    emits what it emits alone; the running request is untouched. (A new request's first width comes from
    the engine's recent confidences, `ConfidencePrior`: held at ones here, so the newcomer's widths, and
    with them its noise, are those it had alone.)"""
    monkeypatch.setattr(engine.prior, "value", np.ones(engine.config.gamma, np.float32))
    monkeypatch.setattr(engine.prior, "update", lambda confidence: None)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    reference = engine.complete([engine.add(PROMPTS[3], params)])[0].token_ids
    prefills, running, got = _beside_a_running_request(engine, monkeypatch, 16)
    cancelled = engine.admit([(PROMPTS[3], GREEDY)])[0]
    slot = engine.slot_of(cancelled)
    prefills.clear()
    for rid, d in engine.step().items():  # its first chunk rides
        got[rid].extend(d.tokens)
    assert not prefills and 0 < engine._pending[slot].done < len(PROMPTS[3])
    engine.cancel(cancelled)
    new = engine.admit([(PROMPTS[3], params)])[0]
    assert engine.slot_of(new) == slot
    for _ in range(60):
        if not engine.running:
            break
        for rid, d in engine.step().items():
            got.setdefault(rid, []).extend(d.tokens)
    assert cancelled not in got
    assert got[running.request_id] == alone[1] and got[new] == reference


def test_a_prompt_stops_riding_when_the_steps_decode_and_ends_in_prefill_calls(engine, alone, monkeypatch):
    """A prompt that rode in drafting steps goes on in prefill calls once the steps decode (a decode call
    would carry one token of it), from where it stopped: the request emits what it emits alone."""
    reference = engine.complete([engine.add(LONG, GREEDY)])[0].token_ids
    prefills, running, got = _beside_a_running_request(engine, monkeypatch, 64)
    new = engine.admit([(LONG, GREEDY)])[0]
    prefills.clear()
    for rid, d in engine.step().items():  # the new prompt rides (the running request drafts)
        got[rid].extend(d.tokens)
    begun = engine._pending[engine.slot_of(new)].done
    engine.set_policy(speculative=False)
    try:
        while engine.running:
            for rid, d in engine.step().items():
                got.setdefault(rid, []).extend(d.tokens)
    finally:
        engine.set_policy(speculative=True)
    assert 0 < begun < len(LONG) and prefills  # it rode a chunk, then prefill calls took the rest
    assert got[running.request_id] == alone[1] and got[new] == reference


def test_the_default_prefill_budget_is_every_pending_prompt_on_a_gpu_and_one_chunk_on_the_cpu(engine):
    """Beside running requests a GPU prefills every pending prompt in one call (its rows share the
    weights' reads), the CPU one chunk a step (a call costs by its rows: steps stay even)."""
    assert engine.prefill_rows == (engine.config.max_batch if jax.default_backend() == "gpu" else 1)


@pytest.mark.parametrize("budget_rows,waves", [(None, [5]), (1, [1, 4])], ids=["every_prompt", "one_chunk"])
def test_a_wave_admitted_with_nothing_running_is_prefilled_in_the_largest_bucket_it_fills(engine, alone,
                                                                                          budget_rows, waves):
    """Five one-chunk prompts admitted to an idle engine. Under a budget of every pending prompt (a
    GPU's default) one call prefills all five. Under a budget of one chunk (the CPU's) the first step
    prefills four of them in one bucket-4 call (no padded row, and no running request waits on it),
    the fifth goes a step later beside their first verify. Each emits what it emits alone. Mutation
    caught: one prompt a step with nothing running (five first tokens in five steps)."""
    default = engine.prefill_rows
    engine.prefill_rows = budget_rows or engine.config.max_batch
    try:
        short = [0, 2, 0, 2, 0]
        ids = engine.admit([(PROMPTS[i], GREEDY) for i in short])
        first_step, tokens, step = {}, {rid: [] for rid in ids}, 0
        while engine.running:
            step += 1
            for rid, d in engine.step().items():
                first_step.setdefault(rid, step)
                tokens[rid].extend(d.tokens)
    finally:
        engine.prefill_rows = default
    assert sorted(collections.Counter(first_step.values()).values()) == waves
    assert [tokens[rid] for rid in ids] == [alone[i] for i in short]


class StubArrivals:
    """`batch.Arrivals` with a set gap, keeping the times it is told."""

    def __init__(self, gap):
        self.times, self._gap = [], gap

    def admitted(self, when):
        self.times.append(when)

    def gap(self):
        return self._gap


@pytest.mark.parametrize("batch_prefills, gap, rows", [(True, None, 16), (False, None, 16), (True, 1e4, 16),
                                                        (True, None, 1)],
                         ids=["held_back", "at_once", "prompts_seldom", "one_prompt_a_call"])
def test_a_new_prompt_waits_for_the_running_one_where_its_prefill_call_costs_more(engine, alone, batch_prefills, gap,
                                                                                  rows):
    """A prefill priced at 1000 s a call (`LiveCosts.prefill_s`), a budget of 16 prompts a call (the
    GPU's default): beside a running request the new prompt's call is held back until nothing runs
    (`batch.prefill_waits`), so its first token comes in the step after the running request's last;
    with `batch_prefills` off, where prompts come 1e4 s apart (`Engine.arrivals`: a wait would not
    pay), or with a budget of one prompt a call (the CPU's default: none could share it), it comes
    within two steps. All emit what they emit alone, and each admission is one arrival. Target-only,
    so that the running request issues a call on every step but its last (a speculating one skips a
    step where its unread drafts could reach max_tokens, and nothing runs in that step)."""
    live, engine.live = engine.live, LiveCosts({}, prefill_s={n: 1000.0 for n in (1, 4, 16)})
    arrivals, engine.arrivals = engine.arrivals, StubArrivals(gap)
    budget, engine.prefill_rows = engine.prefill_rows, rows
    engine.batch_prefills = batch_prefills
    engine.set_policy(speculative=False)
    try:
        running = engine.add(PROMPTS[1], GREEDY)
        got, first_step, last_step, step = {running.request_id: list(running.tokens)}, {}, {}, 0
        new = engine.admit([(PROMPTS[0], GREEDY)])[0]
        while engine.running:
            step += 1
            for rid, d in engine.step().items():
                got.setdefault(rid, []).extend(d.tokens)
                first_step.setdefault(rid, step)
                last_step[rid] = step
    finally:
        stub, engine.live, engine.arrivals, engine.batch_prefills = engine.arrivals, live, arrivals, True
        engine.prefill_rows = budget
        engine.set_policy(speculative=True)
    held = batch_prefills and gap is None and rows > 1
    assert (first_step[new] > last_step[running.request_id]) == held
    assert held or first_step[new] <= 2
    assert got[running.request_id] == alone[1] and got[new] == alone[0]
    assert len(stub.times) == 2  # the `add` and the `admit`


def test_no_compilation_after_warm_up_as_requests_join_and_leave(engine, alone, compile_counter):
    """13 requests, then fewer and fewer: steps in buckets 16, 4 and 1, the 12 admitted prompts
    prefilled together (a chunk of each per bucket-16 call) beside the first one's steps."""
    assert all(bucket.prefill is not None for bucket in engine.exe.buckets.values())
    assert engine.exe.count == 3 + 3 * 3  # 3 prefills; decode, step[2], step[5] per bucket
    before = compile_counter.count
    first = engine.add(PROMPTS[3], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))
    engine.admit([(p, SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True))
                  for i, p in enumerate(PROMPTS * 3)])
    engine.set_policy(speculative=False)
    for _ in range(3):
        engine.step()
    engine.set_policy(speculative=True)
    with engine.record_steps() as records:
        while engine.running:
            engine.step()
    assert first.request_id not in engine.running
    assert {r.bucket for r in records} >= {4, 1}
    assert compile_counter.count == before


def test_an_uncompiled_width_costs_what_the_executable_it_runs_in_costs(engine):
    """Widths 2 and 5 compiled: widths 0..2 run in step[2], 3..5 in step[5], and the selector's
    cost curve says so."""
    selector = costs.measured_selector(engine, 1)
    step = [v + selector.draft_cost for v in selector.verify_costs]
    assert len(step) == 6 and step[0] == step[1] == step[2] and step[3] == step[4] == step[5]


@pytest.fixture(scope="module")
def small_prefills(dspark_model):
    """Target-only, 4 slots: decode in a bucket of 4 only, prefill in buckets of 1 and 4."""
    config = EngineConfig(max_seq_len=96, gamma=5, max_batch=4, batch_buckets=(4,), prefill_batch_buckets=(1, 4))
    return Engine(dspark_model, config, prefill_chunk=8, speculative=False)


def test_prefill_buckets_of_their_own(small_prefills, alone, compile_counter):
    """A prefill bucket needs no decode bucket of its size (one program, not a full set): the prompt
    added alone and the one admitted beside it running are prefilled by the bucket-1 prefill (one
    row of dense work, not four), the requests decode in bucket 4 and emit what they emit alone;
    nothing compiles; the bucket's profile has its prefill alone. The held-back rule prices the
    bucket-1 prefill (cheap here: the new prompt starts while the other runs), not bucket 4's (priced
    dear). Mutations caught: prefilling in the decode buckets, pricing by them (the prompt held back
    until nothing runs)."""
    engine, exe = small_prefills, small_prefills.exe
    assert exe.count == 3 and exe.buckets[1].decode is None and not exe.buckets[1].step
    calls = collections.Counter()
    for n, bucket in exe.buckets.items():
        bucket.prefill = lambda *a, _program=bucket.prefill, _n=n: (calls.update([_n]), _program(*a))[1]
    before, live = compile_counter.count, engine.live
    engine.live = LiveCosts({}, prefill_s={1: 1e-9, 4: 1000.0})
    try:
        running = engine.add(PROMPTS[1], GREEDY)  # 10 tokens: two chunks of 8
        got, first_step, step = {running.request_id: list(running.tokens)}, {}, 0
        new = engine.admit([(PROMPTS[0], GREEDY)])[0]
        with engine.record_steps() as records:
            while engine.running:
                step += 1
                for rid, d in engine.step().items():
                    got.setdefault(rid, []).extend(d.tokens)
                    first_step.setdefault(rid, step)
    finally:
        engine.live = live
    assert first_step[new] <= 2
    assert calls == {1: 3}
    assert {r.bucket for r in records} == {4}
    assert got[running.request_id] == alone[1] and got[new] == alone[0]
    assert compile_counter.count == before
    assert set(costs.measure_bucket(engine, 1)) == {"prefill"}
