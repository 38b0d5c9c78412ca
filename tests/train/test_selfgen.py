"""Self-generated drafter data: each row is its prompt plus what the engine samples for it."""

import numpy as np
import pytest

from jdspark.engine.request import SamplingParams
from jdspark.train import drafter, selfgen
from tests.conftest import generate_to_end


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_are_the_engine_samples_of_each_prompt_alone(target_engine, temperature):
    """On a target-only engine, as train_drafter runs selfgen (no widths that could depend on the
    other rows of a batch)."""
    prompts = np.random.default_rng(0).integers(4, 16, (3, 6)).astype(np.int32)  # 3 rows over 2 slots
    rows = selfgen.sample_continuations(target_engine, prompts, 7, temperature, seed=11)
    assert rows.shape == (3, 13) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[:, :6], prompts)
    for i, prompt in enumerate(prompts):
        alone = generate_to_end(target_engine, prompt, SamplingParams(max_tokens=7, temperature=temperature,
                                                                    seed=11 + i, ignore_eos=True))
        assert rows[i, 6:].tolist() == alone.token_ids


def test_anchors_stay_out_of_the_prompt_rows_that_have_one():
    anchors = drafter.sample_anchors(np.random.default_rng(1), 4, 64, 5, 10, low=np.array([20, 20, 1, 1]))
    assert anchors[:2].min() >= 20 and anchors[2:].min() >= 1 and anchors.max() + 5 <= 63
