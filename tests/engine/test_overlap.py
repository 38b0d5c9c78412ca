"""Overlapped steps (`Engine(overlap=True)`, the default): a step issues its calls, then reads the
previous step's, so the device computes while the host reads, emits and chooses."""

import numpy as np
import pytest

from jdspark.engine.request import SamplingParams

PROMPT = np.array([5, 9, 2, 14, 7, 7, 1, 12, 0, 4, 8, 11], np.int32)
OTHER = np.array([3, 3, 8, 1, 13, 6], np.int32)
LONG = np.array([(7 * i + 3) % 16 for i in range(40)], np.int32)  # three prefill chunks of 16


def greedy(max_tokens, **more):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **more)


@pytest.fixture
def engine(dspark_engine):
    """The shared engine at a fixed width (the same widths with and without overlap), restored."""
    saved = dspark_engine.policy()
    dspark_engine.set_policy(speculative=True, width_policy=lambda confidence: 5, overlap=True)
    yield dspark_engine
    dspark_engine.set_policy(**saved)


def together(engine, requests, overlap: bool) -> list[list[int]]:
    """The second request admitted while the first runs; each one's tokens."""
    engine.set_policy(overlap=overlap)
    first = engine.add(*requests[0])
    engine.step()
    second = engine.add(*requests[1])
    done = engine.complete([first, second])
    engine.set_policy(overlap=True)
    return [c.token_ids for c in done]


def test_an_overlapped_engine_emits_the_tokens_of_a_step_by_step_one(engine):
    """Greedy and seeded sampled requests sharing steps: the same tokens whether each step reads its
    own call or the one before (a request's noise counts its own calls, the anchor comes from the
    state). Mutation caught: the noise counter taken from the reads (two calls in flight draw the
    same noise)."""
    requests = [(PROMPT, SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)),
                (OTHER, greedy(25))]
    assert together(engine, requests, overlap=True) == together(engine, requests, overlap=False)


def tracked(engine, params, overlap: bool) -> tuple[list[int], int]:
    """(tokens, the longest its slot's state grew) of one request, prefilled by the steps."""
    engine.set_policy(overlap=overlap)
    [rid] = engine.admit([(PROMPT, params)])
    slot, tokens, longest = engine.slot_of(rid), [], 0
    while rid in engine.running:
        delta = engine.step().get(rid)
        tokens += delta.tokens if delta else ()
        longest = max(longest, int(engine.state.length[slot]))
    engine.set_policy(overlap=True)
    return tokens, longest


def test_requests_that_end_while_their_next_call_runs(engine):
    """A stop token ends a request in the step read while its next call already runs: it emits what a
    step-by-step engine emits, and a new request takes its slot at once and decodes as alone. Near
    max_tokens a request waits for its reads (`Sequence.may_issue`), so it runs exactly the calls a
    step-by-step engine runs: its state grows as far, never past what `room` reserved. Mutations
    caught: may_issue always true (a call past max_tokens); the unread first token left out of it
    (a verify issued for a request whose prefill already gave its one token)."""
    reference = tracked(engine, greedy(40), overlap=False)[0]
    stop = reference[9]
    ended = engine.complete([engine.add(PROMPT, greedy(40, stop_token_ids=(stop,)))])[0]
    assert ended.token_ids == reference[:reference.index(stop) + 1] and ended.finish_reason == "stop"
    assert engine.complete([engine.add(PROMPT, greedy(40))])[0].token_ids == reference
    for max_tokens in (1, 2, 7, 13, 40):
        tokens, longest = tracked(engine, greedy(max_tokens), overlap=True)
        assert tokens == reference[:max_tokens]
        assert longest == tracked(engine, greedy(max_tokens), overlap=False)[1], max_tokens


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prompt_mid_prefill_is_not_written_by_another_requests_prefill(engine, overlap):
    """`add` while an admitted prompt is one chunk in: add's prefill call pads with that prompt's
    slot, which must stay empty there; the prompt then decodes as alone. Mutation caught (found by
    review, older than overlap): padding rows given their pending prompt's next chunk without
    advancing it (the chunk written twice)."""
    engine.set_policy(overlap=overlap)
    reference = engine.complete([engine.add(LONG, greedy(20))])[0].token_ids
    [rid] = engine.admit([(LONG, greedy(20))])
    assert rid not in engine.step()  # its first chunk issued
    first = engine.add(PROMPT, greedy(5))
    got = {first.request_id: list(first.tokens)}
    while engine.running:
        for r, d in engine.step().items():
            got.setdefault(r, []).extend(d.tokens)
    engine.set_policy(overlap=True)
    assert got[rid] == reference
