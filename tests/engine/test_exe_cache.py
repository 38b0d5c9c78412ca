"""Executables stored whole on disk: a stored program loads and computes what the compiled one does
(donation included), under a key that changes with the settings, the arguments and the sources; a
broken file is compiled again; host callbacks are never stored; a second engine of the same
configuration loads every executable instead of tracing it and decodes the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.config import EngineConfig
from jdspark.engine import exe_cache
from jdspark.engine.engine import Engine
from jdspark.engine.exe_cache import ExecutableCache
from jdspark.engine.executables import Executables
from jdspark.engine.request import SamplingParams
from tests.conftest import generate_to_end


def _program(a, b):
    return a @ b, b + 1


def _compiled(a, b):
    return jax.jit(_program, donate_argnums=(1,)).lower(a, b).compile()


def test_a_stored_executable_loads_and_computes_the_same(tmp_path):
    a, b = jnp.arange(16.0).reshape(4, 4), jnp.ones((4, 4))
    compiled = _compiled(a, b)
    want = jax.tree.map(np.asarray, compiled(a, jnp.ones((4, 4))))
    assert ExecutableCache(tmp_path, "settings").save("matmul", (a, b), compiled)
    loaded = ExecutableCache(tmp_path, "settings").load("matmul", (a, b), want)
    assert loaded is not None
    donated = jnp.ones((4, 4))
    got = loaded(a, donated)
    assert donated.is_deleted()  # the stored program still donates its argument
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_the_key_changes_with_settings_arguments_and_sources(tmp_path, monkeypatch):
    a, b = jnp.ones((4, 4)), jnp.ones((4, 4))
    ExecutableCache(tmp_path, "settings").save("matmul", (a, b), _compiled(a, b))
    outputs = (a, b)
    assert ExecutableCache(tmp_path, "other settings").load("matmul", (a, b), outputs) is None
    assert ExecutableCache(tmp_path, "settings").load("other name", (a, b), outputs) is None
    wide = jnp.ones((4, 8))
    assert ExecutableCache(tmp_path, "settings").load("matmul", (a, wide), outputs) is None
    monkeypatch.setattr(exe_cache, "source_digest", lambda: "edited sources")
    assert ExecutableCache(tmp_path, "settings").load("matmul", (a, b), outputs) is None


def test_what_the_compile_cache_handed_back_is_not_stored_on_the_cpu(tmp_path):
    """On the CPU an executable XLA's persistent cache handed back serializes without its JIT-linked
    functions (reloaded, it fails with "Function iota_multiply_fusion not found"), so
    `ExecutableCache.compile` says not to store it; one this process compiled is stored, reloads
    and runs. Mutation caught: a store that ignores the flag (the reloaded copy fails)."""
    def program(x):
        return jnp.cumsum(x[:, None] * jnp.arange(7.0)[None, :], axis=0).sum() + jnp.broadcast_to(x, (3, 5)).sum()
    x = jnp.arange(5.0)
    fresh, storable = ExecutableCache.compile(jax.jit(program).lower(x))
    assert storable
    jax.clear_caches()
    from_cache, storable = ExecutableCache.compile(jax.jit(program).lower(x))  # the run-wide cache answers
    assert storable == (jax.default_backend() != "cpu")
    cache = ExecutableCache(tmp_path, "settings")
    assert cache.save("program", (x,), fresh)
    assert float(cache.load("program", (x,), 0.0)(x)) == float(program(x)) == 450.0
    assert float(from_cache(x)) == 450.0  # the executable itself is fine; only its serialization is not


def test_a_broken_file_is_compiled_again(tmp_path, caplog):
    a, b = jnp.ones((4, 4)), jnp.ones((4, 4))
    cache = ExecutableCache(tmp_path, "settings")
    cache.save("matmul", (a, b), _compiled(a, b))
    [path] = tmp_path.glob("*.exe")
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level("WARNING", logger="jdspark.engine.exe_cache"):
        assert cache.load("matmul", (a, b), (a, b)) is None
    assert "did not load" in caplog.text


def test_programs_with_host_callbacks_are_not_stored(tmp_path):
    def doubled(x):
        return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    x = jnp.ones(3)
    assert not ExecutableCache(tmp_path, "settings").save("callback", (x,), jax.jit(doubled).lower(x).compile())
    assert not list(tmp_path.iterdir())


def test_static_key_names_the_kernels_and_the_packing(dspark_model):
    config = EngineConfig(max_seq_len=64, gamma=5, max_batch=2)
    def key(implementation, pack):
        return Executables(dspark_model, config, 16, implementation, (), pack).static_key()
    assert len({key("xla", False), key("pallas", False), key("xla", True)}) == 3
    assert key("xla", False) == key("xla", False)


def test_a_second_engine_loads_every_executable_and_decodes_the_same(dspark_model):
    """An engine of a configuration no other test builds (so its executables are compiled here: on
    the CPU, those XLA's run-wide cache hands back are not stored, and which test compiles a shared
    configuration first depends on the order), then the same again: nothing traced, the same greedy
    and seeded tokens. Mutation caught: a store that writes nothing, or keys that miss the arguments
    (the engine would load another program's executable and fail or decode differently)."""
    config = EngineConfig(max_seq_len=80, gamma=5, max_batch=2, batch_buckets=(2,))
    first = Engine(dspark_model, config, prefill_chunk=16, speculative=False)
    again = Engine(dspark_model, config, prefill_chunk=16, speculative=False)
    assert first.exe.loaded == 0 and again.exe.loaded == again.exe.count == first.exe.count
    prompt = np.array([5, 9, 2, 14, 7, 7, 1, 12], np.int32)
    for params in (SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)):
        want = generate_to_end(first, prompt, params).token_ids
        assert generate_to_end(again, prompt, params).token_ids == want


def test_the_store_follows_the_compile_cache_and_can_be_turned_off(monkeypatch):
    assert ExecutableCache.default("settings") is not None  # the tests' run-wide compile cache is on
    monkeypatch.setenv("JDSPARK_STORE_EXECUTABLES", "0")
    assert ExecutableCache.default("settings") is None
