"""The time-bounded training loop: probe, fixed total, logging and evaluation points, evaluations
inside the budget. Time is a fake clock that the steps and evaluations advance, so every count is
exact and nothing depends on the machine's speed."""

from jdspark.train import loop


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_run_fixes_the_total_from_the_probe_and_logs_and_evaluates_on_schedule():
    clock, totals, evaluated = FakeClock(), [], []

    def step(i):
        clock.advance(0.5)
        return {"loss": float(i)}

    def evaluate():
        evaluated.append(len(evaluated))
        return {"loss": 0.5}

    record = loop.run(step, 75.0, totals.append, probe=5, log_every=10, evaluate=evaluate, eval_every=20,
                      clock=clock)
    assert totals == [149]  # set once, after the probe: 6 steps (3 s) done, (75 - 3) / 0.5 more after step 5
    assert record["steps"] == 149 and record["seconds"] == 74.5  # the budget, to within a step
    assert record["compile_s"] == 0.5
    steps = [row["step"] for row in record["history"]]
    assert steps == [6] + list(range(10, 149, 10)) + [149]
    assert [row["seconds"] for row in record["history"]][:3] == [3.0, 5.0, 10.0]
    assert record["history"][-1]["loss"] == 148  # the last step's metrics
    with_eval = [row["step"] for row in record["history"] if "heldout_loss" in row]
    assert with_eval == [6] + list(range(20, 149, 20)) + [149]  # one at the probe (6 steps done)
    assert len(evaluated) == len(with_eval)


def test_evaluations_are_part_of_the_budget():
    """Slow evaluations shorten training instead of lengthening the run: 0.5 s steps and 10 s
    evaluations every 10 steps in 500 s are 329 steps (979 if evaluations were free, and the run
    would then take 500 s + 98 evaluations)."""
    clock, totals = FakeClock(), []
    evaluations = []

    def evaluate():
        evaluations.append(clock())
        clock.advance(10.0)
        return {"loss": 0.0}

    record = loop.run(lambda i: clock.advance(0.5) or {"loss": 0.0}, 500.0, totals.append, probe=5,
                      log_every=10, evaluate=evaluate, eval_every=10, clock=clock)
    # at the probe: 6 steps (3 s) + the evaluation (10 s) done; a step costs 0.5 + 10 / 10 s from then on
    assert totals == [int((500 - 13) / 1.5) + 5] == [329]
    assert len(evaluations) == 1 + 32 + 1  # the probe's, every 10 steps, the last step's
    assert record["seconds"] == 329 * 0.5 + 34 * 10.0
    assert record["seconds"] <= 500 + 10  # over the budget by at most the final evaluation
