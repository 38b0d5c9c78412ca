"""Speculation that comes online after start-up (`Engine(defer_steps=True)`, `jdspark.engine.deferred`):
target-only serving from the start, the step executables taken once built, the same greedy tokens
across the switch, nothing compiled after it, a failed build that leaves target-only serving, and
the moment the built executables are taken."""

import logging
import threading
import time

import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.engine import costs, deferred, executables
from jdspark.engine.engine import Engine
from jdspark.engine.errors import EngineError
from jdspark.engine.options import SpecOptions
from jdspark.engine.request import SamplingParams
from tests.conftest import generate_to_end

PROMPT = np.array([5, 9, 2, 14], np.int32)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def deferred_engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(max_seq_len=128, gamma=5, max_batch=2, batch_buckets=(2,)), prefill_chunk=16,
                  defer_steps=True, **kw)


def test_serves_target_only_then_speculates_with_the_same_greedy_tokens(dspark_model, compile_counter, monkeypatch):
    """Before the step executables are taken the engine only decodes (speculation cannot be turned on);
    once built, with a request running and costs to measure, a step takes them only after the build
    has waited `deferred.TAKE_WAIT_S` for an idle engine, and the step's read of the call issued before
    is not timed over the taking (its cost measurement); a greedy request started before and finished
    speculating emits the tokens of target-only decoding; nothing compiles after the engine took them."""
    release, built, build = threading.Event(), threading.Event(), deferred.StepBuild._build
    monkeypatch.setattr(deferred.StepBuild, "_build", lambda self: (release.wait(), build(self), built.set()))
    engine = deferred_engine(dspark_model, options=SpecOptions(reprofile=True))  # measured when taken: >= WARM_S
    assert not engine.speculative and not engine.exe.step and engine.poll()
    with pytest.raises(EngineError, match="wait_for_steps"):
        engine.set_policy(speculative=True)
    first = engine.add(PROMPT, GREEDY)
    tokens, drafted = list(first.tokens), []
    while len(tokens) < 12:
        deltas = engine.step()
        tokens += deltas[first.request_id].tokens if first.request_id in deltas else []
        drafted.append(engine.last_step is not None and engine.last_step.drafted_call)
    assert not any(drafted) and not engine.wait_for_steps(timeout=0.01)
    release.set()
    assert built.wait(600)
    deltas = engine.step()  # built, but the costs are to be measured and a request runs: not yet taken
    tokens += deltas[first.request_id].tokens if first.request_id in deltas else []
    assert not engine.speculative and engine.poll()
    monkeypatch.setattr(deferred, "TAKE_WAIT_S", 0.0)  # ... until the build has waited this long
    begun = time.perf_counter()
    deltas = engine.step()  # overlapped: it reads the decode call issued before it took the executables
    took = time.perf_counter() - begun
    tokens += deltas[first.request_id].tokens if first.request_id in deltas else []
    assert engine.speculative and engine.selector is not None and sorted(engine.exe.step) == [0, 1, 2, 3, 4, 5]
    assert not engine.last_step.drafted_call and engine.last_step.seconds < took - costs.WARM_S
    compiles, before = compile_counter.count, len(drafted)
    final = False
    while not final:
        deltas = engine.step()
        drafted.append(engine.last_step is not None and engine.last_step.drafted_call)
        if first.request_id in deltas:
            tokens += deltas[first.request_id].tokens
            final = deltas[first.request_id].final
    assert any(drafted[before:]), "the engine never drafted after taking the step executables"
    assert compile_counter.count == compiles
    engine.set_policy(speculative=False)
    assert tokens == generate_to_end(engine, PROMPT, GREEDY).token_ids


def test_policies_set_while_building_are_kept(dspark_model):
    """`set_policy(speculative=False)` and a width policy set during the build are kept when the
    executables are taken; speculation turned on afterwards verifies at that policy's width."""
    engine = deferred_engine(dspark_model)
    engine.set_policy(speculative=False, width_policy=lambda confidence: 3)
    assert engine.wait_for_steps(timeout=600)
    assert not engine.speculative and engine.exe.step
    engine.set_policy(speculative=True)
    widths = generate_to_end(engine, PROMPT, GREEDY).stats.widths
    assert widths[3] == sum(widths) > 0


def test_an_adaptive_width_without_gamma_compiled_fails_at_start_up(dspark_model):
    with pytest.raises(EngineError, match="adaptive width needs width gamma=5"):
        deferred_engine(dspark_model, widths=(0, 3))


@pytest.mark.parametrize("failing", ["build", "costs"])
def test_a_failure_keeps_serving_target_only(dspark_model, monkeypatch, caplog, failing):
    """A failed build, or a failure measuring the costs when the executables are taken, is logged on the
    engine's thread: the running request goes on target-only, unharmed, and so do new ones."""
    compile = executables.Executables.compile

    def failing_compile(self, decode, draft_cache, which="all"):
        if which == "steps":
            raise RuntimeError("failed on purpose")
        return compile(self, decode, draft_cache, which)

    def failing_costs(engine):
        raise RuntimeError("failed on purpose")

    if failing == "build":
        monkeypatch.setattr(executables.Executables, "compile", failing_compile)
    else:
        monkeypatch.setattr(costs, "measured_selectors", failing_costs)
    engine = deferred_engine(dspark_model)
    first = engine.add(PROMPT, GREEDY)
    with caplog.at_level(logging.ERROR, logger="jdspark.engine.deferred"):
        assert engine.wait_for_steps(timeout=600)
    assert "failed on purpose" in caplog.text
    assert not engine.speculative and not engine.poll()
    assert engine.complete([first])[0].token_ids == generate_to_end(engine, PROMPT, GREEDY).token_ids


def test_an_idle_engine_stored_costs_or_a_fixed_width_take_at_once(dspark_model, monkeypatch):
    """Built step executables are taken at the first poll while no request runs or waits, or with one
    running where taking them measures nothing (their costs stored, or a fixed width, also one set
    after the engine first looked); else the running request goes on target-only. Mutation caught: a
    rule that ignores the running requests, a server's queue, the stored costs or the width policy."""
    monkeypatch.setattr(deferred, "TAKE_WAIT_S", 3600.0)
    monkeypatch.setattr(costs, "profiled", lambda engine: False)
    idle = deferred_engine(dspark_model)
    assert idle._build.wait(600) and idle.poll(queued=True) and not idle.speculative  # a request waits to be admitted
    assert not idle.poll() and idle.speculative  # nothing runs or waits: taken
    waiting = []
    for stored, policy in ((False, None), (True, None), (False, lambda confidence: 5)):
        monkeypatch.setattr(costs, "profiled", lambda engine: stored)
        busy = deferred_engine(dspark_model, width_policy=policy)
        busy.add(PROMPT, GREEDY)
        instant = stored or policy is not None
        assert busy._build.wait(600) and busy.poll() != instant and busy.speculative == instant
        waiting += [] if instant else [busy]
    waiting[0].set_policy(width_policy=lambda confidence: 5)  # the adaptive one, still running its request
    assert not waiting[0].poll() and waiting[0].speculative  # a fixed width now: nothing to measure, taken


def test_a_generator_takes_the_built_executables_when_a_run_ends(dspark_model, monkeypatch):
    """A library's engine has no idle loop polling it: the Python API takes the built step executables
    at the end of a run (the engine idle, its costs measured there), not mid-request once
    `deferred.TAKE_WAIT_S` has passed. Mutation caught: no poll at a run's end."""
    from jdspark.generator import Generator
    monkeypatch.setattr(deferred, "TAKE_WAIT_S", 3600.0)
    monkeypatch.setattr(costs, "profiled", lambda engine: False)  # taking them measures: waits for idle
    generator = Generator(deferred_engine(dspark_model))
    assert generator.engine._build.wait(600)
    first = generator.generate(list(PROMPT), GREEDY)
    assert not any(first.stats.widths[1:]) and generator.engine.speculative  # target-only, then taken
    assert generator.generate(list(PROMPT), GREEDY).token_ids == first.token_ids
