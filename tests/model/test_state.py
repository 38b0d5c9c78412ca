"""Decode state: incremental, chunked, batched and speculative (extend + commit) paths all equal the
full-sequence forward of the same model (tiny config: window 8, CSA ratio 4, HCA ratio 16)."""

import jax
import numpy as np
import pytest

from jdspark.config import EngineConfig, tiny_config
from jdspark.model import state
from jdspark.model.model import Model

LENGTH = 72  # crosses the window (8) nine times, emits 18 CSA and 4 HCA entries
PREFILL = 16  # the prefill bucket: a chunk of up to 16 tokens, padded, n_valid says how many count
TOL = 1e-5
FEATURES = (2, 5)  # drafter feature layers: a CSA and an HCA layer's output
ENGINE = EngineConfig(max_seq_len=96, gamma=5, max_batch=4)  # one shape set: compiled once per module


@pytest.fixture(scope="module")
def model():
    return Model.random(tiny_config(), "float32", seed=7)


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(11).integers(0, 512, (4, LENGTH)).astype(np.int32)


@pytest.fixture(scope="module")
def full(model, prompts):
    """(logits, drafter features) of the full-sequence forward."""
    out = model.forward(prompts, FEATURES)
    return np.asarray(out.logits), np.asarray(out.features)


def extend(model, decode, chunks, n_valid, with_features=False):
    """One extend call (always with FEATURES: one executable per shape); returns (logits, new
    state), or (logits, features, new state)."""
    out = model.extend(decode, chunks, np.asarray(n_valid, np.int32), FEATURES)
    if with_features:
        return np.asarray(out.logits), np.asarray(out.features), out.state
    return np.asarray(out.logits), out.state


def run_chunked(model, prompts, chunk_sizes, engine):
    """Feed each slot its prompt in its own chunk sizes (<= PREFILL; the last size repeats) through
    the S=PREFILL executable, or the S=1 one when every chunk is a single token; collect the logits
    of every position."""
    batch, total = prompts.shape
    decode = model.init_state(engine)
    done = np.zeros(batch, np.int64)
    got = np.zeros((batch, total, model.config.vocab_size), np.float32)
    got_features = np.zeros((batch, total, len(FEATURES) * model.config.hidden_size), np.float32)
    step = 0
    while (done < total).any():
        sizes = np.array([min(chunk_sizes[b][min(step, len(chunk_sizes[b]) - 1)], total - done[b])
                          for b in range(batch)])
        width = 1 if sizes.max() == 1 else PREFILL
        chunk = np.zeros((batch, width), np.int32)
        for b in range(batch):
            chunk[b, :sizes[b]] = prompts[b, done[b]:done[b] + sizes[b]]
        logits, features, decode = extend(model, decode, chunk, sizes, with_features=True)
        for b in range(batch):
            got[b, done[b]:done[b] + sizes[b]] = logits[b, :sizes[b]]
            got_features[b, done[b]:done[b] + sizes[b]] = features[b, :sizes[b]]
        done += sizes
        step += 1
    np.testing.assert_array_equal(np.asarray(decode.length), done)
    return got, got_features


def assert_matches_full(got, full):
    for name, a, b in zip(("logits", "features"), got, full):
        err = np.abs(a - b).max()
        assert err <= TOL, (name, err)


@pytest.mark.slow  # many extend shapes compiled: ~30 s on a 2-core CPU
def test_incremental_decode_equals_full_forward(model, prompts, full):
    """Prefill a different length per slot, then one token at a time up to LENGTH."""
    prefill = [[13, 1], [16, 1], [9, 1], [1]]  # first chunk, then single tokens
    assert_matches_full(run_chunked(model, prompts, prefill, ENGINE), full)


def test_chunked_prefill_random_chunks_equals_full_forward(model, prompts, full):
    rng = np.random.default_rng(3)
    sizes = [list(rng.integers(1, PREFILL + 1, 12)) for _ in range(3)] + [[1, 3, 4, 5, 16, 2, 7]]
    assert_matches_full(run_chunked(model, prompts, sizes, ENGINE), full)


@pytest.mark.slow  # many extend shapes compiled: ~30 s on a 2-core CPU
def test_batched_slots_equal_each_slot_alone(model, prompts):
    sizes = [[5, 1], [12, 1], [16, 3, 1], [1]]
    n = 40
    batched, _ = run_chunked(model, prompts[:, :n], sizes, ENGINE)
    alone_engine = EngineConfig(max_seq_len=96, gamma=5, max_batch=1)
    for b in range(4):
        alone, _ = run_chunked(model, prompts[b:b + 1, :n], sizes[b:b + 1], alone_engine)
        err = np.abs(alone[0] - batched[b]).max()
        assert err <= TOL, (b, err)


def speculate_then_decode(model, engine, prefixes, drafts, n_write, n_keep, steps, decode_width=1):
    """Per slot: prefill its prefix (chunks of 6), extend by drafts[:n_write] (one call, width 6),
    commit n_keep, then greedy-decode `steps` tokens one at a time (in a call of `decode_width`).
    Returns (logits [B, steps, V], tokens [B, steps])."""
    batch, width = len(prefixes), drafts.shape[1]
    decode = model.init_state(engine)
    lengths = np.array([len(p) for p in prefixes])
    for start in range(0, lengths.max(), width):
        chunk = np.zeros((batch, width), np.int32)
        for b, prefix in enumerate(prefixes):
            piece = prefix[start:start + width]
            chunk[b, :len(piece)] = piece
        _, decode = extend(model, decode, chunk, np.clip(lengths - start, 0, width))
    _, decode = extend(model, decode, drafts, n_write)
    decode = model.commit(decode, np.asarray(n_keep, np.int32))
    np.testing.assert_array_equal(np.asarray(decode.length), lengths + np.asarray(n_keep))
    # The next token: the last kept draft, or the prefix's last token again when none was kept
    # (the same on both paths, which is all the comparison needs).
    token = np.array([drafts[b, n_keep[b] - 1] if n_keep[b] else prefixes[b][-1] for b in range(batch)], np.int32)
    all_logits, tokens = [], []
    for _ in range(steps):
        chunk = np.zeros((batch, decode_width), np.int32)
        chunk[:, 0] = token
        logits, decode = extend(model, decode, chunk, np.ones(batch, np.int32))
        all_logits.append(logits[:, 0])
        token = logits[:, 0].argmax(-1).astype(np.int32)
        tokens.append(token)
    return np.stack(all_logits, 1), np.stack(tokens, 1)


def rollback_cases(gamma=5):
    """Every (k, j): verify width k (k + 1 rows written), j <= k + 1 rows kept."""
    return [(k, j) for k in range(gamma + 1) for j in range(k + 2)]


@pytest.mark.slow  # many extend shapes compiled: ~30 s on a 2-core CPU
def test_verify_then_rollback_equals_direct_extend(model, prompts):
    """For every k in 0..5 and j <= k+1: extend by k+1 tokens, commit j, decode 20 — equals the
    path that extended by the j tokens directly. Prefix lengths 11..16 put the verified rows across
    CSA (4) and HCA (16) window boundaries; the 20 decoded tokens cross more of them."""
    cases = rollback_cases()
    engine = EngineConfig(max_seq_len=96, gamma=5, max_batch=2 * len(cases))
    rng = np.random.default_rng(5)
    prefixes, drafts, n_write, n_keep = [], [], [], []
    for i, (k, j) in enumerate(cases):
        prefixes.append(prompts[i % 4, :11 + i % 6])
        drafts.append(rng.integers(0, 512, 6))
        n_write.append(k + 1)
        n_keep.append(j)
    # Slots [0, n): speculative path; slots [n, 2n): the same prefix and drafts, only j written.
    prefixes = prefixes * 2
    drafts = np.array(drafts * 2, np.int32)
    n_write = n_write + n_keep
    n_keep = n_keep * 2
    logits, tokens = speculate_then_decode(model, engine, prefixes, drafts, n_write, n_keep, steps=20)
    n = len(cases)
    err = np.abs(logits[:n] - logits[n:]).max()
    assert err <= 1e-6, err
    np.testing.assert_array_equal(tokens[:n], tokens[n:])


def test_rollback_test_detects_a_ring_that_is_too_small(model, prompts):
    """Control: with rings sized for gamma = 0 (window ring of exactly `sliding_window`), rolling
    back 5 rows overwrites keys the kept tokens still need, and the comparison above fails loudly."""
    engine = EngineConfig(max_seq_len=96, gamma=0, max_batch=2)
    assert state.RingSizes.of(model.config, engine.rollback_rows).window == model.config.sliding_window
    drafts = np.array([np.arange(100, 106)] * 2, np.int32)
    logits, _ = speculate_then_decode(model, engine, [prompts[0, :13]] * 2, drafts, [6, 1], [1, 1], steps=3,
                                      decode_width=6)
    assert np.abs(logits[0] - logits[1]).max() > 1e-3


def test_ring_sizes_are_rollback_safe(model):
    rings = state.RingSizes.of(model.config, EngineConfig(gamma=5).rollback_rows)
    assert rings.window == 8 - 1 + 6  # needs W - 1 rows behind the frontier plus 6 written ahead
    assert rings.compressor == {4: 2 * 4 - 1 + 6, 16: 16 - 1 + 6}


def test_ring_positions():
    got = np.asarray(state.ring_positions(jax.numpy.array([0, 3, 10]), 4))
    np.testing.assert_array_equal(got, [[-4, -3, -2, -1], [0, 1, 2, -1], [8, 9, 6, 7]])


def test_commit_clamps_and_reset_frees_slots(model):
    decode = model.init_state(ENGINE)
    _, decode = extend(model, decode, np.ones((4, 6), np.int32), [6, 4, 0, 1])
    np.testing.assert_array_equal(np.asarray(decode.written), [6, 4, 0, 1])
    decode = model.commit(decode, np.array([2, 9, 0, 1]))  # 9 > written: keeps what was written
    np.testing.assert_array_equal(np.asarray(decode.length), [2, 4, 0, 1])
    np.testing.assert_array_equal(np.asarray(decode.written), [0, 0, 0, 0])
    decode = state.reset_slots(decode, jax.numpy.array([False, True, False, False]))
    np.testing.assert_array_equal(np.asarray(decode.length), [2, 0, 0, 1])


def test_no_recompilation_for_repeated_shapes(model, compile_counter):
    decode = model.init_state(ENGINE)
    rng = np.random.default_rng(0)
    for _ in range(2):  # warm-up: every executable and host->device constant path used below
        _, decode = extend(model, decode, rng.integers(0, 512, (4, 6)), [6, 5, 1, 0])
        decode = model.commit(decode, np.array([3, 2, 1, 0], np.int32))
        _, decode = extend(model, decode, rng.integers(0, 512, (4, 1)), [1, 1, 1, 1])
    before = compile_counter.count
    for _ in range(3):
        _, decode = extend(model, decode, rng.integers(0, 512, (4, 6)), [6, 2, 3, 6])
        decode = model.commit(decode, np.array([1, 2, 3, 4], np.int32))
        _, decode = extend(model, decode, rng.integers(0, 512, (4, 1)), [1, 0, 1, 1])
    assert compile_counter.count == before


def test_prefill_helper_and_bad_n_valid(model, prompts, full):
    logits, decode = model.prefill(prompts[0], ENGINE, chunk=PREFILL)
    assert np.abs(logits - full[0][0]).max() <= TOL
    np.testing.assert_array_equal(np.asarray(decode.length), [LENGTH, 0, 0, 0])
    with pytest.raises(ValueError, match=r"n_valid=\[7, 0, 0, 0\] must be 4 counts in 0..6"):
        model.extend(decode, np.zeros((4, 6), np.int32), [7, 0, 0, 0])
    with pytest.raises(ValueError, match="exceed max_seq_len=96"):
        model.prefill(np.zeros(97, np.int32), ENGINE)
