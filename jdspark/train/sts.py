"""Sequential temperature scaling of the confidence head (spec dspark.md §10).

For k = 1..gamma in order, with T_1..T_{k-1} fixed, pick T_k on a log grid to minimise the expected
calibration error (equal-width bins) of the cumulative product prod_{i<=k} sigmoid(z_i / T_i)
against the prefix-acceptance indicator. Temperature scaling keeps each position's ranking.
"""

from __future__ import annotations

import numpy as np

GRID = np.exp(np.linspace(np.log(0.125), np.log(8.0), 49))  # VLLM's online-STS grid


def ece(predicted: np.ndarray, observed: np.ndarray, bins: int = 20) -> float:
    """Expected calibration error: sum over bins of |mean(pred) - mean(obs)| weighted by bin size."""
    which = np.minimum((predicted * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.mean() * abs(predicted[sel].mean() - observed[sel].mean())
    return float(total)


def prefix_accepted(accept_prob: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sampled prefix-acceptance indicators [N, gamma] from conditional acceptance probabilities."""
    return np.cumprod(rng.random(accept_prob.shape) < accept_prob, axis=1).astype(np.float64)


def fit(z: np.ndarray, prefix: np.ndarray, bins: int = 20) -> tuple[list[float], list[float], list[float]]:
    """(temperatures, ECE before, ECE after) per position; z raw logits [N, gamma]."""
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    temps, before, after = [], [], []
    running = np.ones(len(z))
    raw_running = np.ones(len(z))
    for k in range(z.shape[1]):
        raw_running = raw_running * sigmoid(z[:, k])
        before.append(ece(raw_running, prefix[:, k], bins))
        errors = [ece(running * sigmoid(z[:, k] / t), prefix[:, k], bins) for t in GRID]
        best = float(GRID[int(np.argmin(errors))])
        temps.append(best)
        running = running * sigmoid(z[:, k] / best)
        after.append(min(errors))
    return temps, before, after
