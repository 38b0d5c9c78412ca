"""Hardware-aware width selection (spec dspark.md §6-8).

k* = argmax over k in 0..gamma of E(k) / (D + V(k)), E(k) = 1 + sum_{i<=k} S_i, S_i = prod_{j<=i} c_j,
from *stale* confidences (the previous step's: a full argmax over the current block's confidences
would leak the sampled tokens and break exactness, spec §5.7), the measured draft cost D and the
measured verify cost curve V. Plus the acceptance fallback breaker that turns speculation off for
a while on requests whose drafts keep getting rejected.
"""

from __future__ import annotations

import math

import numpy as np


DRAFT_MARGIN = 0.10  # drafting is chosen only where priced above (1 + this) x a plain decode call's tokens a second.
# Drafting costs what E(k) / S(k) does not count: a speculating batch's requests end on different steps,
# each leaving its slot empty for a step or two of the longer verify calls and taking a prefill call of its
# own, where target-only requests of one length end and refill together (a request's last drafts, cut at
# max_tokens, are priced by `engine.widths.within_room`). Flash dimensions on an H200, 4 requests of 64
# tokens (docs/BENCHMARKS.md): width 3 priced 0-5% above decoding was served at 0.82-0.91 of it in rounds
# that drafted, with 3.2-3.7 of 4 rows a step (a margin does not undo a few early drafting steps: the
# requests then end apart for good). Its price:
# where drafting brings less than that, the engine decodes (the embedded model at c = 16 on an H100:
# width 5 served 1.05x of target-only).


def floored_costs(verify_costs) -> np.ndarray:
    """V as measured, floored at 1e-6. Not forced non-decreasing (vLLM's running max): each width is its
    own executable, and on the H200 some compiled slower than wider ones (bucket 1: step3 4.27 ms,
    step5 2.63, the fastest of 7 interleaved runs each), so a running max priced width 5 at width 3's
    cost and the selector fled to narrower widths; as measured, a wider width that is cheaper wins."""
    return np.maximum(np.asarray(verify_costs, np.float64), 1e-6)


def choose_width(confidences, draft_cost: float, verify_costs) -> int:
    """The width k in 0..gamma that maximises expected tokens per unit time; ties keep the smaller k.

    confidences: gamma conditional acceptance probabilities (stale); draft_cost: D >= 0;
    verify_costs: V(0..gamma), gamma + 1 values (floored here).
    """
    c = np.asarray(confidences, np.float64)
    v = np.asarray(verify_costs, np.float64)
    if c.ndim != 1 or v.shape != (c.size + 1,):
        raise ValueError(f"verify_costs has {v.size} values but {c.size} confidences need {c.size + 1} "
                         "(V(0..gamma), one per width)")
    _check_confidences(c.tolist())
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"verify_costs={v.tolist()}: each must be finite and >= 0")
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
        raise ValueError(f"draft_cost={draft_cost}: must be finite and >= 0")
    return _best_width(c.tolist(), _step_costs(draft_cost, v))


def _check_confidences(c: list[float]) -> None:
    if not all(0.0 <= x <= 1.0 for x in c):  # also false for NaN
        raise ValueError(f"confidences={c}: each must be a probability in [0, 1]")


def _step_costs(draft_cost: float, verify_costs: np.ndarray) -> list[float]:
    """D + V(k) per width, floored at 1e-6."""
    return np.maximum(draft_cost + floored_costs(verify_costs), 1e-6).tolist()


def _best_width(c: list[float], step_costs: list[float]) -> int:
    """argmax_k E(k) / step_costs[k] in plain floats (a step runs it per slot: numpy's per-call
    overhead on 6 values would be most of its cost)."""
    best, best_throughput = 0, 1.0 / step_costs[0]
    survival, expected_drafts = 1.0, 0.0
    for k in range(1, len(c) + 1):
        survival *= c[k - 1]
        expected_drafts += survival
        throughput = (1.0 + expected_drafts) / step_costs[k]
        if throughput > best_throughput:  # strict: ties keep the smaller width
            best, best_throughput = k, throughput
    return best


class AdaptiveWidth:
    """The engine's width policy: `choose_width` with the costs measured at start-up. With the
    measured cost of a plain decode call (`decode_cost`, one token and no drafting) it also says
    where drafting does not pay at all (`drafting_pays`)."""

    def __init__(self, verify_costs, draft_cost: float, gamma: int, decode_cost: float | None = None):
        self.verify_costs = floored_costs(verify_costs)
        if self.verify_costs.shape != (gamma + 1,):
            raise ValueError(f"need V(0..{gamma}): {gamma + 1} verify costs, got {len(self.verify_costs)}")
        if not (math.isfinite(draft_cost) and draft_cost >= 0):
            raise ValueError(f"draft_cost={draft_cost}: must be finite and >= 0")
        if decode_cost is not None and not (math.isfinite(decode_cost) and decode_cost > 0):
            raise ValueError(f"decode_cost={decode_cost}: must be finite and > 0 (or None)")
        self.draft_cost, self.gamma, self.decode_cost = float(draft_cost), gamma, decode_cost
        self.step_costs = _step_costs(self.draft_cost, self.verify_costs)  # S(k) = D + V(k), k = 0..gamma
        self._last: dict = {}  # confidences' (shape, bytes) -> E(k): the last two `expected_tokens`

    def repriced(self, verify_costs, decode_cost: float | None) -> "AdaptiveWidth":
        """The same policy at other costs (`live_costs.LiveCosts` moves them after every step), keeping the
        last `expected_tokens`, which do not depend on them: the next step's rows are often the same."""
        policy = AdaptiveWidth(verify_costs, self.draft_cost, self.gamma, decode_cost)
        policy._last = self._last
        return policy

    def __call__(self, confidences) -> int:
        c = [float(x) for x in confidences]
        if len(c) != self.gamma:
            raise ValueError(f"{len(c)} confidences, the drafter proposes gamma={self.gamma}")
        _check_confidences(c)
        return _best_width(c, self.step_costs)

    def widths(self, confidences) -> np.ndarray:
        """`self(row)` for every row of [R, gamma] confidences at once (one numpy pass: for 64 rows
        0.05 ms against 0.16 ms of per-row calls, timeit on the 2-core CPU). The same widths:
        cumprod / cumsum run left to right in float64 as `_best_width` does, and argmax keeps the
        first (smaller) width of a tie."""
        return np.argmax(self._throughputs(confidences), axis=1)

    def drafting_pays(self, confidences) -> np.ndarray:
        """[R] bool: whether the best width's E(k) / (D + V(k)) beats a plain decode call's one token
        per `decode_cost` by more than DRAFT_MARGIN (a tie keeps the cheaper call). All True without a
        decode cost."""
        throughputs = self._throughputs(confidences)
        if self.decode_cost is None:
            return np.ones(throughputs.shape[0], bool)
        return throughputs.max(axis=1) > (1.0 + DRAFT_MARGIN) / self.decode_cost

    def expected_tokens(self, confidences) -> np.ndarray:
        """[R, gamma + 1]: E(k) = 1 + sum_{i<=k} S_i per row and width, of checked [R, gamma] confidences.
        The last two results are kept: an engine step asks for the same rows' stale confidences
        twice (their widths, the step's price) and their averaged ones twice (the pause, the decode
        call's price), and on the H200 the choice is host time in every step of a ~2 ms loop (62 ->
        48 us for the choice and live costs of a 1-row step, timeit on the 2-core CPU)."""
        c = np.asarray(confidences, np.float64)
        key = (c.shape, c.tobytes())
        if key in self._last:
            return self._last[key]
        if c.ndim != 2 or c.shape[1] != self.gamma:
            raise ValueError(f"confidences of shape {c.shape}; pass [rows, gamma={self.gamma}]")
        if not np.all((c >= 0) & (c <= 1)):  # also false for NaN
            raise ValueError(f"confidences={c.tolist()}: each must be a probability in [0, 1]")
        expected = np.concatenate([np.ones((c.shape[0], 1)), 1.0 + np.cumsum(np.cumprod(c, axis=1), axis=1)], axis=1)
        expected.flags.writeable = False  # shared by the callers of the same rows
        self._last = dict([*list(self._last.items())[-1:], (key, expected)])  # the newest two
        return expected

    def _throughputs(self, confidences) -> np.ndarray:
        """[R, gamma + 1]: E(k) / (D + V(k)) per row and width."""
        return self.expected_tokens(confidences) / np.asarray(self.step_costs)


class FallbackBreaker:
    """Per-request acceptance circuit breaker (spec §8): after >= min_drafted verified drafts with an
    acceptance rate below `threshold`, `cooldown` target-only steps, then speculation resumes (the
    first resumed step is a probe). Counters reset at every evaluation (a window, not a total)."""

    def __init__(self, threshold: float, min_drafted: int = 32, cooldown: int = 64):
        if not 0 < threshold <= 1:
            raise ValueError(f"fallback threshold={threshold}: must be in (0, 1] (0 disables the breaker)")
        if min_drafted < 1 or cooldown < 1:
            raise ValueError(f"fallback min_drafted={min_drafted} and cooldown={cooldown} must be >= 1")
        self.threshold, self.min_drafted, self.cooldown = threshold, min_drafted, cooldown
        self.accepted = self.drafted = 0
        self.cooldown_left = 0
        self.probe = False
        self.trips = 0

    def should_speculate(self) -> bool:
        """Called once per step, before drafting."""
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.probe = self.cooldown_left == 0
            return False
        return True

    def record(self, accepted: int, drafted: int) -> None:
        """After a speculative step: `accepted` of `drafted` verified drafts."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted={accepted}, drafted={drafted}: need 0 <= accepted <= drafted")
        self.probe = False
        self.accepted += accepted
        self.drafted += drafted
        if self.drafted < self.min_drafted:
            return
        rate = self.accepted / self.drafted
        self.accepted = self.drafted = 0
        if rate < self.threshold:
            self.cooldown_left = self.cooldown
            self.trips += 1
