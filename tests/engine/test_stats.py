"""A request's statistics (`engine.stats.CompletionStats`)."""

import numpy as np

from jdspark.engine.stats import CompletionStats, RowRecord, StepRecord

GAMMA = 5


def test_a_requests_acceptance_counts_come_from_its_histograms():
    """`CompletionStats.verified_at` / `accepted_at` (kept as histograms of widths and accepted drafts)
    count, per position, the steps that verified it and those whose accepted prefix reached it."""
    stats = CompletionStats.empty(4, GAMMA)
    step = StepRecord(5, 0.001, (), 0.0, None, 1)
    for width, accepted in ((5, 2), (3, 3), (0, 0), (5, 5), (1, 0)):
        stats.record(step, RowRecord(0, np.ones(GAMMA, np.float32), accepted, (), width))
    assert stats.verified_at == [4, 3, 3, 2, 2]
    assert stats.accepted_at == [3, 3, 2, 1, 1]
    assert stats.acceptance == [0.75, 1.0, 2 / 3, 0.5, 0.5]
    assert stats.steps == 5 and stats.tau == (3 + 4 + 1 + 6 + 1) / 5
