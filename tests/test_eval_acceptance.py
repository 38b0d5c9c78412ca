"""scripts/eval_acceptance.py: where a greedy run first departs from the target-only one."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_acceptance.py"
spec = importlib.util.spec_from_file_location("eval_acceptance", SCRIPT)
eval_acceptance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_acceptance)


def test_first_difference_is_the_first_differing_token_or_where_one_run_ends():
    assert eval_acceptance.first_difference([4, 5, 6], [4, 5, 6]) is None
    assert eval_acceptance.first_difference([4, 5, 6], [4, 9, 6]) == 1
    assert eval_acceptance.first_difference([4, 5], [4, 5, 6]) == 2
    assert eval_acceptance.first_difference([], [1]) == 0
