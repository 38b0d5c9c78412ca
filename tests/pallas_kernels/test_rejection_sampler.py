"""The Pallas rejection sampler equals the jnp reference exactly: the race kernel against `ref_race`
on fresh random inputs, exact ties and several layouts, and the full verifier with the kernel
(`implementation="pallas"`) against `ref_rejection_sample` on random inputs and its edge cases.
Interpret mode on CPU; the `gpu` tests run the same checks compiled through Triton. That both
agree with the exact output distribution is tests/speculative/test_oracle.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.speculative.sampling import sample, warp_probs
from jdspark.speculative.verify import ref_rejection_sample, rejection_sample
from pallas_kernels.rejection_sampler import layout, race, ref_race

VOCAB = 129_280
EDGE = (8, 3, 300)  # batch, width, vocab of the edge-case tests: one compilation for all of them
kernel = jax.jit(functools.partial(rejection_sample, implementation="pallas"))
reference = jax.jit(ref_rejection_sample)
kernel_race = jax.jit(race, static_argnames=("tile", "splits", "num_warps", "num_stages", "interpret"))
reference_race = jax.jit(ref_race)
warp = jax.jit(warp_probs)
draw = jax.jit(sample)


def race_inputs(b, k, vocab, seed, ties=False):
    """(p_row, draft_probs, n_accepted, 1/E) with zeros in p and q; ties=True makes most race
    scores exactly equal, so only the lowest-index rule decides."""
    rng = np.random.default_rng(seed)
    levels = np.array([0.0, 0.25, 0.5], np.float32)
    if ties:
        p = levels[rng.integers(0, 3, (b, vocab))]
        q = levels[rng.integers(0, 3, (b, k, vocab))]
        inv_e = np.ones((b, vocab), np.float32)
    else:
        p = rng.exponential(size=(b, vocab)).astype(np.float32) * (rng.uniform(size=(b, vocab)) < 0.8)
        q = rng.exponential(size=(b, k, vocab)).astype(np.float32) * (rng.uniform(size=(b, k, vocab)) < 0.8)
        inv_e = (1.0 / rng.exponential(size=(b, vocab))).astype(np.float32)
    n_acc = rng.integers(0, k + 1, b).astype(np.int32)
    return p, q, n_acc, inv_e


def assert_race_matches(args, **layout_kw):
    want = np.asarray(reference_race(*args))
    np.testing.assert_array_equal(np.asarray(kernel_race(*args, **layout_kw)), want)


@pytest.mark.parametrize(
    "b, k, vocab, tile, splits",
    [(3, 0, 6, None, None), (4, 2, 8, 4, 2), (4, 3, 1000, None, None), (4, 3, 1000, 128, 3),
     (2, 5, 4099, 512, None), (5, 1, 2048, None, 1), (2, 2, 70_001, 4096, 5)],
)
def test_race_equals_reference(b, k, vocab, tile, splits):
    assert_race_matches(race_inputs(b, k, vocab, seed=vocab + k), tile=tile, splits=splits)


@pytest.mark.parametrize("tile, splits", [(None, None), (64, 1), (128, 4)])
def test_race_ties_go_to_the_lowest_index(tile, splits):
    args = race_inputs(6, 2, 1000, seed=1, ties=True)
    assert_race_matches(args, tile=tile, splits=splits)


def test_race_falls_back_to_p_when_the_residual_is_zero():
    p, q, _, inv_e = race_inputs(4, 2, 300, seed=2)
    q = np.concatenate([q[:, :1], p[:, None] * 2], axis=1)  # row 1: q >= p everywhere
    n_acc = np.array([1, 1, 0, 2], np.int32)
    want = np.asarray(reference_race(p, q, n_acc, inv_e))
    np.testing.assert_array_equal(want[:2], np.argmax(np.where(p > 0, p * inv_e, -1), axis=-1)[:2])
    assert_race_matches((p, q, n_acc, inv_e))


@pytest.mark.parametrize("k, tile, splits", [(5, None, None), (0, 1024, 4), (2, 4096, 1)])
def test_kernel_lowers_to_triton_ir(k, tile, splits):
    """Lowering for CUDA (no GPU needed) builds the kernel's Triton IR: power-of-two blocks and
    supported primitives are checked on every CI run, not only on the GPU machine."""
    shapes = [((8, VOCAB), jnp.float32), ((8, k, VOCAB), jnp.float32), ((8,), jnp.int32), ((8, VOCAB), jnp.float32)]
    kernel_fn = jax.jit(functools.partial(race, tile=tile, splits=splits, interpret=False))
    traced = kernel_fn.trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes))
    assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_layout():
    assert layout(1, VOCAB, None, None) == (512, 1, 253)  # small batch: smaller tiles, more programs
    assert layout(32, VOCAB, None, None) == (2048, 1, 64)
    assert layout(32, VOCAB, None, 16) == (2048, 4, 16)
    assert layout(2, 6, None, None) == (4, 1, 2)
    for batch, vocab, tile, splits in [(1, 1000, 128, 3), (3, 70_001, 4096, 5), (8, VOCAB, 1024, 7)]:
        tile, per_program, programs = layout(batch, vocab, tile, splits)
        n_tiles = -(-vocab // tile)
        assert (programs - 1) * per_program < n_tiles <= programs * per_program  # none empty
    with pytest.raises(ValueError, match="tile=1000 is not a power of two"):
        layout(1, VOCAB, 1000, None)


def verifier_inputs(b, k, vocab, seed, temperature=None, top_k=None, top_p=None, draft_noise=0.5):
    """Fresh random verifier inputs with drafts drawn from q; None parameters are mixed per row."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(b, k + 1, vocab)) * 2).astype(np.float32)
    draft_logits = logits[:, :k] + draft_noise * rng.normal(size=(b, k, vocab)).astype(np.float32)
    t = rng.choice([0.0, 0.6, 1.0], size=b) if temperature is None else temperature
    tk = rng.choice([0, 3, 50], size=b) if top_k is None else top_k
    tp = rng.choice([1.0, 0.9, 0.3], size=b) if top_p is None else top_p
    t, tk, tp = (np.broadcast_to(a, (b,)).astype(d) for a, d in ((t, np.float32), (tk, np.int32), (tp, np.float32)))
    q = np.array(warp(draft_logits, t[:, None], tk[:, None], tp[:, None]))
    drafts = np.array(draw(q, rng.exponential(size=q.shape).astype(np.float32)))
    uniforms = rng.uniform(size=(b, k)).astype(np.float32)
    noise = rng.exponential(size=(b, vocab)).astype(np.float32)
    return [logits, q, drafts, uniforms, noise, t, tk, tp]


def assert_verifier_matches(args):
    want = [np.asarray(a) for a in reference(*args)]
    got = [np.asarray(a) for a in kernel(*args)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert not want[2].any()  # finite inputs: no row is invalid
    return want[:2]


@pytest.mark.parametrize("b, k, vocab", [(8, 0, 50), (16, 3, 40), (6, 5, 1000), (6, 2, 4099)])
def test_verifier_equals_reference(b, k, vocab):
    n_acc, _ = assert_verifier_matches(verifier_inputs(b, k, vocab, seed=b * k + vocab))
    assert k == 0 or len(set(n_acc)) > 1


def test_verifier_equals_reference_at_full_vocabulary():
    assert_verifier_matches(verifier_inputs(1, 2, VOCAB, seed=3, temperature=1.0, top_k=0, top_p=1.0))


def test_all_accepted_when_p_equals_q():
    args = verifier_inputs(*EDGE, seed=5, temperature=0.8, top_k=0, top_p=0.9, draft_noise=0.0)
    n_acc, _ = assert_verifier_matches(args)
    np.testing.assert_array_equal(n_acc, 3)


def test_first_draft_rejected():
    args = verifier_inputs(*EDGE, seed=6, temperature=1.0, top_k=0, top_p=1.0)
    logits, q = args[0], args[1]
    args[2][:, 0] = np.argmin(logits[:, 0], axis=-1)  # the target's least likely token ...
    q[:, 0] = 0.0
    q[np.arange(8), 0, args[2][:, 0]] = 1.0  # ... which the drafter was sure of
    n_acc, _ = assert_verifier_matches(args)
    np.testing.assert_array_equal(n_acc, 0)


def test_zero_residual_mass_falls_back_to_p():
    args = verifier_inputs(*EDGE, seed=7, temperature=1.0, top_k=0, top_p=1.0)
    p = np.asarray(warp(args[0], 1.0, 0, 1.0))
    args[1][:, 0] = 2 * p[:, 0]  # q >= p everywhere: every draft rejected, the residual is zero
    args[3][:] = 0.9
    n_acc, token = assert_verifier_matches(args)
    np.testing.assert_array_equal(n_acc, 0)
    np.testing.assert_array_equal(token, np.asarray(draw(p[:, 0], args[4])))


def test_filtered_rows_reject_drafts_outside_the_kept_set():
    args = verifier_inputs(*EDGE, seed=8, temperature=1.0, top_k=np.array([2, 5, 0, 2] * 2),
                           top_p=np.array([1.0, 0.5, 0.2, 0.7] * 2), draft_noise=3.0)
    unfiltered = verifier_inputs(*EDGE, seed=8, temperature=1.0, top_k=0, top_p=1.0, draft_noise=3.0)
    args[1], args[2] = unfiltered[1], unfiltered[2]  # drafts from an unfiltered q land outside the set
    n_acc, _ = assert_verifier_matches(args)
    assert (n_acc < 3).all()


@pytest.mark.gpu
@pytest.mark.parametrize("b, k", [(1, 0), (1, 5), (8, 1), (8, 5), (32, 3)])
def test_compiled_verifier_equals_reference_on_gpu(b, k):
    assert jax.default_backend() == "gpu"
    for seed in range(3):
        assert_verifier_matches(verifier_inputs(b, k, VOCAB, seed=seed))
        assert_verifier_matches(verifier_inputs(b, k, VOCAB, seed=seed, top_k=0, top_p=1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("tile, splits", [(None, None), (1024, None), (4096, 4), (2048, 1)])
def test_compiled_race_equals_reference_on_gpu(tile, splits):
    for b, k in [(1, 5), (8, 2), (32, 5)]:
        assert_race_matches(race_inputs(b, k, VOCAB, seed=b + k), tile=tile, splits=splits)
        assert_race_matches(race_inputs(b, k, VOCAB, seed=b, ties=True), tile=tile, splits=splits)
