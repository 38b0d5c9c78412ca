"""How many pending prompts a step prefills (`batch.prompts_to_prefill`), and when the call waits for
more to share it (`batch.prefill_waits`, `batch.prompts_this_step`)."""

import time

import numpy as np
import pytest

from jdspark.engine import batch
from jdspark.engine.batch import PendingPrompt, prefill_waits, prompts_this_step, prompts_to_prefill


def test_beside_running_requests_the_budget_and_the_padding_of_its_bucket():
    # the smallest bucket holds one prompt: the budget alone
    assert prompts_to_prefill(pending=9, budget_rows=1, buckets=(1, 4, 16), running=True) == 1
    # the smallest bucket is 16: a one-prompt call would pad 15 rows, so up to 16 pending prompts ride in it
    assert prompts_to_prefill(pending=9, budget_rows=1, buckets=(16, 64), running=True) == 9
    assert prompts_to_prefill(pending=40, budget_rows=1, buckets=(16, 64), running=True) == 16
    assert prompts_to_prefill(pending=3, budget_rows=2, buckets=(1, 4, 16), running=True) == 3
    assert prompts_to_prefill(pending=1, budget_rows=2, buckets=(1, 4, 16), running=True) == 1
    assert prompts_to_prefill(pending=6, budget_rows=5, buckets=(1, 4, 16), running=True) == 6  # bucket 16's padding


def test_with_nothing_running_as_many_as_fill_the_largest_bucket_they_fill():
    assert prompts_to_prefill(pending=9, budget_rows=1, buckets=(1, 4, 16), running=False) == 4
    assert prompts_to_prefill(pending=16, budget_rows=1, buckets=(1, 4, 16), running=False) == 16
    # fewer than the smallest bucket: all of them, in its padding
    assert prompts_to_prefill(pending=3, budget_rows=1, buckets=(16, 64), running=False) == 3
    assert prompts_to_prefill(pending=2, budget_rows=1, buckets=(1, 4, 16), running=False) == 1


def test_the_default_budget_takes_every_pending_prompt_up_to_the_largest_bucket():
    """The engine's default budget is every slot (`Engine(prefill_budget=None)`): beside running
    requests too, every pending prompt rides in one call, in the bucket that holds them."""
    assert prompts_to_prefill(pending=8, budget_rows=64, buckets=(1, 4, 16, 64), running=True) == 8
    assert prompts_to_prefill(pending=1, budget_rows=64, buckets=(1, 4, 16, 64), running=True) == 1
    assert prompts_to_prefill(pending=5, budget_rows=16, buckets=(1, 4, 16), running=False) == 5


def pending_since(*admitted: float, done: int = 0) -> list[PendingPrompt]:
    return [PendingPrompt(np.arange(4, dtype=np.int32), done=done, since=t) for t in admitted]


def test_a_prefill_waits_until_the_prompts_summed_waits_reach_the_stall_it_costs_the_running_rows():
    """4 running rows, a call of 10 ms: it stalls 40 row-ms, so it waits while the pending prompts
    have waited less than 40 ms in all. Mutation caught: comparing the longest wait, not the sum
    (two prompts of 25 ms each would wait on)."""
    assert prefill_waits(pending_since(1.0), running_rows=4, saves=[0.010], now=1.039)
    assert not prefill_waits(pending_since(1.0), running_rows=4, saves=[0.010], now=1.041)
    assert not prefill_waits(pending_since(1.0, 1.0), running_rows=4, saves=[0.010], now=1.025)
    assert prefill_waits(pending_since(1.0, 1.02), running_rows=4, saves=[0.010], now=1.025)


def test_no_prompt_waits_longer_than_max_wait_calls_of_the_call():
    """Beside 63 running rows a lone prompt would wait 63 calls; it waits 8 (`MAX_WAIT_CALLS`).
    Mutation caught: no cap."""
    limit = batch.MAX_WAIT_CALLS * 0.010
    assert prefill_waits(pending_since(1.0), running_rows=63, saves=[0.010], now=1.0 + limit - 0.001)
    assert not prefill_waits(pending_since(1.0), running_rows=63, saves=[0.010], now=1.0 + limit + 0.001)


def test_a_prefill_never_waits_with_nothing_running_without_a_profile_or_once_a_prompt_began():
    assert not prefill_waits(pending_since(1.0), running_rows=0, saves=[0.010], now=1.0)
    assert not prefill_waits(pending_since(1.0), running_rows=4, saves=None, now=1.0)
    assert not prefill_waits(pending_since(1.0, done=8), running_rows=4, saves=[0.010], now=1.0)  # its chunks go on
    assert not prefill_waits([], running_rows=4, saves=[0.010], now=1.0)


def test_a_prefill_does_not_wait_where_prompts_come_too_seldom_for_the_wait_to_pay():
    """4 running rows, a call of 10 ms (40 row-ms of stall): with prompts 50 ms apart a lone prompt goes
    at once, since waiting for the next would cost it ~50 ms; 5 ms apart it waits as before, and two
    pending prompts 25 ms apart (50 ms of waits for the next) go. Mutation caught: the gap not weighed
    by the pending prompts."""
    assert not prefill_waits(pending_since(1.0), running_rows=4, saves=[0.010], now=1.001, arrival_gap=0.050)
    assert prefill_waits(pending_since(1.0), running_rows=4, saves=[0.010], now=1.001, arrival_gap=0.005)
    assert prefill_waits(pending_since(1.0), running_rows=4, saves=[0.010], now=1.001, arrival_gap=None)
    assert prefill_waits(pending_since(1.0), running_rows=4, saves=[0.010], now=1.001, arrival_gap=0.025)
    assert not prefill_waits(pending_since(1.0, 1.0), running_rows=4, saves=[0.010], now=1.001, arrival_gap=0.025)


def test_arrivals_tell_the_mean_gap_between_admissions_once_there_are_enough():
    """Prompts admitted together count once, gaps short and long average (their rate), and fewer than
    GAPS + 1 admissions tell nothing. Mutations caught: each of a wave's prompts counted (a gap of 0:
    the next prompt expected at once); the median (threes 10 ms apart, 180 ms between them: 10 ms)."""
    arrivals = batch.Arrivals()
    times = [0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]  # waves of 4 and 2, then one by one
    for t in times[:-1]:
        arrivals.admitted(t)
        assert arrivals.gap() is None
    arrivals.admitted(times[-1])
    assert arrivals.gap() == pytest.approx(0.1)
    for t in (0.81, 0.82, 1.0, 1.01, 1.02, 1.2, 1.21, 1.22):  # threes 10 ms apart, 180 ms between them
        arrivals.admitted(t)
    assert arrivals.gap() == pytest.approx(0.0525)
    arrivals.admitted(5.0)  # after an idle spell: a longer mean, fewer calls held back
    assert arrivals.gap() == pytest.approx((5.0 - 0.81) / 8)


def test_the_step_prices_the_calls_of_the_buckets_they_would_run_in():
    """Three pending prompts run in bucket 4, and a fourth would join them there: it would be spared a
    call of its own, bucket 1's. An empty profile never holds a call back."""
    pending = dict(enumerate(pending_since(*[time.perf_counter() - 1000.0] * 3)))  # waited past any small stall
    assert prompts_this_step(pending, 2, 16, (1, 4, 16), {1: 1e-6, 4: 1e-6}) == 3
    assert prompts_this_step(pending, 2, 16, (1, 4, 16), {1: 1e9, 4: 1e9}) == 0
    assert prompts_this_step(pending, 2, 16, (1, 4, 16), {1: 1e-6, 4: 1e9}) == 3  # the fourth saves 1e-6 s
    assert prompts_this_step(pending, 2, 16, (1, 4, 16), {}) == 3


def test_sharing_saves_what_later_prompts_would_not_pay_in_calls_of_their_own():
    """Buckets 1 and 4 at 11.2 and 20.4 ms (Flash dimensions, an H200): a lone prompt's call shared with
    a second saves 2.0 ms, with a third 13.2, with a fourth 24.4; a fifth would need bucket 16, not
    profiled, so the list ends. Two prompts already in bucket 4: each later one saves bucket 1's call."""
    assert batch.sharing_saves({1: 0.0112, 4: 0.0204}, (1, 4, 16), 1, 16) == pytest.approx([0.002, 0.0132, 0.0244])
    assert batch.sharing_saves({1: 0.0112, 4: 0.0204}, (1, 4, 16), 2, 16) == pytest.approx([0.0112, 0.0224])
    assert batch.sharing_saves({1: 0.0112, 4: 0.0204}, (1, 4, 16), 1, 1) == []  # nothing may join
    assert batch.sharing_saves({}, (1, 4, 16), 1, 16) == []


def test_a_lone_prompt_does_not_wait_for_partners_whose_bucket_saves_too_little():
    """Flash dimensions, an H200, 3 running rows: waiting for one more prompt spares each row 2.0 ms,
    for three 24.4 ms against ~6 gaps of waiting, so with prompts 20 ms apart the call goes at once;
    5 ms apart they share it. Mutation caught: the call priced at its cost less its rows' slope through
    the buckets (the rule before: 8.1 ms x 3 rows against one 20 ms gap held it)."""
    pending = dict(enumerate(pending_since(time.perf_counter())))
    prefill_s = {1: 0.0112, 4: 0.0204}
    assert prompts_this_step(pending, 3, 4, (1, 4), prefill_s, arrival_gap=0.060) == 1
    assert prompts_this_step(pending, 3, 4, (1, 4), prefill_s, arrival_gap=0.020) == 1
    assert prompts_this_step(pending, 3, 4, (1, 4), prefill_s, arrival_gap=0.005) == 0
    assert prompts_this_step(pending, 3, 4, (1, 4), prefill_s) == 0  # no gap known: the summed-wait rule


def test_the_hold_aims_at_the_saving_that_pays_best_not_the_largest():
    """Buckets 1 / 4 / 16 at 10 / 20 / 50 ms, a budget of 16, one pending prompt, 15 running rows,
    prompts 35 ms apart: three more prompts (20 ms saved, ~6 gaps of waiting) pay best; fifteen would
    save 110 ms but take ~120 gaps. So the prompt waits at most 8 x 20 ms, not 8 x 110. Mutation
    caught: the waits bounded by the largest saving."""
    saves = batch.sharing_saves({1: 0.010, 4: 0.020, 16: 0.050}, (1, 4, 16), 1, 16)
    assert saves[:3] == pytest.approx([0.0, 0.010, 0.020]) and max(saves) == pytest.approx(0.110)
    assert prefill_waits(pending_since(1.0), running_rows=15, saves=saves, now=1.15, arrival_gap=0.035)
    assert not prefill_waits(pending_since(1.0), running_rows=15, saves=saves, now=1.17, arrival_gap=0.035)
    assert not prefill_waits(pending_since(1.0), running_rows=15, saves=saves, now=1.001)  # no gap: saves[0], 0
