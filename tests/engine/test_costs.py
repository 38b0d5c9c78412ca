"""Cost measurement: warm-up rounds, then timed rounds of every label, each call after an untimed reset;
cached per key and labels.
Time is a fake clock that the calls advance, so the figures are exact. (The live costs that correct
the profile: test_live_costs.py.)"""

import types

import numpy as np
import pytest

from jdspark.engine import costs
from jdspark.engine.options import SpecOptions


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_warm_up_rounds_last_at_least_warm_s(tmp_path):
    clock, runs = FakeClock(), []

    def run(label, n):
        runs.append(label)
        clock.now += 0.1

    measured = costs.measure(run, ["decode", "step5"], 2, clock=clock)
    assert len(runs) == 2 * 3 + 2 * 2  # warm-up rounds of 0.2 s until 0.5 s had passed, then 2 timed rounds
    assert np.allclose(measured, [0.1, 0.1])


def test_reset_runs_before_every_call_and_is_not_timed(tmp_path):
    clock, calls = FakeClock(), []
    durations = {"step0": iter([100.0, 1.0, 5.0, 2.0]), "step2": iter([100.0, 3.0, 4.0, 9.0])}  # warm-up first

    def run(label, n):
        calls.append(("run", label))
        clock.now += next(durations[label])

    def reset():
        calls.append(("reset",))
        clock.now += 50.0  # would dominate the medians if it were timed

    measured = costs.load_or_measure("key", run, ["step0", "step2"], 3, tmp_path, reprofile=False, reset=reset,
                                     clock=clock)
    runs = [c[1] for c in calls if c[0] == "run"]
    assert runs == ["step0", "step2"] * 4  # one warm-up round (it lasted over WARM_S), then interleaved rounds
    assert calls[:2] == [("reset",), ("run", "step0")]
    assert sum(c == ("reset",) for c in calls) == sum(c[0] == "run" for c in calls) == 8  # 2 x (warm-up + 3)
    assert measured == {"step0": 1.0, "step2": 3.0}  # the fastest timed calls, warm-up and resets left out
    calls.clear()
    assert costs.load_or_measure("key", run, ["step0", "step2"], 3, tmp_path, reprofile=False, reset=reset,
                                 clock=clock) == measured
    assert calls == []  # served from the cache
    durations["step0"] = iter([100.0, 7.0, 7.0, 7.0])
    assert costs.load_or_measure("key", run, ["step0"], 3, tmp_path, reprofile=False, reset=reset,
                                 clock=clock) == {"step0": 7.0}
    assert calls  # other labels: measured again
    durations["step0"] = iter([100.0, 6.0, 6.0, 6.0])
    assert costs.load_or_measure("key", run, ["step0"], 3, tmp_path, reprofile=True, reset=reset,
                                 clock=clock) == {"step0": 6.0}  # reprofile: measured although cached


def test_a_damaged_cost_file_is_measured_again_and_rewritten_whole(tmp_path, caplog):
    """A cost file cut short (a process killed while writing, a full disk) or of another shape is
    measured again, not an error at every step; the file is then replaced whole (written aside first)."""
    clock, path = FakeClock(), tmp_path / "key.json"

    def run(label, n):
        clock.now += 2.0

    for text in ("", '{"labels": ["step0"]', '{"labels": ["step0"], "costs_s": []}', "[1, 2]", '{"costs_s": [1]}'):
        path.write_text(text)
        assert costs.stored_costs(path, ["step0"], reprofile=False) is None
    assert "unreadable" in caplog.text
    assert costs.load_or_measure("key", run, ["step0"], 2, tmp_path, reprofile=False, clock=clock) == {"step0": 2.0}
    assert costs.stored_costs(path, ["step0"], reprofile=False) == {"step0": 2.0}
    assert list(tmp_path.iterdir()) == [path]


def test_a_queued_call_is_priced_at_what_it_adds_to_the_queue():
    """The "queued" profile times samples of several calls issued back to back and of one: a call
    costs what it adds (the first call's 1 s wait after the sync left out); a label's own count: the
    prefill is sampled one call at a time. Where noise makes the later calls add nothing, the
    average. Mutation caught: the sample's average (9 s / 4 = 2.25 s)."""
    clock, sampled = FakeClock(), []

    def run(label, n):  # a sample of n calls: a 1 s wait, then 2 s a call; a prefill: 3 s
        sampled.append((label, n))
        clock.now += 1.0 + 2.0 * n if label == "step5" else 3.0

    assert costs.measure(run, ["step5", "prefill"], 2, clock=clock, calls={"step5": 4}) == [2.0, 3.0]
    assert set(sampled) == {("step5", 1), ("step5", 4), ("prefill", 1)}

    def flat(label, n):  # four calls timed as fast as one
        clock.now += 8.0

    assert costs.measure(flat, ["step5"], 2, clock=clock, calls={"step5": 4}) == [2.0]


def test_options_name_an_unknown_profile():
    with pytest.raises(ValueError, match="profile='async': use one of synchronised, queued"):
        SpecOptions(profile="async")


def test_with_several_processes_the_live_costs_read_no_clock(monkeypatch):
    """Each process times its own steps: learning from them, or holding prefills back on them, could
    make processes issue different calls. One process learns and holds back; two do neither. (A
    prefill-only bucket, 1 here, prices its prefill and gets no selector.)"""
    full = {"prefill": 0.004, "decode": 0.001, **{f"step{k}": 0.002 + 0.0001 * k for k in range(6)}}
    measured = {1: {"prefill": 0.002}, 4: full}
    engine = types.SimpleNamespace(config=types.SimpleNamespace(buckets=(4,), prefill_buckets=(1, 4), gamma=5),
                                   exe=types.SimpleNamespace(step=dict.fromkeys(range(6)), buckets=dict.fromkeys((1, 4))),
                                   measure_call_costs=lambda n: measured[n])
    selectors, _, live = costs.measured_selectors(engine)
    assert set(selectors) == {4} and live.learn and live.prefill_s == {1: 0.002, 4: 0.004}
    monkeypatch.setattr(costs.jax, "process_count", lambda: 2)
    live = costs.measured_selectors(engine)[2]
    assert not live.learn and live.prefill_s == {}


def test_cost_cache_keys_tell_stored_and_decoded_weights_apart():
    """One checkpoint loaded as stored and decoded at load runs other executables: their measured
    costs must not share a cache entry (the config alone is the same); a second load keys the same."""
    from jdspark.assets import default_model_dir
    from jdspark.checkpoint.loader import load_model
    from jdspark.config import EngineConfig
    from jdspark.engine.costs import programs_key
    from jdspark.engine.executables import Executables

    def key(dequantize):
        model = load_model(default_model_dir(), "float32", dequantize=dequantize, progress=False)
        exe = Executables(model, EngineConfig(max_seq_len=64, max_batch=2), 16, "auto", widths=(0, 5),
                          pack_params=False)  # nothing compiles: the key is known before
        return model.config.to_dict(), programs_key(exe)
    (stored_config, stored), (_, again), (decoded_config, decoded) = key(False), key(False), key(True)
    assert stored_config == decoded_config
    assert stored == again != decoded
