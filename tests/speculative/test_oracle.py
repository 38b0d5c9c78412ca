"""An exact oracle for one verification on a small vocabulary, against both the reference verifier
and the Pallas kernel (interpret mode on the CPU).

For fixed target rows p_0..p_K and draft rows q_0..q_{K-1}, with drafts d ~ q, the output of one
verification (the emitted tokens d_1..d_n, then the residual or bonus token t) has a distribution
the oracle computes exactly, in float64 numpy and independently of the code under test: enumerate
every draft sequence d in V^K, its acceptance probabilities a_j = min(1, p_j(d_j) / q_j(d_j)), the
accepted length n, and the token distribution (normalised max(p_n - q_n, 0) for n < K, falling back
to p_n when that is zero; the bonus row p_K for n = K). The sampled outcomes of N requests are
compared with it by chi-square, bonus position included; the oracle itself is checked to emit a
first token distributed as p_0 (the losslessness theorem).

Kernel-equals-reference (tests/pallas_kernels) cannot see a fault both share; this can.
"""

import functools
import itertools

import jax
import numpy as np
import pytest

from jdspark.speculative.sampling import exponential_noise, uniform_noise
from jdspark.speculative.verify import rejection_sample
from tests.speculative.test_verify import chi2_pvalue
from tests.speculative.test_sampling import np_warp_row

V, K, N = 5, 2, 20_000
ALPHA = 1e-3


def oracle(p: np.ndarray, q: np.ndarray) -> dict[tuple[int, ...], float]:
    """P(emitted sequence) for target rows p [K+1, V] and draft rows q [K, V] (float64)."""
    out: dict[tuple[int, ...], float] = {}
    for d in itertools.product(range(V), repeat=K):
        weight = np.prod([q[j, d[j]] for j in range(K)])
        if weight == 0:
            continue
        accept = [min(1.0, p[j, d[j]] / q[j, d[j]]) for j in range(K)]
        reach = 1.0  # P(drafts 0..n-1 accepted)
        for n in range(K + 1):
            if n < K:
                stop = reach * (1 - accept[n])
                residual = np.maximum(p[n] - q[n], 0.0)
                token_dist = residual / residual.sum() if residual.sum() > 0 else p[n]
            else:
                stop, token_dist = reach, p[K]
            for t in range(V):
                key = (*d[:n], t)
                out[key] = out.get(key, 0.0) + weight * stop * token_dist[t]
            if n < K:
                reach *= accept[n]
    return out


def case(name):
    """(target logits [K+1, V], draft logits [K, V], temperature, top_k, top_p)."""
    rng = np.random.default_rng(len(name))
    target = rng.normal(size=(K + 1, V)) * 1.5
    draft = target[:K] + rng.normal(size=(K, V))
    if name == "bonus":  # draft row 1 equals target row 1: half the runs reach the bonus row
        draft[1] = target[1]
        target[2] = np.roll(target[1], 2)  # and the bonus row differs from row 1
    if name == "filtered":
        return target, draft, 0.7, 3, 0.9
    return target, draft, 1.0, 0, 1.0


def warped(logits, temperature, top_k, top_p):
    return np.stack([np_warp_row(row, temperature, top_k, top_p) for row in logits])


@functools.partial(jax.jit, static_argnames="implementation")
def verify_many(logits, q, drafts, key, temperature, top_k, top_p, implementation):
    n = drafts.shape[0]
    u = uniform_noise(jax.random.fold_in(key, 0), (n, K))
    e = exponential_noise(jax.random.fold_in(key, 1), (n, V))
    return rejection_sample(logits, q, drafts, u, e, temperature, top_k, top_p, implementation=implementation)


def sampled_outcomes(name, implementation, seed=0) -> tuple[list[tuple[int, ...]], dict]:
    target, draft, t, tk, tp = case(name)
    p, q = warped(target, t, tk, tp), warped(draft, t, tk, tp)
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(V, size=N, p=q[j] / q[j].sum()) for j in range(K)], axis=1).astype(np.int32)
    logits = np.broadcast_to(target.astype(np.float32), (N, K + 1, V))
    q_in = np.broadcast_to(q.astype(np.float32), (N, K, V))
    params = (np.full(N, t, np.float32), np.full(N, tk, np.int32), np.full(N, tp, np.float32))
    n_acc, token, invalid = (np.asarray(a) for a in verify_many(logits, q_in, drafts, jax.random.key(seed), *params,
                                                                  implementation=implementation))
    assert not invalid.any()
    return [(*drafts[i, :n_acc[i]], token[i]) for i in range(N)], oracle(p, q)


def test_the_oracle_emits_the_target_first_token():
    for name in ("mixed", "bonus", "filtered"):
        target, draft, t, tk, tp = case(name)
        p, q = warped(target, t, tk, tp), warped(draft, t, tk, tp)
        dist = oracle(p, q)
        assert abs(sum(dist.values()) - 1) < 1e-12
        first = np.zeros(V)
        for seq, prob in dist.items():
            first[seq[0]] += prob
        np.testing.assert_allclose(first, p[0], atol=1e-12)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("name", ["mixed", "bonus", "filtered"])
def test_one_verification_follows_the_exact_oracle(name, implementation):
    """20000 verifications of one input (fresh drafts, uniforms and noise per row) against the
    oracle's distribution of emitted sequences (155 cells). Residual draws and bonus draws both
    occur (the "bonus" case reaches the bonus row in ~90% of the runs, from a row unlike row K - 1).

    Mutations caught (in the race shared by kernel and reference, or in stage A): the residual
    max(p - q, 0) replaced by p or by max(q - p, 0); the bonus token drawn from row K - 1 instead
    of row K; acceptance by p < u q or without the u draw."""
    outcomes, dist = sampled_outcomes(name, implementation)
    cells = {seq: i for i, seq in enumerate(dist)}
    assert all(seq in cells for seq in outcomes), "an outcome of probability 0"
    lengths = np.bincount([len(seq) - 1 for seq in outcomes], minlength=K + 1)
    assert lengths[0] > N // 20 and lengths[K] > N // 20, lengths  # the residual and the bonus row are both seen
    probs = np.array(list(dist.values()))
    assert chi2_pvalue(np.array([cells[seq] for seq in outcomes]), probs) > ALPHA
