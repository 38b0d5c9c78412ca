"""V(k) measurement: warm-up, then timed calls, each after an untimed reset; cached per key."""

import time

from jdspark.engine import costs


def test_reset_runs_before_every_call_and_is_not_timed(tmp_path):
    calls = []

    def run(k):
        calls.append(("run", k))
        time.sleep(0.001 * (k + 1))

    def reset():
        calls.append(("reset",))
        time.sleep(0.02)  # would dominate the medians if it were timed

    measured = costs.load_or_measure("key", run, [0, 2], 3, tmp_path, reprofile=False, reset=reset)
    assert calls[:4] == [("reset",), ("run", 0), ("reset",), ("run", 0)]
    assert sum(c == ("reset",) for c in calls) == sum(c[0] == "run" for c in calls) == 8  # 2 x (warm-up + 3)
    assert 0.001 <= measured[0] < 0.015 and 0.003 <= measured[1] < 0.018
    calls.clear()
    assert costs.load_or_measure("key", run, [0, 2], 3, tmp_path, reprofile=False, reset=reset) == measured
    assert calls == []  # served from the cache
