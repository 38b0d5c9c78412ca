"""The multi-request verification budget (spec dspark.md §9, the paper's Algorithm 1).

Given every running request's stale confidences, choose how many drafts each verifies this step:
candidates (r, j) — request r verifying its j-th draft — ranked by survival a_{r,j} = prod_{i<=j}
c_{r,i}, taken best-first; the allocation after each candidate has expected tokens
tau = R + sum of the taken survivals and costs `step_cost(tokens, widest)`; the best tau / cost
over all prefixes wins (ties keep the fewer drafts).

Non-anticipating by construction: it reads only stale confidences (the previous proposal's, never
the block being verified), so the search may run over every prefix without the early `break` that
Algorithm 1 needs on current confidences (spec §5.7, §9.2). Because survival never increases along
a request's drafts, the ranking takes each request's drafts in order: every prefix is a set of
per-request widths.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

StepCost = Callable[[int, int], float]  # (verified tokens in the batch, widest width) -> seconds


def allocate_widths(stale_confidences, step_cost: StepCost) -> np.ndarray:
    """Per-request widths [R] (int) that maximise expected tokens per second.

    stale_confidences: [R, gamma] conditional acceptance probabilities in [0, 1];
    step_cost(tokens, widest): the step's seconds when it verifies `tokens` rows in all (R + drafts)
    and its widest request verifies `widest` drafts (padded execution: D + V(widest); a flattened
    verification: a function of tokens)."""
    c = np.asarray(stale_confidences, np.float64)
    if c.ndim != 2:
        raise ValueError(f"stale_confidences has shape {c.shape}; pass [requests, gamma]")
    if not np.all((c >= 0) & (c <= 1)):  # also false for NaN
        raise ValueError(f"stale_confidences={c.tolist()}: each must be a probability in [0, 1]")
    requests, gamma = c.shape
    survival = np.cumprod(c, axis=1)
    r_index, j_index = np.nonzero(survival > 0)
    order = np.lexsort((j_index, r_index, -survival[r_index, j_index]))  # best first; ties: request, then draft
    widths = np.zeros(requests, np.int64)
    best_widths, tokens, widest, tau = widths.copy(), requests, 0, float(requests)
    best = tau / _checked(step_cost(tokens, widest), tokens, widest)
    for r, j in zip(r_index[order].tolist(), j_index[order].tolist()):
        widths[r] = j + 1
        tokens, widest, tau = tokens + 1, max(widest, j + 1), tau + survival[r, j]
        throughput = tau / _checked(step_cost(tokens, widest), tokens, widest)
        if throughput > best:  # strict: ties keep the fewer drafts
            best, best_widths = throughput, widths.copy()
    return best_widths


def _checked(cost: float, tokens: int, widest: int) -> float:
    if not (math.isfinite(cost) and cost > 0):
        raise ValueError(f"step_cost({tokens}, {widest})={cost}: must be finite and > 0")
    return cost


def padded_cost(draft_cost: float, verify_costs) -> StepCost:
    """The cost of a padded verification (every row computes the widest width's rows): D + V(widest)."""
    v = [float(x) for x in verify_costs]
    return lambda tokens, widest: max(draft_cost + v[widest], 1e-6)
