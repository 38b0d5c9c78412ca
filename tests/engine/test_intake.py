"""The prefill options checked before anything compiles (`intake.prefill_chunk_of`)."""

import numpy as np
import pytest

from jdspark.engine.errors import EngineError
from jdspark.engine.intake import prefill_chunk_of


def test_the_chunk_is_at_most_the_context():
    assert prefill_chunk_of(256, None, 128) == 128
    assert prefill_chunk_of(np.int64(32), 64, 128) == 32


@pytest.mark.parametrize("chunk, budget, message", [
    (0, None, "prefill_chunk=0: a prefill row takes at least 1 prompt token"),
    (-4, None, "prefill_chunk=-4"),
    (2.5, None, "prefill_chunk=2.5"),
    (True, None, "prefill_chunk=True"),
    (32, 0, "prefill_budget=0: use at least 1 prompt token a step"),
    (32, -1, "prefill_budget=-1"),
])
def test_a_chunk_or_budget_under_one_token_is_refused_by_name(chunk, budget, message):
    with pytest.raises(EngineError, match=message):
        prefill_chunk_of(chunk, budget, 128)
