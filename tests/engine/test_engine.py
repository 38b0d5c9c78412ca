"""The engine end to end on a tiny target + DSpark drafter (vocabulary 16, so distributions can be
checked exactly): greedy token equality at every width, losslessness of sampling, the draft cache,
and no compilation after warm-up."""

import jax
import numpy as np
import pytest
from scipy import stats

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import executables
from jdspark.engine.engine import Engine, EngineError, SpecOptions
from jdspark.engine.request import SamplingParams
from jdspark.model.model import Model
from jdspark.spec.selector import AdaptiveWidth
from jdspark.spec.sampling import warp_probs
from tests.conftest import SPEC_CONFIG, generate_to_end
from tests.spec.test_verify import biased_rejection_sample

CONFIG = SPEC_CONFIG
PROMPT = np.array([5, 9, 2, 14, 7, 7, 1, 12, 0, 4, 8, 11], np.int32)
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(spec_model):
    return spec_model


@pytest.fixture(scope="module")
def engine(spec_engine):
    return spec_engine


def run(engine, prompt, params, width=None):
    """Generate one request to the end with a fixed width (None: target-only); returns its slot."""
    engine.speculative = width is not None
    engine.width_policy = lambda confidence: width
    return generate_to_end(engine, prompt, params)


@pytest.fixture(scope="module")
def greedy_reference(engine):
    return run(engine, PROMPT, GREEDY).tokens


@pytest.mark.parametrize("width", range(6))
def test_greedy_speculative_equals_target_only(engine, greedy_reference, width):
    slot = run(engine, PROMPT, GREEDY, width)
    assert slot.tokens == greedy_reference
    assert slot.stats.widths[width] == slot.stats.steps >= 63 // (width + 1)  # token 1 comes from prefill


def test_packed_parameters_decode_what_unpacked_ones_do(model, engine, greedy_reference):
    """The GPU's default (small parameters packed into a few buffers), run on the CPU, where the
    session engine passes them unpacked: the same greedy tokens, target-only and at width 5."""
    assert len(engine.exe.params.arrays) == len(jax.tree.leaves(model.params))
    packed = Engine(model, EngineConfig(max_seq_len=96, gamma=5, max_batch=2), prefill_chunk=16, widths=(5,),
                    options=SpecOptions(width=5), pack_params=True)
    assert len(packed.exe.params.arrays) < len(jax.tree.leaves(model.params))
    for width in (None, 5):
        assert run(packed, PROMPT, GREEDY, width).tokens == greedy_reference


def test_greedy_with_scripted_drafts_exercises_every_accept_length(engine, greedy_reference, monkeypatch):
    """Drafts copied from the reference continuation, corrupted at random positions, verified by
    the step function the engine compiles (`external_drafts`): every accepted-prefix length
    occurs, and the output is still the reference."""
    rng = np.random.default_rng(0)
    scripted_step = jax.jit(engine.exe.step_function(5, external_drafts=True), donate_argnums=(1, 2))

    def scripted(params, decode, cache, slots):
        done = len(engine.slots[0].tokens)
        tokens = np.array([greedy_reference[min(done + i, len(greedy_reference) - 1)] for i in range(5)], np.int32)
        bad = rng.integers(0, 7)  # 5 or 6: all correct
        if bad < 5:
            tokens[bad] = (tokens[bad] + 1) % 16
        return scripted_step(params, decode, cache, slots, np.stack([tokens, tokens]))

    monkeypatch.setitem(engine.exe.step, 5, scripted)
    slot = run(engine, PROMPT, GREEDY, 5)
    assert slot.tokens == greedy_reference
    accepted = np.array(slot.stats.accepted_at)
    assert (accepted > 0).all() and slot.stats.tau > 2.0, slot.stats.as_dict()


def test_draft_cache_holds_exactly_the_committed_positions(engine, model):
    """Mid-generation (accepts and rejections behind it), the drafter's context rows equal those
    recomputed from scratch over the committed tokens."""
    engine.speculative, engine.width_policy = True, lambda confidence: 3
    b = engine.add(PROMPT, SamplingParams(max_tokens=60, temperature=1.0, seed=5, ignore_eos=True))
    for _ in range(12):
        engine.step()
    tokens = engine.slots[b].tokens
    engine.release(b)
    committed = np.concatenate([PROMPT, tokens[:-1]]).astype(np.int32)  # the last token is the next anchor
    assert int(engine.draft.length[b]) == len(committed) == int(engine.decode.length[b])
    features = model.forward(committed[None], CONFIG.dspark.target_layer_ids).features
    fresh = dspark.init_draft_cache(CONFIG, 1, model.dtype)
    fresh = dspark.push_context(model.module(), fresh, features, np.array([len(committed)], np.int32))
    window = CONFIG.sliding_window
    slots_held = np.arange(len(committed) - window, len(committed)) % window
    for got, want in zip(engine.draft.windows, fresh.windows):
        np.testing.assert_allclose(np.asarray(got)[b, slots_held], np.asarray(want)[0, slots_held], atol=1e-5)


def test_no_compilation_after_warm_up_at_any_mix_of_widths(engine, compile_counter):
    """A 200-token generation at random widths (all of 0..5 used) next to a second request."""
    widths = iter(np.random.default_rng(1).integers(0, 6, 1000))
    run(engine, PROMPT, SamplingParams(max_tokens=8, temperature=0.8, top_k=5, seed=1), 2)  # warm-up
    before = compile_counter.count
    engine.speculative, engine.width_policy = True, lambda confidence: int(next(widths))
    b = engine.add(PROMPT, SamplingParams(max_tokens=200, temperature=1.0, seed=2, ignore_eos=True))
    c = engine.add(PROMPT[:5], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while engine.active:
        engine.step()
    assert len(engine.slots[b].tokens) == 200 and len(engine.slots[c].tokens) == 40
    assert min(engine.slots[b].stats.widths) > 0  # every width was used
    engine.release(b)
    engine.release(c)
    assert compile_counter.count == before


def test_bad_requests_get_clear_errors(engine, model):
    with pytest.raises(EngineError, match="exceeds max_seq_len=256"):
        engine.add(PROMPT, SamplingParams(max_tokens=240))
    with pytest.raises(EngineError, match="token id 16 is outside the vocabulary"):
        engine.add([1, 16], GREEDY)
    with pytest.raises(EngineError, match="speculative=True needs a checkpoint with a DSpark drafter"):
        Engine(Model.random(CONFIG.replace(extra={}, num_nextn_predict_layers=1, compress_ratios=(0, 4, 16, 0))),
               EngineConfig(max_seq_len=32), speculative=True)
    with pytest.raises(ValueError, match="temperature=-1: must be a number >= 0"):
        SamplingParams(temperature=-1)
    assert engine.active == [] and all(s is None for s in engine.slots)


# ---- losslessness of sampling -------------------------------------------------------------------

STAT_PROMPT = np.array([5, 9, 2, 14], np.int32)
WARPS = {"T=1": dict(temperature=1.0), "T=0.7,top_k=8,top_p=0.9": dict(temperature=0.7, top_k=8, top_p=0.9)}
BATCH, ROUNDS = 256, 10


def exact_joint(model, warp) -> np.ndarray:
    """p(t1, t2, t3) [16, 16, 16] of the target under `warp`, by enumeration."""
    v = CONFIG.vocab_size
    t1, t2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    seqs = np.concatenate([np.tile(STAT_PROMPT, (v * v, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], axis=1)
    logits = np.asarray(model.forward(seqs).logits)  # rows: ..., prompt end, t1, t2
    rows = len(seqs)
    w = (np.full(rows, warp.get("temperature", 1.0), np.float32), np.full(rows, warp.get("top_k", 0), np.int32),
         np.full(rows, warp.get("top_p", 1.0), np.float32))
    p = [np.asarray(warp_probs(logits[:, i], *w)) for i in (-3, -2, -1)]
    p1 = p[0][0]  # [v]: every row shares the prompt
    p2 = p[1].reshape(v, v, v)[:, 0]  # [t1, t2]
    p3 = p[2].reshape(v, v, v)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_first_tokens(engine, warp, rounds) -> np.ndarray:
    """[n, 3]: the prefill's token, then two more from the speculative steps."""
    engine.speculative = True
    out, engine.widths_used = [], np.zeros(6, int)
    for r in range(rounds):
        params = [SamplingParams(max_tokens=3, seed=r * BATCH + i, ignore_eos=True, **warp) for i in range(BATCH)]
        slots = engine.add_many([(STAT_PROMPT, p) for p in params])
        while engine.active:
            engine.step()
        for b in slots:
            out.append(engine.slots[b].tokens)
            engine.widths_used += engine.slots[b].stats.widths
            engine.release(b)
    return np.array(out)


def chi_square_p(cells: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of categorical samples (flat cell ids) against probs, with the
    cells of expected count < 5 pooled into one. A sample in a cell of probability 0 gives 0."""
    counts = np.bincount(cells, minlength=probs.size).astype(float)
    probs = probs.astype(np.float64).ravel()
    if counts[probs == 0].any():
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * len(cells)
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return float(stats.chisquare(obs, exp).pvalue)


def lossless_p_values(engine, model, warp, rounds) -> tuple[float, float]:
    """p-values of the emitted (t1, t2) and (t2, t3) against the target's exact joint."""
    joint = exact_joint(model, warp)
    tokens = sample_first_tokens(engine, warp, rounds)
    v = CONFIG.vocab_size
    return (chi_square_p(tokens[:, 0] * v + tokens[:, 1], joint.sum(axis=2)),
            chi_square_p(tokens[:, 1] * v + tokens[:, 2], joint.sum(axis=0)))


@pytest.fixture(scope="module", params=[False, True], ids=["jnp-sampler", "pallas-sampler"])
def stat_engine(model, request):
    """Adaptive widths: the E(k)/(D+V(k)) selector on injected costs that make it pick 1 or 2 from
    each request's stale confidences (3+ are prohibitively expensive). Once with the jnp reference
    sampler and once with the Pallas kernel (interpret mode on the CPU, Triton on the GPU)."""
    engine = Engine(model, EngineConfig(max_seq_len=16, gamma=5, max_batch=BATCH), prefill_chunk=4,
                    widths=(0, 1, 2), width_policy=lambda confidence: 2, use_kernel=request.param)
    engine.width_policy = AdaptiveWidth([1e-3, 1e-3, 1.5e-3, 10.0, 10.0, 10.0], 1e-3, gamma=5)
    return engine


@pytest.mark.parametrize("warp", WARPS.values(), ids=WARPS.keys())
def test_speculative_sampling_is_lossless(stat_engine, model, warp):
    p12, p23 = lossless_p_values(stat_engine, model, warp, ROUNDS)
    assert p12 > 1e-3 and p23 > 1e-3, (p12, p23)
    assert stat_engine.widths_used[1] > 0 and stat_engine.widths_used[2] > 0  # the selector really chose


def skip_residual(*args, use_kernel=False):
    """The verifier tests' negative control (samples p instead of the residual after a rejection),
    with the engine's call signature."""
    return biased_rejection_sample(*args)


def test_the_lossless_test_catches_a_sampler_that_skips_the_residual(model, monkeypatch):
    monkeypatch.setattr(executables, "rejection_sample", skip_residual)
    biased = Engine(model, EngineConfig(max_seq_len=16, gamma=5, max_batch=BATCH), prefill_chunk=4, widths=(2,),
                    width_policy=lambda confidence: 2)
    p12, p23 = lossless_p_values(biased, model, WARPS["T=1"], ROUNDS)
    assert min(p12, p23) < 1e-3, (p12, p23)
