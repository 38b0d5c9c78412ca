"""The anticipation counterexample of spec dspark.md §5.7 / §16.3 (paper App. A), through the width
selector (`choose_width`) and the reference verifier.

Two tokens, target p = (0.7, 0.3) at every position, drafter q = (0.5, 0.5), gamma = 2. The
confidence c_1 = 0.5 reads only the anchor; c_2 reads W1[x_1], so it reveals the drawn draft:
c_2 = 1 after x_1 = A, 0 after x_1 = B. With D = 0 and V = (1, 1.6, 1.6), choose_width picks k = 2
when c_2 = 1 and k = 0 when c_2 = 0:
- retrospective (the global argmax on the current block's confidences): x_1 = A is verified and
  always accepted (p/q = 1.4), x_1 = B is never verified and the token is drawn from p: the first
  token is A with probability 0.5 + 0.5 x 0.7 = 0.85, not 0.7;
- stale (the same argmax on the previous block's confidences, the engine's rule): lossless;
- early stopping left to right on current confidences (position k admitted on c_1..c_k, which
  depend on x_<k only): lossless.
"""

import jax
import numpy as np
from scipy import stats

from jdspark.speculative.selector import choose_width
from jdspark.speculative.verify import ref_rejection_sample

P = np.array([0.7, 0.3])
Q = np.array([0.5, 0.5])
COSTS = [1.0, 1.6, 1.6]
N = 20_000
verify = jax.jit(ref_rejection_sample)


def confidences(draft_1):
    """[c_1, c_2] of a block whose first draft is draft_1 (c_2 reads W1[x_1])."""
    return [0.5, 1.0 if draft_1 == 0 else 0.0]


def first_tokens(widths: np.ndarray, drafts: np.ndarray, rng) -> np.ndarray:
    """The first emitted token of each run, verifying widths[i] of its drafts [N, 2]."""
    out = np.empty(len(widths), np.int32)
    for k in np.unique(widths):
        rows = np.flatnonzero(widths == k)
        n = len(rows)
        logits = np.broadcast_to(np.log(P).astype(np.float32), (n, k + 1, 2))
        q = np.broadcast_to(Q.astype(np.float32), (n, k, 2))
        u = rng.uniform(size=(n, k)).astype(np.float32)
        e = rng.exponential(size=(n, 2)).astype(np.float32)
        ones = np.ones(n, np.float32)
        n_acc, token, invalid = (np.asarray(a) for a in verify(logits, q, drafts[rows, :k], u, e, ones,
                                                                  np.zeros(n, np.int32), ones))
        assert not invalid.any()
        out[rows] = np.where(n_acc >= 1, drafts[rows, 0], token) if k else token
    return out


def p_value(tokens) -> float:
    return stats.chisquare(np.bincount(tokens, minlength=2), P * len(tokens)).pvalue


def test_retrospective_argmax_on_current_confidences_is_biased():
    """The paper's failure mode: (0.7, 0.3) becomes (0.85, 0.15). This is what the engine's stale
    confidences prevent; a selector that read the current block's confidences would do this."""
    rng = np.random.default_rng(0)
    drafts = rng.choice(2, size=(N, 2), p=Q).astype(np.int32)
    widths = np.array([choose_width(confidences(d), 0.0, COSTS) for d in drafts[:, 0]])
    assert set(widths[drafts[:, 0] == 0]) == {2} and set(widths[drafts[:, 0] == 1]) == {0}
    tokens = first_tokens(widths, drafts, rng)
    assert abs(np.mean(tokens == 0) - 0.85) < 0.01
    assert p_value(tokens) < 1e-6


def test_the_same_argmax_on_stale_confidences_is_lossless():
    """Widths from the previous block's confidences (an independent earlier draft), as the engine
    does (spec §7): the first token follows p. Fed the current block's confidences instead (the
    mutation), the same code is the biased case above."""
    rng = np.random.default_rng(1)
    drafts = rng.choice(2, size=(N, 2), p=Q).astype(np.int32)
    previous = rng.choice(2, size=N, p=Q)
    widths = np.array([choose_width(confidences(d), 0.0, COSTS) for d in previous])
    assert set(widths) == {0, 2}
    assert p_value(first_tokens(widths, drafts, rng)) > 1e-3


def test_left_to_right_early_stopping_on_current_confidences_is_lossless():
    """Admit position k while c_k >= 0.5: position 1 on c_1 (the anchor only), position 2 on c_2
    (x_1 only). Widths 1 or 2 depend on x_1, yet the first token follows p."""
    rng = np.random.default_rng(2)
    drafts = rng.choice(2, size=(N, 2), p=Q).astype(np.int32)
    widths = np.array([next((k for k, c in enumerate(confidences(d)) if c < 0.5), 2) for d in drafts[:, 0]])
    assert set(widths) == {1, 2}
    assert p_value(first_tokens(widths, drafts, rng)) > 1e-3
