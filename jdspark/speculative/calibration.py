"""Stale confidences corrected to the acceptance they went on to see.

The width choice prices E(k) = sum_i prod_{j<=i} c_j from a request's stale confidences (its
previous proposal's), reading each c_j as the chance that draft j is accepted once drafts 1..j-1
were. The drafter's confidences are not that chance everywhere: on the embedded model
(`scripts/eval_calibration.py`: CPU, float32, fixed width 5, code prompts) greedy decoding accepted
positions 1-4 more often than the stale confidences said and position 5 less (learned ratios 1.17,
1.33, 1.27, 1.17, 0.73), so E(5) was priced 2.82 tokens where the steps took 3.24; at T = 1 the
ratios stay within 6% of 1 but at position 4 (greedy acceptance is an argmax match, not the
min(1, p/q) a confidence head learns).

`Calibration` learns, per position and separately for greedy and sampled rows, the ratio of the
acceptance seen to the stale confidence that preceded it, over the verified rows that reached the
position (a running sum that forgets with `decay` per row), and scales stale confidences by it once
a position has `min_rows` of evidence. It reads only steps already verified: non-anticipating.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from jdspark.speculative.stacked import StackedRows

ROWS_ONE_BY_ONE = 4  # `Calibration.apply` scales at most this many rows one by one (faster for few)


class Calibration:
    """Per-position ratios (realized acceptance / stale confidence), greedy and sampled apart. Rows
    are folded into the sums once `fold_every` of them wait and `fold_steps` steps were observed since
    the last fold (the choice reads the ratios of the last fold), so a step pays a list append per
    row, not array work: with 64 rows a step, folding on every step cost the 2-core CPU 82 us a step
    (timeit), one fold every 4 steps 42."""

    def __init__(self, gamma: int, *, decay: float = 0.995, min_rows: float = 32.0, fold_every: int = 64,
                 fold_steps: int = 1):
        self.decay, self.min_rows, self.fold_every, self.fold_steps = decay, min_rows, fold_every, fold_steps
        self._steps = 0  # steps observed since the last fold
        self.reached = np.zeros((2, gamma))  # [greedy?, position]: rows whose verification got to j
        self.accepted = np.zeros((2, gamma))  # of those, rows that accepted draft j
        self.confidence = np.zeros((2, gamma))  # of those, their stale confidences at j, summed
        self._pending: list[tuple] = []  # (greedy, stale confidence, width, n_accepted) not folded yet
        # [sampled, greedy] x position: the ratios the choice reads (ones where a position has too few rows);
        # None while neither side has any: the confidences as stated
        self._ratios: np.ndarray | None = None

    def observe(self, rows: Iterable, greedy: Iterable[bool]) -> None:
        """A verified step's rows (`RowRecord`s: stale confidence, width, n_accepted), in order."""
        self._pending += [(bool(g), row.stale_confidence, row.width, row.n_accepted)
                          for row, g in zip(rows, greedy) if row.width]
        self._steps += 1
        if len(self._pending) >= self.fold_every and self._steps >= self.fold_steps:
            self.fold()

    def fold(self) -> None:
        """Add the pending rows to the sums (the same sums as one row at a time, each decayed by
        `decay` per later row) and update the ratios the choice reads."""
        if not self._pending:
            return
        greedy, stale, width, n = (np.array(column) for column in zip(*self._pending))
        self._pending, self._steps = [], 0
        positions = np.arange(self.reached.shape[1])[None]
        reached = positions < np.minimum(width, n + 1)[:, None]
        values = (reached, reached & (positions < n[:, None]), reached * stale)
        ratios = np.ones((2, self.reached.shape[1]), np.float32)
        for g in (False, True):
            mine = greedy == g
            count = int(mine.sum())
            if count:
                weights = self.decay ** np.arange(count - 1, -1, -1.0)  # the last row weighs 1
                for total, value in zip((self.reached, self.accepted, self.confidence), values):
                    total[int(g)] = self.decay ** count * total[int(g)] + weights @ value[mine]
            known = (self.reached[int(g)] >= self.min_rows) & (self.confidence[int(g)] > 0)
            ratios[int(g)] = np.where(known, self.accepted[int(g)] / np.where(known, self.confidence[int(g)], 1.0), 1.0)
        self._ratios = ratios if (ratios != 1).any() else None

    def ratio(self, greedy: bool) -> np.ndarray:
        """[gamma]: what the choice scales a stale confidence by at each position (1: too few rows)."""
        return np.ones(self.reached.shape[1], np.float32) if self._ratios is None else self._ratios[int(greedy)]

    def apply(self, stale: Mapping[int, np.ndarray], greedy: Mapping[int, bool]) -> Mapping[int, np.ndarray]:
        """Calibrated stale confidences [gamma] of a step's rows (by slot), each at most 1. A step
        pays this on the host: rows already stacked (`StackedRows`) or more than `ROWS_ONE_BY_ONE` in
        one array operation, else row by row (timeit, the 2-core CPU: 1.0 us for 1 row one by one
        against 3.2 in one operation, 14.9 against 7.2 for 16, 60.4 against 20.1 for 64, from dicts)."""
        if self._ratios is None:
            return stale
        if not isinstance(stale, StackedRows) and len(stale) <= ROWS_ONE_BY_ONE:
            return {b: np.minimum(c * self._ratios[int(greedy[b])], np.float32(1.0)) for b, c in stale.items()}
        rows = StackedRows.of(stale)
        flags = np.fromiter((greedy[b] for b in rows.slots), bool, len(rows)).view(np.uint8)
        return rows.with_matrix(np.minimum(rows.matrix * self._ratios[flags], np.float32(1.0)))

    def __call__(self, stale: np.ndarray, greedy: bool) -> np.ndarray:
        """One row's calibrated stale confidences [gamma]."""
        return self.apply({0: stale}, {0: greedy})[0]
