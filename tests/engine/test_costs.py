"""Cost measurement: warm-up, then timed calls, each after an untimed reset; cached per key and labels."""

import time

from jdspark.engine import costs


def test_reset_runs_before_every_call_and_is_not_timed(tmp_path):
    calls = []

    def run(label):
        calls.append(("run", label))
        time.sleep(0.001 * (int(label[-1]) + 1))

    def reset():
        calls.append(("reset",))
        time.sleep(0.02)  # would dominate the medians if it were timed

    measured = costs.load_or_measure("key", run, ["step0", "step2"], 3, tmp_path, reprofile=False, reset=reset)
    assert calls[:4] == [("reset",), ("run", "step0"), ("reset",), ("run", "step0")]
    assert sum(c == ("reset",) for c in calls) == sum(c[0] == "run" for c in calls) == 8  # 2 x (warm-up + 3)
    assert list(measured) == ["step0", "step2"]
    assert 0.001 <= measured["step0"] < 0.015 and 0.003 <= measured["step2"] < 0.018
    calls.clear()
    assert costs.load_or_measure("key", run, ["step0", "step2"], 3, tmp_path, reprofile=False, reset=reset) == measured
    assert calls == []  # served from the cache
    assert costs.load_or_measure("key", run, ["step0"], 3, tmp_path, reprofile=False, reset=reset).keys() == {"step0"}
    assert calls  # other labels: measured again
