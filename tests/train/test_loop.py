"""The time-bounded training loop: probe, fixed total, logging and evaluation points, evaluations
inside the budget."""

import time

from jdspark.train import loop


def test_run_fixes_the_total_from_the_probe_and_logs_and_evaluates_on_schedule():
    totals, evaluated = [], []

    def step(i):
        time.sleep(0.002)
        return {"loss": float(i)}

    def evaluate():
        evaluated.append(len(evaluated))
        return {"loss": 0.5}

    record = loop.run(step, 0.3, totals.append, probe=5, log_every=10, evaluate=evaluate, eval_every=20)
    assert len(totals) == 1  # the schedule length is set once, after the probe
    total = totals[0]
    assert 20 < total < 300  # ~2 ms steps in a 0.3 s budget
    assert record["steps"] == total
    steps = [row["step"] for row in record["history"]]
    assert steps == [6] + sorted(set(range(10, total + 1, 10)) | {total})
    assert record["history"][-1]["loss"] == total - 1  # the last step's metrics
    with_eval = [row["step"] for row in record["history"] if "heldout_loss" in row]
    assert with_eval == [6] + sorted(set(range(20, total + 1, 20)) | {total})  # one at the probe (6 steps done)
    assert len(evaluated) == len(with_eval)


def test_evaluations_are_part_of_the_budget():
    """Slow evaluations shorten training instead of lengthening the run (4 ms steps, 100 ms
    evaluations every 10 steps: 250 steps and 2.5 s of evaluation if they were not counted)."""
    totals = []
    record = loop.run(lambda i: time.sleep(0.004) or {"loss": 0.0}, 1.0, totals.append, probe=5, log_every=10,
                      evaluate=lambda: time.sleep(0.1) or {"loss": 0.0}, eval_every=10)
    assert totals[0] < 100
    assert record["seconds"] < 1.8
