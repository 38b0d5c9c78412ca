"""A step's rows stacked once (`speculative.stacked`): the same readings as the plain {slot: row} dict."""

import numpy as np
import pytest

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
