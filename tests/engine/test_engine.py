"""The engine end to end on a tiny target + DSpark drafter (vocabulary 16): greedy token equality at
every width, packed parameters, the draft cache, no compilation after warm-up, clear errors.
Losslessness of sampling is in test_lossless.py."""

import pickle

import jax
import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import calls
from jdspark.engine.engine import Engine, SpecOptions
from jdspark.engine.errors import EngineError, SamplingError
from jdspark.engine.request import SamplingParams
from jdspark.model.model import Model
from tests.conftest import DSPARK_CONFIG, generate_to_end

# The session engine with every width (tests/conftest.py dspark_engine) is compiled for these: minutes on
# a 2-core CPU. `make test-fast` leaves them out; `make test` (CI) runs them.
pytestmark = pytest.mark.slow


CONFIG = DSPARK_CONFIG
PROMPT = np.array([5, 9, 2, 14, 7, 7, 1, 12, 0, 4, 8, 11], np.int32)
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(dspark_model):
    return dspark_model


@pytest.fixture(scope="module")
def engine(dspark_engine):
    return dspark_engine


def run(engine, prompt, params, width=None):
    """Generate one request to the end with a fixed width (None: target-only); its Completion."""
    engine.set_policy(speculative=width is not None, width_policy=lambda confidence: width)
    return generate_to_end(engine, prompt, params)


@pytest.fixture(scope="module")
def greedy_reference(engine):
    return run(engine, PROMPT, GREEDY).token_ids


@pytest.mark.parametrize("width", range(6))
def test_greedy_speculative_equals_target_only(engine, greedy_reference, width):
    slot = run(engine, PROMPT, GREEDY, width)
    assert slot.token_ids == greedy_reference
    assert slot.stats.widths[width] == slot.stats.steps >= 63 // (width + 1)  # token 1 comes from prefill


def test_packed_parameters_decode_what_unpacked_ones_do(model, engine, greedy_reference):
    """Small parameters packed into a few buffers (the GPU's default) and passed one array each (the
    CPU's): the same greedy tokens, target-only and at width 5. The session engine has the
    platform's default; the other layout is built here."""
    leaves = len(jax.tree.leaves(model.params))
    session_packed = len(engine.exe.params.arrays) < leaves
    other = Engine(model, EngineConfig(max_seq_len=96, gamma=5, max_batch=2, batch_buckets=(2,)), prefill_chunk=16,
                   widths=(5,),
                   options=SpecOptions(width=5), pack_params=not session_packed)
    assert (len(other.exe.params.arrays) < leaves) != session_packed
    for width in (None, 5):
        assert run(other, PROMPT, GREEDY, width).token_ids == greedy_reference


def scripted_step(exe, k: int):
    """A test double of step[k]: the drafter's proposal (its q and confidences), but the drafted
    tokens [B, gamma] come in as a fifth argument; verification, commit and the drafter context are
    the engine's own (`Programs.verify`), and the output is packed as step[k]'s."""
    def step(params, full_state, full_cache, slots, tokens):
        model = exe.module(params)
        rows, batch = calls.unpack_slots(slots), full_state.batch
        decode, cache = calls.take_rows(full_state, rows, batch), calls.take_rows(full_cache, rows, batch)
        proposal = exe.propose(model, cache, decode.anchor, rows.sampling)
        verdict, decode, cache, _ = exe.verify(model, decode, cache, rows, tokens[:, :k], proposal.q[:, :k])
        return (calls.pack_output(verdict, tokens, proposal.confidence),
                calls.put_rows(full_state, decode, rows, batch), calls.put_rows(full_cache, cache, rows, batch))
    return jax.jit(step, donate_argnums=(1, 2))


def test_greedy_with_scripted_drafts_exercises_every_accept_length(engine, greedy_reference, monkeypatch):
    """Drafts copied from the reference continuation, corrupted at random positions, verified by
    the engine's verification (`scripted_step`, a test double of step[5]): every accepted-prefix
    length occurs, and the output is still the reference."""
    rng = np.random.default_rng(0)
    scripted = scripted_step(engine.exe, 5)

    def scripted_call(params, decode, cache, slots):
        slot = slots[slots[:, 0] == 1, list(calls.SLOT_FIELDS).index("slot")][0]  # the active row's
        done = int(decode.length[slot]) - len(PROMPT) + 1  # tokens so far (the last: the anchor, not in the state)
        tokens = np.array([greedy_reference[min(done + i, len(greedy_reference) - 1)] for i in range(5)], np.int32)
        bad = rng.integers(0, 7)  # 5 or 6: all correct
        if bad < 5:
            tokens[bad] = (tokens[bad] + 1) % 16
        return scripted(params, decode, cache, slots, np.tile(tokens, (len(slots), 1)))

    monkeypatch.setitem(engine.exe.buckets[2].step, 5, scripted_call)  # the engine's one bucket
    slot = run(engine, PROMPT, GREEDY, 5)
    assert slot.token_ids == greedy_reference
    accepted = np.array(slot.stats.accepted_at)
    assert (accepted > 0).all() and slot.stats.tau > 2.0, slot.stats.as_dict()


def test_draft_cache_holds_exactly_the_committed_positions(engine, model):
    """Mid-generation (accepts and rejections behind it), the drafter's context rows equal those
    recomputed from scratch over the committed tokens."""
    engine.set_policy(speculative=True, width_policy=lambda confidence: 3, overlap=False)  # each step read whole
    first = engine.add(PROMPT, SamplingParams(max_tokens=60, temperature=1.0, seed=5, ignore_eos=True))
    rid, b, tokens = first.request_id, engine.slot_of(first.request_id), list(first.tokens)
    for _ in range(12):
        tokens += engine.step()[rid].tokens
    committed = np.concatenate([PROMPT, tokens[:-1]]).astype(np.int32)  # the last token is the next anchor
    assert int(engine.draft_cache.length[b]) == len(committed) == int(engine.state.length[b])
    features = model.forward(committed[None], CONFIG.dspark.target_layer_ids).features
    fresh = dspark.init_draft_cache(CONFIG, 1, model.dtype)
    fresh = dspark.push_context(model.module(), fresh, features, np.array([len(committed)], np.int32))
    window = CONFIG.sliding_window
    slots_held = np.arange(len(committed) - window, len(committed)) % window
    for got, want in zip(engine.draft_cache.windows, fresh.windows):
        np.testing.assert_allclose(np.asarray(got)[b, slots_held], np.asarray(want)[0, slots_held], atol=1e-5)
    engine.cancel(rid)
    engine.set_policy(overlap=True)


def test_no_compilation_after_warm_up_at_any_mix_of_widths(engine, compile_counter):
    """A 200-token generation at random widths (all of 0..5 used) next to a second request."""
    widths = iter(np.random.default_rng(1).integers(0, 6, 1000))
    run(engine, PROMPT, SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=1), 2)  # warm-up
    before = compile_counter.count
    engine.set_policy(speculative=True, width_policy=lambda confidence: int(next(widths)))
    long, short = engine.complete([
        engine.add(PROMPT, SamplingParams(max_tokens=200, temperature=1.0, seed=2, ignore_eos=True)),
        engine.add(PROMPT[:5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))])
    assert len(long.token_ids) == 200 and len(short.token_ids) == 40
    assert min(long.stats.widths) > 0  # every width was used
    assert compile_counter.count == before


def test_bad_requests_get_clear_errors(engine, model):
    with pytest.raises(EngineError, match="exceeds max_seq_len=256"):
        engine.add(PROMPT, SamplingParams(max_tokens=240))
    with pytest.raises(EngineError, match="token id 16 is outside the vocabulary"):
        engine.add([1, 16], GREEDY)
    with pytest.raises(EngineError, match="speculative=True needs a checkpoint with a DSpark drafter"):
        Engine(Model.random(CONFIG.replace(extra={}, num_nextn_predict_layers=1, compress_ratios=(0, 4, 16, 0))),
               EngineConfig(max_seq_len=32), speculative=True)
    with pytest.raises(SamplingError, match="temperature=-1: must be a number >= 0") as raised:
        SamplingParams(temperature=-1)
    copied = pickle.loads(pickle.dumps(raised.value))  # it crosses processes with its param
    assert (copied.param, str(copied)) == ("temperature", str(raised.value))
    assert engine.running == [] and engine.free_slots == engine.config.max_batch


def test_non_finite_logits_end_the_request_with_an_error(dspark_model):
    """A model whose weights are NaN: the request ends with finish_reason "error" and a message that
    says why, and no token is emitted (the verifier's invalid flag, read by the engine). Mutation
    caught: the engine ignoring the flag and emitting the -1 (or any) token. Same shapes as the
    session's target_engine, so its executables come from the compile cache."""
    poisoned = Model(dspark_model.graphdef, jax.tree.map(
        lambda a: a * np.nan if np.issubdtype(a.dtype, np.floating) else a, dspark_model.params))
    engine = Engine(poisoned, EngineConfig(max_seq_len=64, gamma=5, max_batch=2, batch_buckets=(2,)),
                    prefill_chunk=16, speculative=False)
    delta = engine.add(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    assert delta.final and delta.finish_reason == "error" and "non-finite" in delta.error
    assert delta.tokens == () and delta.completion.token_ids == []
    assert engine.running == [] and engine.free_slots == 2
