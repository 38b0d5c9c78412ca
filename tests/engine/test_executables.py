"""The per-slot inputs and the step output of the executables: packed into one int32 array each
way, unpacked exactly (bit-cast floats and unsigned seeds included); non-finite logits come back as
the invalid flag; the kernel setting is validated before compiling; a float32
model's executables compute every dot product at full float32 precision whatever the ambient
default; every call leaves the donated state in the buffers it came in."""

import collections
import itertools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import calls, executables
from jdspark.engine import twins as twins_module
from jdspark.engine.engine import Engine, SpecOptions
from jdspark.engine.request import SamplingParams
from jdspark.model import hyper
from tests.conftest import DSPARK_CONFIG


def test_slot_inputs_unpack_exactly_on_the_device():
    active = np.array([True, False, True])
    temperature = np.array([0.7, 0.0, 1.3], np.float32)
    top_k = np.array([50, 0, 3], np.int32)
    top_p = np.array([0.9, 1.0, np.nextafter(np.float32(1), np.float32(0))], np.float32)
    seed = np.array([2 ** 32 - 1, 0, 2 ** 31], np.uint32)
    counter = np.array([0, 5, 123456], np.int32)
    slot, width = np.array([3, 0, 15], np.int32), np.array([5, 0, 2], np.int32)
    prompt_len, reset = np.array([0, 6, 2], np.int32), np.array([False, True, False])
    prompt = np.arange(18, dtype=np.int32).reshape(3, 6)
    packed = calls.slot_inputs(prompt, active=active, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, counter=counter, slot=slot, width=width, prompt_len=prompt_len, reset=reset)
    assert packed.dtype == np.int32 and packed.shape == (3, calls.slot_columns(5))
    rows = jax.jit(calls.unpack_slots)(packed)
    sampling = rows.sampling
    for got, want in ((rows.active, active), (rows.slot, slot), (rows.width, width), (rows.prompt_len, prompt_len),
                      (rows.reset, reset), (rows.prompt, prompt)):
        np.testing.assert_array_equal(got, want)
    for name, want in [("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                       ("counter", counter)]:
        got = np.asarray(getattr(sampling, name))
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_an_outputs_copy_to_the_host_starts_at_its_call_on_a_gpu_only():
    """`fetch_early` starts the copy of a call's output on an accelerator (the read a step later finds
    it on the host), not on the CPU (already host memory) or for a host array; the results pass through."""
    class Output:
        def __init__(self, platform):
            self.platform, self.copies = platform, 0

        def devices(self):
            return [types.SimpleNamespace(platform=self.platform)]

        def copy_to_host_async(self):
            self.copies += 1

    gpu, cpu, state = Output("gpu"), Output("cpu"), object()
    assert calls.fetch_early((gpu, state, None)) == (gpu, state, None) and gpu.copies == 1
    assert calls.fetch_early((cpu, state, None))[0] is cpu and cpu.copies == 0
    host = np.zeros((2, 3), np.int32)
    assert calls.fetch_early((host, state, None))[0] is host


def test_read_output_splits_a_step_and_a_decode_result():
    confidence = np.array([[0.9, 0.5, 0.25], [1.0, 0.0, 1e-30]], np.float32)
    step = np.concatenate([np.array([[2, 11, 0], [0, -1, 1]], np.int32), np.array([[5, 6, 7], [8, 9, 10]], np.int32),
                           confidence.view(np.int32)], axis=1)
    out = calls.read_output(step, gamma=3)
    np.testing.assert_array_equal(out.n_accepted, [2, 0])
    np.testing.assert_array_equal(out.token, [11, -1])
    np.testing.assert_array_equal(out.invalid, [False, True])
    np.testing.assert_array_equal(out.drafts, [[5, 6, 7], [8, 9, 10]])
    np.testing.assert_array_equal(out.confidence, confidence)
    decode = calls.read_output(np.array([[0, 3, 0], [0, 9, 0]], np.int32), gamma=3)
    assert decode.drafts is None and decode.confidence is None and not decode.invalid.any()
    np.testing.assert_array_equal(decode.token, [3, 9])
    assert out.waited_s >= 0.0 and decode.waited_s >= 0.0 and not out.ready  # a host array: no device call
    done = jnp.asarray(step) + 0
    done.block_until_ready()
    assert calls.read_output(done, gamma=3).ready


@pytest.mark.slow  # the session dspark_engine
def test_non_finite_logits_come_back_as_the_invalid_flag(dspark_engine):
    """Parameters poisoned with NaN in one call (they are an argument of every executable): the
    prefill, decode and step[3] results say invalid, with token -1 and nothing accepted; with clean
    parameters the same calls are valid (one row alone: tests/speculative/test_non_finite.py).
    Mutation caught: the verifier's `p <= u q` test back (NaN accepts every draft) or the race's
    silent token 0, or an executable that drops the invalid column."""
    engine, exe = dspark_engine, dspark_engine.exe
    assert not engine.running
    b = engine.config.max_batch
    poisoned = jax.tree.map(lambda a: a * jnp.nan if jnp.issubdtype(a.dtype, jnp.floating) else a, exe.params.arrays)
    slots, prefill_slots = (calls.slot_inputs(np.zeros((b, engine.config.gamma + 1)), active=np.ones(b, bool),
                                              temperature=np.ones(b), top_k=np.zeros(b), top_p=np.ones(b),
                                              seed=np.arange(b), counter=np.zeros(b), slot=np.arange(b),
                                              width=np.full(b, 3), prompt_len=np.zeros(b), reset=np.full(b, reset))
                            for reset in (False, True))  # the prefill's slots emptied first
    ids, n_valid = np.full((b, exe.prefill_chunk), 5, np.int32), np.full(b, 3, np.int32)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the calls donate state and cache: the engine's stay
    for params, bad in ((exe.params.arrays, False), (poisoned, True)):
        out, state, draft_cache = exe.prefill(params, copy(engine.state), copy(engine.draft_cache), ids, n_valid,
                                              prefill_slots)
        outputs = [out]
        for call in (exe.decode, exe.step[3]):
            out, state, draft_cache = call(params, state, draft_cache, slots)
            outputs.append(out)
        for out in outputs:
            got = calls.read_output(out, engine.config.gamma)
            np.testing.assert_array_equal(got.invalid, bad)
            if bad:
                np.testing.assert_array_equal(got.token, -1)
                np.testing.assert_array_equal(got.n_accepted, 0)
            else:
                assert (got.token >= 0).all()


def test_the_kernel_setting_is_checked_before_compiling(dspark_model):
    with pytest.raises(ValueError, match="implementation='gpu' is not one of"):
        Engine(dspark_model, EngineConfig(max_seq_len=64, gamma=5, max_batch=1), speculative=False,
               implementation="gpu")


@pytest.mark.slow  # compiles a float32 engine under a low precision
def test_a_float32_model_compiles_every_dot_at_full_precision(dspark_model):
    """Under a low ambient precision (TF32 is the GPU default) the engine's dots still say highest."""
    with jax.default_matmul_precision("bfloat16"):
        engine = Engine(dspark_model, EngineConfig(max_seq_len=64, gamma=5, max_batch=1), prefill_chunk=8,
                        speculative=False)
    for exe in (engine.exe.prefill, engine.exe.decode):
        dots = re.findall(r" dot\(.*", exe.as_text())
        assert dots and all("operand_precision={highest,highest}" in d for d in dots)


def test_the_kernel_setting_reaches_every_mhc_site(dspark_model):
    """Executables trace the model graph with the setting on every Sinkhorn site (nothing global).
    Mutation caught: the setting applied to the sampler only."""
    config = EngineConfig(max_seq_len=64, gamma=5, max_batch=1)
    for name in ("pallas", "xla"):
        exe = executables.Executables(dspark_model, config, 8, name, (), pack_params=False)  # not compiled
        sites = [m for _, m in nnx.iter_graph(nnx.merge(exe.graphdef, dspark_model.params))
                 if isinstance(m, hyper.HyperConnection)]
        assert sites and {site.implementation for site in sites} == {name}
    assert {m.implementation for _, m in nnx.iter_graph(dspark_model.module())
            if isinstance(m, hyper.HyperConnection)} == {"auto"}  # the model itself is unchanged


@pytest.mark.gpu
def test_auto_lowers_to_the_pallas_kernels_on_the_gpu_and_xla_does_not(dspark_model):
    """On the GPU "auto" is "pallas": step[5] lowers to Triton calls of the race and of Sinkhorn;
    with "xla" neither appears (the lowered program, before XLA's own fusions)."""
    config = EngineConfig(max_seq_len=64, gamma=5, max_batch=1)
    decode, cache = dspark_model.init_state(config), dspark.init_draft_cache(DSPARK_CONFIG, 1, dspark_model.dtype)
    slots = jnp.zeros((1, calls.slot_columns(5)), jnp.int32)
    texts = {}
    for name in ("auto", "xla"):
        exe = executables.Executables(dspark_model, config, 8, name, (5,), pack_params=False)
        texts[name] = jax.jit(exe.step_function(5)).lower(exe.params.arrays, decode, cache, slots).as_text()
    assert "rejection_race" in texts["auto"] and "mhc_sinkhorn" in texts["auto"]
    assert "rejection_race" not in texts["xla"] and "mhc_sinkhorn" not in texts["xla"]


def test_every_step_keeps_the_state_and_draft_buffers_in_place(dspark_engine):
    """The donated state and draft cache come back in the same device buffers on every call of
    prefill, decode and step[k]. A buffer that moved would make XLA update the call's CUDA graph
    (the commands reading it) on the GPU. It failed while the programs dropped the donated inputs
    they do not read (the state's `written`): that output got a new buffer every call, and the
    draft cache's length took the freed one."""
    engine = dspark_engine

    def addresses():
        leaves = jax.tree_util.tree_flatten_with_path((engine.state, engine.draft_cache))[0]
        return {jax.tree_util.keystr(path): leaf.unsafe_buffer_pointer() for path, leaf in leaves}

    for speculative in (True, False):
        engine.set_policy(speculative=speculative, width_policy=lambda confidence: 2)
        before = addresses()
        rid = engine.add(np.array([5, 9, 2, 14], np.int32),  # prefilled now
                         SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)).request_id
        moved = [addresses() != before]
        try:
            for _ in range(4):
                engine.step()
                moved.append(addresses() != before)
        finally:
            engine.cancel(rid)  # the session engine's slot is free for the next test either way
        assert not any(moved), (speculative, moved)


@pytest.mark.slow  # the session dspark_engine
def test_an_engine_with_twins_emits_the_same_tokens(dspark_engine, monkeypatch):
    """Every executable of the session engine wrapped in twins whose second instance records its calls
    (on the CPU both instances are the one executable): the same tokens, target-only and speculative,
    and every other call ran the second instance."""
    engine, second = dspark_engine, []

    def recording(compiled):
        def call(*args):
            second.append(compiled)
            return compiled(*args)
        return call

    def generate():
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=4, ignore_eos=True)
        return engine.complete([engine.add(np.array([5, 9, 2, 14], np.int32), params)])[0].token_ids

    saved = {n: (b.prefill, b.decode, dict(b.step)) for n, b in engine.exe.buckets.items()}
    modes = [dict(speculative=False), dict(speculative=True, width_policy=lambda confidence: 3)]
    expected = []
    for mode in modes:
        engine.set_policy(**mode)
        expected.append(generate())
    monkeypatch.setattr(twins_module, "twin", recording)
    every = []

    def counted(compiled):  # both instances run through it: `every` counts all calls
        def call(*args):
            every.append(compiled)
            return compiled(*args)
        return call

    try:
        for n, bucket in engine.exe.buckets.items():
            programs = {(n, "decode"): bucket.decode, **{(n, k): c for k, c in bucket.step.items()},
                        **({(n, "prefill"): bucket.prefill} if bucket.prefill else {})}
            twins = twins_module.twins_of({key: counted(c) for key, c in programs.items()}, itertools.count(),
                                          itertools.count())
            bucket.decode, bucket.prefill = twins[n, "decode"], twins.get((n, "prefill"))
            bucket.step = {k: twins[n, k] for k in bucket.step}
        for mode, tokens in zip(modes, expected):
            engine.set_policy(**mode)
            assert generate() == tokens
        assert 0 < len(second) and abs(len(every) - 2 * len(second)) <= 2  # two parities: each off by one at most
    finally:
        for n, (prefill, decode, step) in saved.items():
            bucket = engine.exe.buckets[n]
            bucket.prefill, bucket.decode, bucket.step = prefill, decode, step


@pytest.mark.gpu
def test_on_the_gpu_twins_are_two_instances_and_change_no_token(dspark_model):
    """`twin_executables` on the GPU: each executable's second instance is another loaded executable,
    and a greedy and a sampled request get the tokens of an engine without twins."""
    def tokens(twins):
        engine = Engine(dspark_model, EngineConfig(max_seq_len=64, gamma=5, max_batch=1, twin_executables=twins),
                        prefill_chunk=16, options=SpecOptions(width=3))
        if twins:
            decode = engine.exe.buckets[1].decode
            assert decode.pair[0] is not decode.pair[1]
        return [engine.complete([engine.add(np.array([5, 9, 2, 14], np.int32), SamplingParams(
            max_tokens=24, temperature=t, seed=4, ignore_eos=True))])[0].token_ids for t in (0.0, 1.0)]
    assert tokens(True) == tokens(False)


def test_warm_up_calls_every_executable_and_leaves_every_slot_empty(dspark_engine, monkeypatch):
    """`Executables.warm_up` (the engine runs it before it is ready): every program is called once (a
    twin twice, each instance once; the CPU has no twins), so no served step pays a first call, and
    the state it leaves holds no request; the engine then generates what it generated before."""
    engine = dspark_engine
    engine.set_policy(speculative=True, width_policy=lambda confidence: 3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = engine.complete([engine.add(np.array([5, 9, 2, 14], np.int32), params)])[0].token_ids
    calls_of = collections.Counter()

    def counted(key, program):  # a twin stays one, each of its instances counted
        if isinstance(program, twins_module.Twins):
            monkeypatch.setattr(program, "pair", tuple(counted(key, instance) for instance in program.pair))
            return program

        def call(*args):
            calls_of[key] += 1
            return program(*args)
        return call

    twins = {(n, name) for n, b in engine.exe.buckets.items()
             for name, c in (("prefill", b.prefill), ("decode", b.decode), *b.step.items())
             if isinstance(c, twins_module.Twins)}
    for n, bucket in engine.exe.buckets.items():
        monkeypatch.setattr(bucket, "prefill", counted((n, "prefill"), bucket.prefill))
        monkeypatch.setattr(bucket, "decode", counted((n, "decode"), bucket.decode))
        monkeypatch.setattr(bucket, "step", {k: counted((n, k), c) for k, c in bucket.step.items()})
    engine.state, engine.draft_cache = engine.exe.warm_up(engine.state, engine.draft_cache)
    programs = {(n, name) for n, b in engine.exe.buckets.items() for name in ("prefill", "decode", *b.step)}
    assert calls_of == {key: 2 if key in twins else 1 for key in programs}
    assert not np.asarray(engine.state.length).any() and not np.asarray(engine.state.written).any()
    assert engine.complete([engine.add(np.array([5, 9, 2, 14], np.int32), params)])[0].token_ids == before


def test_the_engine_warms_its_executables_before_it_is_ready(dspark_model, monkeypatch):
    warmed = []
    real = executables.Executables.warm_up
    monkeypatch.setattr(executables.Executables, "warm_up",
                        lambda self, *state: warmed.append(self.count) or real(self, *state))
    Engine(dspark_model, EngineConfig(max_seq_len=32, gamma=5, max_batch=1), prefill_chunk=8, speculative=False)
    assert warmed == [2]  # prefill and decode of its one bucket
