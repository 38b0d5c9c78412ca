"""The live costs: the selectors corrected by what the steps took (`live_costs.LiveCosts`), fed
windows of made-up seconds, so the figures are exact."""

import numpy as np
import pytest

from jdspark.engine.live_costs import LiveCosts
from jdspark.speculative.selector import AdaptiveWidth


def test_live_costs_move_each_kind_of_call_towards_what_the_steps_took():
    base = AdaptiveWidth([0.002, 0.002, 0.003, 0.003, 0.004, 0.004], 0.001, gamma=5, decode_cost=0.0015)
    live = LiveCosts({1: base, 4: base})
    assert live.policy(1) is base
    for _ in range(30):  # verify steps at width 5 take 1 ms more than profiled, decode steps 0.5 ms less
        live.observe(1, True, 5, float(base.step_costs[5]) + 0.001)
        live.observe(1, False, 0, 0.0010)
    policy = live.policy(1)
    np.testing.assert_allclose(policy.step_costs, np.asarray(base.step_costs) + 0.001, rtol=1e-6)
    assert np.isclose(policy.decode_cost, 0.0010) and policy.draft_cost == base.draft_cost
    assert live.policy(4) is base  # another bucket keeps its own
    for _ in range(30):  # far faster than profiled: V(k) floors at zero, the decode cost stays positive
        live.observe(1, True, 5, 0.0)
        live.observe(1, False, 0, 0.0)
    assert np.all(live.policy(1).verify_costs >= 0) and live.policy(1).decode_cost > 0


def test_one_stalled_window_among_many_is_not_what_a_call_costs():
    """A 100 ms window (a stall: garbage collection, an executable's first run) among verify windows
    1 ms over their profile leaves the verify offset at 1 ms: priced in, it would stop the engine
    drafting. Most windows slower (the level itself moved) do move it."""
    base = AdaptiveWidth([0.002] * 6, 0.001, gamma=5, decode_cost=0.0015)
    live = LiveCosts({1: base})
    for i in range(12):
        live.observe(1, True, 5, float(base.step_costs[5]) + (0.1 if i == 6 else 0.001))
    assert live.offsets[1]["verify"] == pytest.approx(0.001)
    for _ in range(LiveCosts.SAMPLES // 2 + 1):
        live.observe(1, True, 5, float(base.step_costs[5]) + 0.003)
    assert live.offsets[1]["verify"] == pytest.approx(0.003)
    frozen = LiveCosts({1: base}, learn=False)
    frozen.observe(1, True, 5, 1.0)
    assert frozen.policy(1) is base and frozen.offsets[1]["verify"] == 0.0


def test_live_costs_learn_what_switching_executables_adds():
    """Windows that issued the same call as the one before take 0.5 ms over the profile, those that
    switched 1.5 ms: the verify offset learns 0.5 ms, the switch cost 1.0 ms, priced only once both
    kinds were seen MIN_SWITCH_SAMPLES times; a window that issued a prefill teaches neither (its
    prefill is paid whatever the width). Where switching adds nothing, the switch cost stays ~0."""
    base = AdaptiveWidth([0.002, 0.002, 0.003, 0.003, 0.004, 0.004], 0.001, gamma=5, decode_cost=0.0015)

    def run(extra_when_switched, windows=300):
        live = LiveCosts({1: base})
        for i in range(windows):
            width = 5 if i % 3 else 3  # 3, 5, 5, 3, 5, 5, ...: a switch into each 3 and into the first 5 after it
            switched = live._last not in (None, (1, width))
            live.issued(1, width)
            live.observe(1, True, width, float(base.step_costs[width]) + 0.0005 + extra_when_switched * switched)
            if i == 2:
                assert live.switch_price(1) == (5, 0.0)  # too few windows seen yet
        return live

    live = run(0.001)
    stay, cost = live.switch_price(1)
    assert stay == 5 and cost == pytest.approx(0.001, rel=1e-3)
    assert live.offsets[1]["verify"] == pytest.approx(0.0005, rel=1e-3)
    live.issued(1, 3, with_prompt=True)
    live.observe(1, True, 3, 1.0, prompt=True)  # it carried a prompt segment: neither switch cost nor offset
    assert live.switch_price(1, with_prompt=True) == (3, pytest.approx(0.001, rel=1e-3))
    assert live.switch_price(1) == (None, pytest.approx(0.001, rel=1e-3))
    assert live.offsets[1]["verify"] == pytest.approx(0.0005, rel=1e-3)
    assert LiveCosts({1: base, 4: base}).switch_price(4) == (None, 0.0)
    assert run(0.0).switch_price(1)[1] == pytest.approx(0.0, abs=1e-7)


def test_a_read_that_observes_no_step_closes_its_window():
    """A verify read whose requests all ended first observes nothing (`Engine._read_verify`), but the
    switch it saw issued must not leak into the next window, which repeated its call."""
    base = AdaptiveWidth([0.002] * 6, 0.001, gamma=5, decode_cost=0.0015)
    live = LiveCosts({1: base})
    live.issued(1, 5)
    live.observe(1, True, 5, 0.004)
    live.issued(1, "prefill")
    live.issued(1, 3)  # a switched window ...
    live.close_window()  # ... read with no step to observe
    live.issued(1, 3)
    live.observe(1, True, 3, 0.004)
    assert live.windows == {1: {"same": 2, "switched": 0}}


def test_live_costs_learn_nothing_from_a_bucket_not_measured_but_close_its_window():
    """A step read in a bucket without a selector (the engine's LiveCosts before, or without, a
    measured one) teaches nothing and raises nothing, and the window it closes (here one with a
    prefill) does not leak into the next: that next window moved buckets (no switch the choice made), and
    the one after it repeats its call."""
    base = AdaptiveWidth([0.002] * 6, 0.001, gamma=5, decode_cost=0.0015)
    live = LiveCosts({1: base})
    live.issued(1, 5)
    live.observe(1, True, 5, 0.004)
    live.issued(4, "prefill")
    live.issued(4, 3)
    live.observe(4, True, 3, 0.1)  # bucket 4 has no selector
    live.issued(1, 5)
    live.observe(1, True, 5, 0.004)
    assert live.windows == {1: {"same": 1, "switched": 0}} and set(live.offsets) == set(live.switch) == {1}
    live.issued(1, 5)
    live.observe(1, True, 5, 0.004)
    assert live.windows == {1: {"same": 2, "switched": 0}}


def test_only_the_choices_switches_teach_the_switch_price():
    """A window that moved to another bucket (the live rows' count did) or issued a prefill call is slow for
    reasons no width choice avoids: it teaches no switch, however slow; a width changed within the bucket does."""
    base = AdaptiveWidth([0.002] * 6, 0.001, gamma=5, decode_cost=0.0015)
    live = LiveCosts({1: base, 16: base})
    for i in range(40):  # moves between buckets 16 and 1, each first call 3 ms slower; prefills in between
        bucket = 16 if i % 2 else 1
        if i % 4 == 0:
            live.issued(bucket, "prefill")
        live.issued(bucket, 5)
        live.observe(bucket, True, 5, float(base.step_costs[5]) + 0.003)
    assert live.windows == {1: {"same": 0, "switched": 0}, 16: {"same": 0, "switched": 0}}
    assert live.switch_price(16) == (5, 0.0) and live.switch[16] == 0.0
    previous = 5  # the loop above issued width 5 last
    for i in range(60):  # within bucket 16: 3, 5, 5, 3, ..., a switch 1 ms dearer
        width = 5 if i % 3 else 3
        switched, previous = width != previous, width
        live.issued(16, width)
        live.observe(16, True, width, float(base.step_costs[width]) + 0.001 * switched)
    assert live.switch_price(16) == (5, pytest.approx(0.001, rel=0.05))


def test_widths_seen_often_enough_take_their_own_windows():
    """Profiled 0.2 ms apart, k = 4 and k = 5 windows both take 2.1 ms (the host paces the steps):
    once each has MIN_WIDTH_SAMPLES windows, each is priced at its own (the same S), and a width
    never seen takes the median over every width's windows; before that, the profile's slope stays."""
    base = AdaptiveWidth([0.001, 0.001, 0.001, 0.001, 0.0012, 0.0014], 0.0006, gamma=5, decode_cost=0.001)
    live = LiveCosts({1: base})
    for i in range(2 * LiveCosts.MIN_WIDTH_SAMPLES):
        width = 4 if i % 2 else 5
        live.issued(1, 5)  # the same call every window: no switch to learn
        live.observe(1, True, width, 0.0021)
        if i == 1:
            steps = live.policy(1).step_costs
            assert steps[5] - steps[4] == pytest.approx(0.0002)
    steps = live.policy(1).step_costs
    assert steps[4] == pytest.approx(0.0021) and steps[5] == pytest.approx(0.0021)
    kind = live.offsets[1]["verify"]  # the median over both widths' excesses (0.0003 and 0.0001)
    assert steps[3] == pytest.approx(base.step_costs[3] + kind) and 0.0001 <= kind <= 0.0003


def test_where_the_host_sets_the_pace_every_width_costs_the_same():
    """The profile prices k = 3 0.3 ms below k = 5, and every verify window takes 2.2 ms. While most
    windows read a call the device had finished (the host paces the steps) every width is priced at
    the windows' median and the widest, with the most expected tokens, wins; while the device paces
    them (reads that waited), the profile's shape stays and k = 3 wins, as it does with too few windows."""
    base = AdaptiveWidth([0.0010, 0.0010, 0.0010, 0.0010, 0.0013, 0.0013], 0.0008, gamma=5, decode_cost=0.003)
    confidence = np.full((1, 5), 0.6)

    def choice(ready: bool, windows: int) -> tuple[int, list[float]]:
        live = LiveCosts({1: base})
        for _ in range(windows):
            live.issued(1, 3)
            live.observe(1, True, 3, 0.0022, ready)
        policy = live.policy(1)
        return int(policy.widths(confidence)[0]), policy.step_costs

    width, paced = choice(ready=True, windows=9)
    assert width == 5 and paced == pytest.approx([0.0022] * 6)
    assert choice(ready=False, windows=9)[0] == 3
    assert choice(ready=True, windows=LiveCosts.MIN_PACE_SAMPLES - 1)[0] == 3
    assert not LiveCosts({1: base}, learn=False).host_paced(1)
    live = LiveCosts({1: base})
    for _ in range(9):
        live.observe(1, True, 3, 0.0022, True)
    live.price_host_paced = False  # a benchmark's comparison: the profile's shape stays
    assert not live.host_paced(1) and int(live.policy(1).widths(confidence)[0]) == 3


def test_a_bucket_that_only_decodes_forgets_its_verify_and_switch_windows():
    """Stalled verify windows (10 ms against a profiled 2 ms) and switches learnt at 1 ms keep a
    bucket decoding, and no verify window comes to correct them. After FORGET_AFTER decode windows
    in a row the bucket prices by the profile again, switches free until learnt anew; one decode
    window fewer, it still remembers. Mutation caught: forgetting only the verify windows (the
    switch price would keep it decoding)."""
    base = AdaptiveWidth([0.0010] * 6, 0.0010, gamma=5, decode_cost=0.0010)
    live = LiveCosts({1: base})
    took = {5: 0.010, "decode": 0.0010}

    def window(call, extra=0.0):
        live.issued(1, call)
        live.observe(1, call == 5, 5, took[call] + extra)
    for call in [5] * 9 + ["decode"] * 9:  # windows after the same call
        window(call)
    for i in range(2 * LiveCosts.MIN_SWITCH_SAMPLES):  # alternating: each 1 ms more
        window(5 if i % 2 else "decode", 0.001)
    assert live.policy(1).step_costs[5] > 0.005 and live.switch_price(1)[1] > 0.0005
    for _ in range(LiveCosts.FORGET_AFTER - 1):
        window("decode")
    assert live.policy(1).step_costs[5] > 0.005 and live.switch_price(1)[1] > 0.0005
    window("decode")
    assert live.policy(1).step_costs[5] == pytest.approx(base.step_costs[5]) and live.switch_price(1)[1] == 0.0
    assert live.offsets[1]["decode"] == pytest.approx(0.0)  # the decode windows are still what decode costs


def test_a_bucket_forgets_at_once_when_the_limit_falls_below_its_decode_run():
    """The bench's `per_request_queued_remembering` lifts FORGET_AFTER, then the next mode restores
    it on the same live costs, past the run: the next decode window forgets (`>=`, not `==`)."""
    base = AdaptiveWidth([0.0010] * 6, 0.0010, gamma=5, decode_cost=0.0010)
    live = LiveCosts({1: base})
    for _ in range(9):
        live.observe(1, True, 5, 0.010)
    live.FORGET_AFTER = 2 ** 62
    for _ in range(100):
        live.observe(1, False, 0, 0.0010)
    assert live.policy(1).step_costs[5] > 0.005
    del live.FORGET_AFTER  # the class's again
    live.observe(1, False, 0, 0.0010)
    assert live.policy(1).step_costs[5] == pytest.approx(base.step_costs[5])


def test_a_bucket_that_only_drafts_forgets_its_decode_windows_where_the_device_paced_them():
    """The H100's Flash-dimension trap: decode profiled at 3.9 ms, a burst of slow decode windows
    (5.9-15.6 ms among 4.0 ms ones) prices the decode call 0.8 ms over its profile, and the verify
    steps it then chooses never show a decode window to correct it. After FORGET_AFTER verify windows
    in a row the decode call is priced by the profile again (one window fewer: not yet). Where the
    host paced the decode windows (their reads found the call done: the profile does not see the host's
    time) the learnt price stays. A decode window restarts the count. Mutations caught: never
    forgetting; forgetting whoever paced; counting verify windows not in a row."""
    base = AdaptiveWidth([0.0127] * 6, 0.0, gamma=5, decode_cost=0.0039)
    burst = [0.0040] * 4 + [0.0113, 0.0120, 0.0060, 0.0047, 0.0040, 0.0036, 0.0038, 0.0041, 0.0094, 0.0156]

    def trapped(host_paced: bool) -> LiveCosts:
        live = LiveCosts({4: base})
        for seconds in burst:
            live.issued(4, "decode")
            live.observe(4, False, 0, seconds, ready=host_paced)
        assert live.policy(4).decode_cost == pytest.approx(0.0047)
        for _ in range(LiveCosts.FORGET_AFTER - 1):
            live.issued(4, 3)
            live.observe(4, True, 3, 0.0122)
        assert live.policy(4).decode_cost == pytest.approx(0.0047)
        live.issued(4, 3)
        live.observe(4, True, 3, 0.0122)
        return live

    assert trapped(host_paced=False).policy(4).decode_cost == pytest.approx(base.decode_cost)
    assert trapped(host_paced=True).policy(4).decode_cost == pytest.approx(0.0047)
    live = LiveCosts({4: base})  # a decode window inside the verify run restarts the count
    for call, seconds in [("decode", s) for s in burst] + [(3, 0.0122)] * 30 + [("decode", 0.0047)] \
            + [(3, 0.0122)] * (LiveCosts.FORGET_AFTER - 1):
        live.issued(4, call)
        live.observe(4, call == 3, 3 if call == 3 else 0, seconds)
    assert live.policy(4).decode_cost == pytest.approx(0.0047)
    live.issued(4, 3)
    live.observe(4, True, 3, 0.0122)
    assert live.policy(4).decode_cost == pytest.approx(base.decode_cost)


def test_before_its_first_window_the_decode_call_costs_at_least_the_hosts_time_per_step():
    """The H100's embedded model, one request: decode profiled at 0.66 ms and served at 1.04 (the host
    paced it), verify windows of 1.74 ms whose reads waited 0.64 for the device (1.10 ms of host work a
    step). Priced by its profile, the decode call looked worth pausing for at confidences whose drafts
    bring 1.7x the tokens a ms decoding served; priced at the host's time per step, it does not; its own first window then sets its price.
    Windows whose wait is not measured teach no host time. Mutations caught: no floor; the floor kept
    after the decode call's own windows; the wait not subtracted."""
    base = AdaptiveWidth([0.0012, 0.0013, 0.0014, 0.0015, 0.00162, 0.00162], 0.0, gamma=5, decode_cost=0.00066)
    confidences = np.full((1, 5), 0.68)  # E(5) = 2.82 in 1.74 ms: 1.62 a ms, under 1.1 / 0.66 ms
    unmeasured = LiveCosts({1: base})
    for _ in range(9):
        unmeasured.observe(1, True, 5, 0.00174)
    assert unmeasured.policy(1).decode_cost == pytest.approx(0.00066)
    assert not unmeasured.policy(1).drafting_pays(confidences)[0]
    live = LiveCosts({1: base})
    for _ in range(9):
        live.observe(1, True, 5, 0.00174, waited=0.00064)
    assert live.policy(1).decode_cost == pytest.approx(0.00110)
    assert live.policy(1).drafting_pays(confidences)[0]
    live.observe(1, False, 0, 0.00104, ready=True, waited=0.00003)
    assert live.policy(1).decode_cost == pytest.approx(0.00104)
