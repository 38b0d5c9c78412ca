"""A step's rows' confidences by slot, stacked once.

The width choice reads a step's stale confidences both row by row ({slot: [gamma]}) and as one
[rows, gamma] matrix (calibration, E(k), pauses, the step's price: four to six times a step). Built
as a dict, each reading stacked the rows again: stacking them once took an adaptive step at 64 rows
from 943 to 875 us of host time (`scripts/bench_engine_host.py`, the 2-core CPU). `StackedRows`
is the same mapping over one matrix, and `stack` hands out that matrix (or its rows in another order)
without copying the rows one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


class StackedRows(Mapping):
    """{slot: [gamma] row} over one [rows, gamma] matrix, in `slots` order. Read-only: a choice that
    changes rows builds another (`with_matrix`)."""

    def __init__(self, slots: Iterable[int], matrix: np.ndarray, _index: dict[int, int] | None = None):
        self.slots = slots if isinstance(slots, list) else list(slots)  # shared by `with_matrix`
        self.matrix = matrix
        if matrix.ndim != 2 or matrix.shape[0] != len(self.slots):
            raise ValueError(f"{len(self.slots)} slots but a matrix of shape {matrix.shape}: one row per slot")
        self._index = _index  # slot -> row, built when first asked for (most steps read whole matrices)

    @property
    def index(self) -> dict[int, int]:
        if self._index is None:
            self._index = {b: i for i, b in enumerate(self.slots)}
        return self._index

    @classmethod
    def of(cls, rows: Mapping[int, np.ndarray]) -> StackedRows:
        """The rows of a {slot: [gamma]} mapping, stacked (itself if already stacked)."""
        if isinstance(rows, StackedRows):
            return rows
        return cls(rows, np.array(list(rows.values())))

    def with_matrix(self, matrix: np.ndarray) -> StackedRows:
        """The same slots over another matrix (the rows changed in one array operation)."""
        return StackedRows(self.slots, matrix, self._index)

    def __getitem__(self, slot: int) -> np.ndarray:
        return self.matrix[self.index[slot]]

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, slots: list[int]) -> np.ndarray:
        """[len(slots), gamma]: these slots' rows in this order (the matrix itself if they are all, in order)."""
        if slots == self.slots:
            return self.matrix
        return self.matrix[[self.index[b] for b in slots]]


def stack(rows: Mapping[int, np.ndarray], slots: list[int]) -> np.ndarray:
    """[len(slots), gamma]: the rows of these slots, in this order, from a dict or a `StackedRows`."""
    if isinstance(rows, StackedRows):
        return rows.take(slots)
    return np.array([rows[b] for b in slots])
