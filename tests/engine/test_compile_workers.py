"""Compile workers: processes that lower, compile and store an engine's executables from a recipe
without weights. What they deliver is what the engine would have compiled (the same tokens), and a
worker that fails leaves the engine compiling its programs itself."""

import logging
import subprocess

import jax
import numpy as np
import pytest

from jdspark.config import EngineConfig
from jdspark.engine import compiling
from jdspark.engine.engine import Engine
from jdspark.engine.executables import Executables
from jdspark.engine.request import SamplingParams
from jdspark.experts.hybrid import with_host_experts
from jdspark.model.model import Model
from tests.conftest import DSPARK_CONFIG, generate_to_end


def _engine(model, max_seq_len: int, monkeypatch, workers: str, store: str = "1") -> Engine:
    """A target-only engine of two buckets (4 executables), of a size no other test compiles."""
    monkeypatch.setenv("JDSPARK_COMPILE_WORKERS", workers)
    monkeypatch.setenv("JDSPARK_STORE_EXECUTABLES", store)
    config = EngineConfig(max_seq_len=max_seq_len, gamma=5, max_batch=2, batch_buckets=(1, 2))
    return Engine(model, config, prefill_chunk=16, speculative=False)


def test_workers_build_the_executables_the_engine_would(dspark_model, monkeypatch, caplog):
    """Each worker logs its phases. Here the GPU memory outside the engine is said to hold two
    compiles (`concurrent_compiles`), so three workers asked for become two of one compile each.
    Mutation caught: a recipe that drops a setting the programs depend on (the workers' keys differ,
    nothing is delivered), or workers that store nothing."""
    monkeypatch.setattr(compiling, "device_memory_outside_this_process", lambda: 2.5 * 2 ** 30)
    with caplog.at_level(logging.INFO, logger=compiling.__name__):
        engine = _engine(dspark_model, 88, monkeypatch, workers="3")
    assert engine.exe.count == 4 and engine.exe.from_workers == 4 and engine.exe.loaded == 0
    assert "compile workers: 2, at most 1 compiles each" in caplog.text
    assert "compile worker 1: 2 programs; started in" in caplog.text
    alone = _engine(dspark_model, 88, monkeypatch, workers="0", store="0")  # compiled here, stored nowhere
    prompt = np.array([5, 9, 2, 14, 7, 7, 1, 12], np.int32)
    for params in (SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)):
        assert generate_to_end(engine, prompt, params).token_ids == generate_to_end(alone, prompt, params).token_ids


def test_a_failed_worker_leaves_the_engine_compiling(dspark_model, monkeypatch, caplog):
    monkeypatch.setattr(compiling, "recipe", lambda *args: b"not a pickle")
    with caplog.at_level(logging.WARNING, logger=compiling.__name__):
        engine = _engine(dspark_model, 96, monkeypatch, workers="2")
    assert engine.exe.from_workers == 0 and engine.exe.loaded == 0
    assert "compile worker exited" in caplog.text
    prompt = np.array([5, 9, 2, 14], np.int32)
    assert len(generate_to_end(engine, prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                              ignore_eos=True)).token_ids) == 6


def test_worker_count(monkeypatch):
    monkeypatch.delenv("JDSPARK_COMPILE_WORKERS", raising=False)
    default = compiling.workers(30)
    assert default == 0 if jax.default_backend() == "cpu" else 1 <= default <= 8
    monkeypatch.setenv("JDSPARK_COMPILE_WORKERS", "3")
    assert compiling.workers(30) == 3
    assert compiling.workers(compiling.MIN_PROGRAMS - 1) == 0
    monkeypatch.setenv("JDSPARK_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="JDSPARK_COMPILE_WORKERS='many'"):
        compiling.workers(30)


def test_only_plain_one_device_models_go_to_workers():
    """A model with host experts keeps its banks in this process: its programs are compiled here."""
    config = EngineConfig(max_seq_len=64, gamma=5, max_batch=1)
    model = Model.random(DSPARK_CONFIG, "bfloat16", seed=3)

    def eligible(model):
        exe = Executables(model, config, 16, "xla", (), pack_params=False)
        return compiling.eligible(exe, model.init_state(config), None)
    assert eligible(model)
    assert not eligible(with_host_experts(model, {0: [0, 3]}))


def test_an_interrupted_start_up_leaves_no_worker(monkeypatch):
    """Ctrl-C while the engine waits for its workers: they are killed, not left compiling."""
    config = EngineConfig(max_seq_len=64, gamma=5, max_batch=1)
    model = Model.random(DSPARK_CONFIG, "bfloat16", seed=3)
    exe = Executables(model, config, 16, "xla", (), pack_params=False)
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

        def wait(self, timeout=None):
            if timeout is not None and timeout > 1.0:  # the engine's wait for a worker: interrupted
                raise KeyboardInterrupt
            return super().wait(timeout)
    monkeypatch.setattr(compiling.subprocess, "Popen", Recorded)
    decode = model.init_state(config)
    with pytest.raises(KeyboardInterrupt):
        compiling.compile_in_workers(exe, decode, None, list(exe.programs(decode, None)), 2)
    assert len(started) == 2 and all(process.poll() is not None for process in started)


def test_compiles_at_once_are_bounded_by_the_gpu_memory_outside_the_engine():
    """Twice the largest operand and 1 GiB a compile: the H100 run where three of four workers ran
    out of memory (19.8 GB outside a 75% pool, a 4.02 GiB stacked operand) gets 2 compiles at once;
    the embedded model's (a few MB) many; at least one; and on the CPU nothing says what is free,
    so the workers are not bounded."""
    gib = 2 ** 30
    assert compiling.concurrent_compiles(19.8e9, int(4.02 * gib)) == 2
    assert compiling.concurrent_compiles(36e9, int(4.02 * gib)) == 3
    assert compiling.concurrent_compiles(19.8e9, 4_000_000) == 18
    assert compiling.concurrent_compiles(0.5e9, 8 * gib) == 1
    if jax.default_backend() == "cpu":
        assert compiling.device_memory_outside_this_process() is None
