"""scripts/eval_calibration.py: its engine is the serving bench's, and its replay prices widths."""

import importlib.util
from pathlib import Path

import numpy as np

from jdspark.engine.stats import RowRecord

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("eval_calibration", SCRIPTS / "eval_calibration.py")
eval_calibration = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eval_calibration)


def test_engine_args_are_every_option_of_the_serving_bench():
    """Built by the bench's own parser, so an option added there is never missing here (a hand-made
    namespace had lost `--dequantize`, and the script failed before measuring anything)."""
    import bench_serve_engine  # on the path: eval_calibration puts its folder there
    args = eval_calibration.engine_args()
    defaults = vars(bench_serve_engine.parser().parse_args([]))
    assert set(vars(args)) == set(defaults)
    assert (args.dtype, args.max_running, args.buckets, args.widths) == ("float32", 1, [1], [5])


def test_replay_counts_tokens_up_to_each_chosen_width():
    rows = [RowRecord(0, np.full(5, 0.9, np.float32), n_accepted=4, emitted=(1,) * 5, width=5),
            RowRecord(0, np.full(5, 0.1, np.float32), n_accepted=0, emitted=(1,), width=5)]
    costs = np.array([1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    # width 2 for both: min(4, 2) + 1 and min(0, 2) + 1 tokens over two steps of cost 1
    assert eval_calibration.replay(rows, lambda c: 2, costs) == (3 + 1) / 2.0
    # width 5 for the first, 0 for the second: 5 + 1 tokens over costs 2 + 1
    assert eval_calibration.replay(rows, lambda c: 5 if c[0] > 0.5 else 0, costs) == 6 / 3.0


def test_pause_replay_judged_on_one_step_pauses_where_the_average_does_not():
    """A request that accepts 4 drafts a step, whose proposals say so except once: judged on one step,
    that proposal pauses it for 32 decoded tokens; judged on the average it drafts on, as fixed width
    5 does. Where every proposal and step is poor, both pause alike."""
    from jdspark.speculative.selector import AdaptiveWidth
    selector = AdaptiveWidth([1.66] * 6, 0.0, 5, decode_cost=0.88)

    def rows(confidences, accepted):
        return [RowRecord(0, np.full(5, c, np.float32), n_accepted=accepted, emitted=(), width=5) for c in confidences]

    steady = rows([0.95] * 20 + [0.1] + [0.95] * 40, 4)
    fixed5 = eval_calibration.replay(steady, lambda c: 5, np.full(6, 1.66))
    one_step = eval_calibration.replay_pauses(steady, lambda c: c, selector, None)
    average = eval_calibration.replay_pauses(steady, lambda c: c, selector, 0.25)
    assert average == fixed5 and one_step < 0.9 * fixed5  # 32 tokens at 0.88 ms against 5 a 1.66 ms step
    poor = rows([0.1] * 200, 0)
    assert eval_calibration.replay_pauses(poor, lambda c: c, selector, None) == \
        eval_calibration.replay_pauses(poor, lambda c: c, selector, 0.25) > 1 / 1.66


def test_pause_replay_seeded_with_the_recent_average_does_not_pause_on_a_low_first_proposal():
    """A request whose first proposal is low but which accepts 4 drafts a step: its average from that
    proposal alone pauses it; seeded with the recent average of other requests (`seed`) it drafts on."""
    from jdspark.speculative.selector import AdaptiveWidth
    selector = AdaptiveWidth([1.66] * 6, 0.0, 5, decode_cost=0.88)
    rows = [RowRecord(0, np.full(5, c, np.float32), n_accepted=4, emitted=(), width=5) for c in [0.1] + [0.95] * 40]
    fixed5 = eval_calibration.replay(rows, lambda c: 5, np.full(6, 1.66))
    alone = eval_calibration.replay_pauses(rows, lambda c: c, selector, 0.25)
    seeded = eval_calibration.replay_pauses(rows, lambda c: c, selector, 0.25, seed=np.full(5, 0.9))
    assert seeded == fixed5 and alone < 0.9 * fixed5
