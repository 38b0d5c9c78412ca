"""Losslessness of speculative sampling through the engine: the emitted tokens' joint distribution
equals the target's, computed exactly by enumeration over the 16-token vocabulary of the tiny
model (chi-square), with the jnp and the Pallas rejection sampler and the adaptive selector
choosing widths; and a negative control that the test catches a biased sampler."""

import numpy as np
import pytest
from scipy import stats

from jdspark.config import EngineConfig
from jdspark.engine import executables
from jdspark.engine.engine import Engine
from jdspark.engine.request import SamplingParams
from jdspark.speculative.sampling import warp_probs
from jdspark.speculative.selector import AdaptiveWidth
from tests.conftest import SPEC_CONFIG
from tests.spec.test_verify import biased_rejection_sample

CONFIG = SPEC_CONFIG


@pytest.fixture(scope="module")
def model(spec_model):
    return spec_model


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
