"""Stale confidences corrected to the acceptance they went on to see.

The width choice prices E(k) = sum_i prod_{j<=i} c_j from a request's stale confidences (its
previous proposal's), reading each c_j as the chance that draft j is accepted once drafts 1..j-1
were. The drafter's confidences are not that chance everywhere: on the embedded model, measured on
the CPU (float32, fixed width 5, code prompts), greedy decoding accepted positions 1-3 at 0.82 /
0.79 / 0.75 where the stale confidences said 0.72 / 0.66 / 0.62, and position 5 at 0.48 against
0.57, while sampling at T = 1 matched them within 0.04 (greedy acceptance is an argmax match, not
the min(1, p/q) a confidence head learns). E(5) was priced 2.76 tokens where steps took 3.43.

`Calibration` learns, per position and separately for greedy and sampled rows, the ratio of the
acceptance seen to the stale confidence that preceded it, over the verified rows that reached the
position (a running sum that forgets with `decay` per row), and scales stale confidences by it once
a position has `min_rows` of evidence. It reads only steps already verified: non-anticipating.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class Calibration:
    """Per-position ratios (realized acceptance / stale confidence), greedy and sampled apart."""

    def __init__(self, gamma: int, *, decay: float = 0.995, min_rows: float = 32.0):
        self.decay, self.min_rows = decay, min_rows
        self.reached = np.zeros((2, gamma))  # [greedy?, position]: rows whose verification got to j
        self.accepted = np.zeros((2, gamma))  # of those, rows that accepted draft j
        self.confidence = np.zeros((2, gamma))  # of those, their stale confidences at j, summed

    def observe(self, rows: Iterable, greedy: Iterable[bool]) -> None:
        """Learn from a verified step's rows (`RowRecord`s: stale confidence, width, n_accepted)."""
        positions = np.arange(self.reached.shape[1])
        for row, is_greedy in zip(rows, greedy):
            if not row.width:
                continue
            reached = positions < min(row.width, row.n_accepted + 1)
            g = int(bool(is_greedy))
            for total, value in ((self.reached, reached), (self.accepted, reached & (positions < row.n_accepted)),
                                 (self.confidence, reached * row.stale_confidence)):
                total[g] = self.decay * total[g] + value

    def ratio(self, greedy: bool) -> np.ndarray:
        """[gamma]: what to scale a stale confidence by at each position (1 without enough rows)."""
        g = int(bool(greedy))
        known = (self.reached[g] >= self.min_rows) & (self.confidence[g] > 0)
        return np.where(known, self.accepted[g] / np.where(known, self.confidence[g], 1.0), 1.0)

    def __call__(self, stale: np.ndarray, greedy: bool) -> np.ndarray:
        """Calibrated stale confidences [gamma], in [0, 1]."""
        return np.clip(stale * self.ratio(greedy), 0.0, 1.0).astype(np.float32)
