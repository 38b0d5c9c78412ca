"""Speculation that comes online after start-up (`Engine(defer_steps=True)`, `jdspark.engine.deferred`):
target-only serving from the start, the step executables taken once built, the same greedy tokens
across the switch, nothing compiled after it, and a failed build that leaves target-only serving."""

import logging
import threading

import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.engine import deferred, executables
from jdspark.engine.engine import Engine
from jdspark.engine.errors import EngineError
from jdspark.engine.request import SamplingParams
from tests.conftest import generate_to_end

PROMPT = np.array([5, 9, 2, 14], np.int32)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def deferred_engine(model) -> Engine:
    return Engine(model, EngineConfig(max_seq_len=128, gamma=5, max_batch=2, batch_buckets=(2,)), prefill_chunk=16,
                  defer_steps=True)


def test_serves_target_only_then_speculates_with_the_same_greedy_tokens(dspark_model, compile_counter, monkeypatch):
    """Before the step executables are taken the engine only decodes (speculation cannot be turned on);
    a greedy request started then and finished speculating emits the tokens of target-only decoding;
    nothing compiles after the engine took them."""
    release, build = threading.Event(), deferred.StepBuild._build
    monkeypatch.setattr(deferred.StepBuild, "_build", lambda self: (release.wait(), build(self)))  # held back
    engine = deferred_engine(dspark_model)
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
    assert engine.wait_for_steps(timeout=600)
    assert engine.speculative and engine.selector is not None and sorted(engine.exe.step) == [0, 1, 2, 3, 4, 5]
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


def test_speculation_turned_off_while_building_stays_off(dspark_model):
    """`set_policy(speculative=False)` during the build is kept when the executables are taken; turning
    speculation on afterwards uses them, with the measured adaptive policy."""
    engine = deferred_engine(dspark_model)
    engine.set_policy(speculative=False)
    assert engine.wait_for_steps(timeout=600)
    assert not engine.speculative and engine.exe.step
    engine.set_policy(speculative=True)
    assert engine.width_policy is engine.selector
    engine.set_policy(width_policy=lambda confidence: 3)
    assert generate_to_end(engine, PROMPT, GREEDY).stats.widths[3] > 0


def test_a_failed_build_keeps_serving_target_only(dspark_model, monkeypatch, caplog):
    """The build's error is logged on the engine's thread; requests keep being served, target-only."""
    compile = executables.Executables.compile

    def failing(self, decode, draft_cache, which="all"):
        if which == "steps":
            raise RuntimeError("compile failed on purpose")
        return compile(self, decode, draft_cache, which)

    monkeypatch.setattr(executables.Executables, "compile", failing)
    engine = deferred_engine(dspark_model)
    with caplog.at_level(logging.ERROR, logger="jdspark.engine.deferred"):
        assert engine.wait_for_steps(timeout=600)
    assert "compile failed on purpose" in caplog.text
    assert not engine.speculative and not engine.poll()
    assert len(generate_to_end(engine, PROMPT, GREEDY).token_ids) == GREEDY.max_tokens
