"""A step's rows stacked once (`speculative.stacked`), and the host path that reads them as matrices:
each reading equals the same reading of the plain {slot: row} dict it replaced."""

import numpy as np
import pytest

from jdspark.engine.options import SpecOptions
from jdspark.engine.request import SamplingParams
from jdspark.engine.sequence import TYPICAL_WEIGHT, Sequence, moved_averages
from jdspark.engine.stats import CompletionStats, RowRecord, StepRecord
from jdspark.engine.widths import judged, within_room
from jdspark.speculative.calibration import Calibration
from jdspark.speculative.stacked import StackedRows, stack

GAMMA = 5


def rows_of(rng, slots):
    return {b: rng.random(GAMMA).astype(np.float32) for b in slots}


def test_stacked_rows_read_as_the_dict_they_stack():
    rng = np.random.default_rng(0)
    rows = rows_of(rng, [7, 2, 40, 5])
    stacked = StackedRows.of(rows)
    assert list(stacked) == [7, 2, 40, 5] and len(stacked) == 4 and 40 in stacked and 3 not in stacked
    for b, row in rows.items():
        np.testing.assert_array_equal(stacked[b], row)
    assert stack(stacked, [7, 2, 40, 5]) is stacked.matrix  # all rows in order: the matrix itself
    for order in ([40, 7], [5, 2, 7, 40], [2]):
        np.testing.assert_array_equal(stack(stacked, order), stack(rows, order))
        np.testing.assert_array_equal(stack(rows, order), np.array([rows[b] for b in order]))
    assert StackedRows.of(stacked) is stacked
    with pytest.raises(ValueError, match="one row per slot"):
        StackedRows([1, 2], np.zeros((3, GAMMA)))


@pytest.mark.parametrize("count", [1, 4, 5, 64])
def test_calibration_scales_stacked_rows_as_it_scales_them_one_by_one(count):
    rng = np.random.default_rng(count)
    calibration = Calibration(GAMMA, decay=1.0, min_rows=1, fold_every=1)
    for greedy in (False, True):
        accepted = rng.integers(0, GAMMA + 1, 40)
        calibration.observe([RowRecord(i, rng.random(GAMMA).astype(np.float32), int(n), (), GAMMA)
                             for i, n in enumerate(accepted)], [greedy] * 40)
    rows = rows_of(rng, rng.permutation(100)[:count].tolist())
    greedy = {b: bool(rng.integers(2)) for b in rows}
    stacked = calibration.apply(StackedRows.of(rows), greedy)
    assert isinstance(stacked, StackedRows) and list(stacked) == list(rows)
    for b, row in rows.items():
        np.testing.assert_array_equal(stacked[b], calibration(row, greedy[b]))


def test_room_clipping_of_stacked_rows_equals_the_dicts():
    rng = np.random.default_rng(3)
    lengths = {0: 10, 1: 64, 2: 9, 3: 64, 4: 12}
    sequences = {}
    for b, max_tokens in lengths.items():
        sequences[b] = Sequence(b, 4, SamplingParams(max_tokens=max_tokens), seed=0, gamma=GAMMA, eos_token_id=None,
                                tokenizer=None, breaker=None)
        sequences[b].tokens = [7] * 6
    rows, typical = rows_of(rng, lengths), rows_of(rng, lengths)
    plain = within_room(rows, typical, sequences)
    stacked = within_room(StackedRows.of(rows), StackedRows.of(typical), sequences)
    for got, want in zip(stacked, plain):
        assert isinstance(got, StackedRows)
        for b in lengths:
            np.testing.assert_array_equal(got[b], want[b])
    np.testing.assert_array_equal(stacked[0][2], np.float32([1, 1, 0, 0, 0]) * rows[2])  # room 9 - 6 - 1 = 2


def test_the_choice_stacks_many_rows_once_and_leaves_few_as_dicts():
    """`judged` hands the choice stacked rows past `calibration.ROWS_ONE_BY_ONE` rows (a dict at fewer:
    stacking costs a lone request more than it saves), with each row's `Sequence.typical` where it has one."""
    rng = np.random.default_rng(4)
    options = SpecOptions(pause_steps=32, calibrate=False)
    for count, kind in ((3, dict), (6, StackedRows)):
        sequences = {b: Sequence(b, 4, SamplingParams(max_tokens=64), seed=0, gamma=GAMMA, eos_token_id=None,
                                 tokenizer=None, breaker=None) for b in range(count)}
        sequences[1].typical = np.full(GAMMA, 0.25, np.float32)
        stale, typical = judged(rows_of(rng, range(count)), sequences, None, options, True)
        assert isinstance(stale, kind) and isinstance(typical, kind)
        np.testing.assert_array_equal(typical[1], sequences[1].typical)
        np.testing.assert_array_equal(typical[0], stale[0])  # no average yet: its stale proposal


def test_a_steps_averages_move_as_each_rows_would_alone():
    rng = np.random.default_rng(5)
    before = [None, rng.random(GAMMA).astype(np.float32), rng.random(GAMMA).astype(np.float32)]
    proposed = rng.random((3, GAMMA)).astype(np.float32)
    after = moved_averages(before, proposed)
    assert after.dtype == np.float32
    np.testing.assert_array_equal(after[0], proposed[0])
    for i in (1, 2):
        np.testing.assert_array_equal(after[i], before[i] + TYPICAL_WEIGHT * (proposed[i] - before[i]))


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
