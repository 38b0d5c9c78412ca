"""Stale confidences calibrated to the acceptance the engine saw (`speculative.calibration`): the
ratios learn realized / stated acceptance per position from verified rows only (greedy and sampled
apart, positions a row did not reach left out), and apply once a position has enough rows."""

import numpy as np
import pytest

from jdspark.engine.stats import RowRecord
from jdspark.speculative.calibration import Calibration
from jdspark.speculative.stacked import StackedRows

GAMMA = 5


def rows_accepting(rng, n, confidence, rates, width=GAMMA):
    """n rows stating `confidence` whose draft j is accepted with probability rates[j] once j - 1 were."""
    out = []
    for i in range(n):
        accepted = 0
        while accepted < width and rng.random() < rates[accepted]:
            accepted += 1
        out.append(RowRecord(i, np.asarray(confidence, np.float32), accepted, (), width))
    return out


def test_the_ratio_learns_realized_over_stated_acceptance_per_position():
    rng = np.random.default_rng(0)
    calibration = Calibration(GAMMA, decay=1.0, min_rows=32, fold_every=1)
    rates, stated = np.array([0.9, 0.8, 0.7, 0.6, 0.5]), np.full(GAMMA, 0.6)
    rows = rows_accepting(rng, 4000, stated, rates)
    calibration.observe(rows, [True] * len(rows))
    np.testing.assert_allclose(calibration.ratio(True), rates / stated, atol=0.05)
    np.testing.assert_allclose(calibration(stated, True), rates, atol=0.03)
    np.testing.assert_array_equal(calibration.ratio(False), np.ones(GAMMA))  # sampled rows: none seen
    assert np.all(calibration(np.full(GAMMA, 0.99), True) <= 1.0)


def test_positions_past_a_rows_width_or_its_first_rejection_are_not_evidence():
    calibration = Calibration(GAMMA, decay=1.0, min_rows=1, fold_every=1)
    calibration.observe([RowRecord(0, np.full(GAMMA, 0.5, np.float32), 1, (), 3)], [False])
    np.testing.assert_array_equal(calibration.reached[0], [1, 1, 0, 0, 0])  # reached draft 2, rejected it
    np.testing.assert_array_equal(calibration.accepted[0], [1, 0, 0, 0, 0])
    calibration.observe([RowRecord(1, np.full(GAMMA, 0.5, np.float32), 2, (), 2)], [False])  # all of width 2
    np.testing.assert_array_equal(calibration.reached[0], [2, 2, 0, 0, 0])
    np.testing.assert_array_equal(calibration.ratio(False), [2.0, 1.0, 1.0, 1.0, 1.0])
    calibration.observe([RowRecord(2, np.full(GAMMA, 0.5, np.float32), 0, (), 0)], [False])  # decoded: nothing
    np.testing.assert_array_equal(calibration.reached[0], [2, 2, 0, 0, 0])


def test_too_few_rows_leave_the_confidences_as_stated():
    calibration = Calibration(GAMMA, decay=1.0, min_rows=32, fold_every=1)
    rows = rows_accepting(np.random.default_rng(1), 20, np.full(GAMMA, 0.3), np.ones(GAMMA))
    calibration.observe(rows, [True] * len(rows))
    stated = np.linspace(0.2, 0.6, GAMMA).astype(np.float32)
    np.testing.assert_array_equal(calibration(stated, True), stated)


def test_a_step_of_rows_learns_what_its_rows_one_at_a_time_teach():
    """Folding many rows at once (greedy and sampled mixed) gives the sums of folding them one by one,
    decay included; rows wait for the fold (`fold_every`) before the ratios move."""
    rng = np.random.default_rng(2)
    rows = rows_accepting(rng, 40, rng.random(GAMMA), [0.9, 0.7, 0.6, 0.5, 0.4])
    greedy = rng.random(len(rows)) < 0.5
    together, alone = Calibration(GAMMA, decay=0.9, min_rows=1), Calibration(GAMMA, decay=0.9, fold_every=1)
    together.observe(rows, greedy)
    np.testing.assert_array_equal(together.reached, 0)  # 40 rows: short of a fold of 64
    np.testing.assert_array_equal(together.ratio(True), np.ones(GAMMA))
    together.fold()
    assert not np.all(together.ratio(True) == 1)
    for row, g in zip(rows, greedy):
        alone.observe([row], [g])
    for name in ("reached", "accepted", "confidence"):
        np.testing.assert_allclose(getattr(together, name), getattr(alone, name), rtol=1e-12)


def test_a_fold_waits_for_fold_steps_steps_as_well_as_fold_every_rows():
    """With many rows a step the rows are enough every step; `fold_steps` keeps folds that far apart, and the
    folded sums are those of folding every step."""
    rng = np.random.default_rng(4)
    steps = [rows_accepting(rng, 8, rng.random(GAMMA), [0.9, 0.7, 0.6, 0.5, 0.4]) for _ in range(6)]
    every, apart = (Calibration(GAMMA, decay=0.9, min_rows=1, fold_every=8, fold_steps=n) for n in (1, 3))
    for i, rows in enumerate(steps):
        every.observe(rows, [True] * len(rows))
        apart.observe(rows, [True] * len(rows))
        assert (apart.reached.sum() > 0) == (i >= 2)  # the first fold after the third step
        if i in (2, 5):
            np.testing.assert_allclose(apart.reached, every.reached, rtol=1e-12)
            np.testing.assert_allclose(apart.ratio(True), every.ratio(True), rtol=1e-6)
        elif i > 2:
            assert not np.allclose(apart.reached, every.reached)  # waiting: the last fold's sums


def test_a_step_of_many_rows_is_scaled_as_each_row_alone():
    """`apply` scales many rows in one array operation and few one by one: the same bits either way,
    greedy and sampled rows mixed, one kind learned and the other not (fresh random confidences)."""
    rng = np.random.default_rng(3)
    calibration = Calibration(GAMMA, decay=1.0, min_rows=1, fold_every=1)
    calibration.observe(rows_accepting(rng, 50, rng.random(GAMMA), [0.9, 0.8, 0.7, 0.6, 0.5]), [True] * 50)
    for n in (1, 3, 16, 64):
        stale = {3 * b: rng.random(GAMMA).astype(np.float32) for b in range(n)}
        greedy = {b: b % 2 == 0 for b in stale}  # the first row greedy (learned), then alternating
        scaled = calibration.apply(stale, greedy)
        for b in stale:
            alone = calibration(stale[b], greedy[b])
            assert scaled[b].dtype == alone.dtype and np.array_equal(scaled[b], alone)
        assert any(not np.array_equal(scaled[b], stale[b]) for b in stale if greedy[b])


@pytest.mark.parametrize("count", [1, 4, 5, 64])
def test_calibration_scales_stacked_rows_as_it_scales_them_one_by_one(count):
    rng = np.random.default_rng(count)
    calibration = Calibration(GAMMA, decay=1.0, min_rows=1, fold_every=1)
    for greedy in (False, True):
        accepted = rng.integers(0, GAMMA + 1, 40)
        calibration.observe([RowRecord(i, rng.random(GAMMA).astype(np.float32), int(n), (), GAMMA)
                             for i, n in enumerate(accepted)], [greedy] * 40)
    rows = {b: rng.random(GAMMA).astype(np.float32) for b in rng.permutation(100)[:count].tolist()}
    greedy = {b: bool(rng.integers(2)) for b in rows}
    stacked = calibration.apply(StackedRows.of(rows), greedy)
    assert isinstance(stacked, StackedRows) and list(stacked) == list(rows)
    for b, row in rows.items():
        np.testing.assert_array_equal(stacked[b], calibration(row, greedy[b]))
