"""The host experts' XLA FFI custom call (jdspark/experts/host_ffi.py, _host_ffi.cc): the same bits
as the pure_callback into cpu_gemv.moe_forward (its plan is built in C++ now) in every format and
dtype, also inside a hybrid layer and under vmap; the lowered program holds the custom call and no
host callback, so it can be serialized and loaded again; its C++ counters; clear errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import serialize_executable

from jdspark.experts import host_ffi
from jdspark.experts.banks import random_bank
from jdspark.experts.cpu_gemv import moe_forward
from jdspark.experts.hybrid import HybridExperts
from tests.experts.test_cpu_gemv import FORMATS, _bank, _inputs
from tests.model.test_quantized import FLASH, random_experts, routing


def ffi_forward(bank, x, ids, weights, dtype, limit=6.0):
    key = host_ffi.register(bank)
    fn = jax.jit(lambda x, i, w: host_ffi.host_experts(key, x, i, w, limit=limit, round_bf16=dtype == jnp.bfloat16,
                                                       threads=2))
    return np.asarray(fn(jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(weights)))


@pytest.mark.parametrize("fmt,scale", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_custom_call_equals_moe_forward_bit_for_bit(fmt, scale, dtype):
    bank = _bank(fmt, scale, held=[0, 2, 3, 5, 7, 8, 11])  # some experts elsewhere: their pairs add nothing
    for rows in (1, 2, 6, 17):
        x, ids, weights = _inputs(rows, seed=rows, bf16=dtype == jnp.bfloat16)
        want = moe_forward(bank, x, ids, weights, limit=6.0, dtype=jnp.dtype(dtype).name, threads=2)
        np.testing.assert_array_equal(ffi_forward(bank, x, ids, weights, dtype), want)


def test_rows_with_no_host_expert_are_zero():
    bank = _bank("fp4", "e8m0", held=[0, 1])
    x, _, weights = _inputs(3)
    ids = np.array([[2, 3, 4, 5]] * 3)
    np.testing.assert_array_equal(ffi_forward(bank, x, ids, weights, jnp.float32), np.zeros_like(x))
    ids[1, 2] = 1  # one pair of row 1 on the host
    got = ffi_forward(bank, x, ids, weights, jnp.float32)
    assert not got[[0, 2]].any() and got[1].any()


def test_hybrid_layer_paths_agree_and_only_the_custom_call_is_lowered():
    ex = random_experts(FLASH, jnp.bfloat16, seed=5)
    via = {name: HybridExperts(ex, [0, 3, 4, 9], dtype=jnp.bfloat16, via=name) for name in ("ffi", "callback")}
    rng = np.random.default_rng(6)
    idx, w = routing(rng, 6, 12, 3, 8)
    args = (jnp.asarray(rng.standard_normal((6, 256)), jnp.bfloat16), jnp.asarray(w), jnp.asarray(idx))
    calls = {name: jax.jit(lambda x, w, i, m=m: m(x, w, i)) for name, m in via.items()}
    np.testing.assert_array_equal(calls["ffi"](*args), calls["callback"](*args))
    text = calls["ffi"].lower(*args).as_text()
    assert host_ffi.START in text and host_ffi.FINISH in text and "callback" not in text
    assert "callback" in calls["callback"].lower(*args).as_text()


def test_custom_call_under_vmap_is_one_call_and_counts_its_experts():
    bank = random_bank("fp4", 256, 128, 12, seed=3, expert_ids=[1, 4, 6])
    key = host_ffi.register(bank)
    x, ids, weights = _inputs(8, k=3, seed=2)
    ids[:, 0] = 4  # expert 4 in every row: read once
    host_ffi.stats(bank, reset=True)
    fn = jax.jit(jax.vmap(lambda x, i, w: host_ffi.host_experts(key, x, i, w, limit=0.0, round_bf16=False,
                                                                threads=2)))
    got = fn(jnp.asarray(x).reshape(2, 4, 256), jnp.asarray(ids).reshape(2, 4, 3), jnp.asarray(weights).reshape(2, 4, 3))
    np.testing.assert_array_equal(np.asarray(got).reshape(8, 256), moe_forward(bank, x, ids, weights, limit=0.0))
    counts = host_ffi.stats(bank)
    held = np.unique(ids[np.isin(ids, bank.expert_ids)])
    assert counts["calls"] == 1 and counts["experts"] == len(held) and counts["seconds"] > 0


def test_a_serialized_executable_loads_and_finds_its_bank():
    """Programs holding the custom call can be stored (jdspark.engine.exe_cache): no Python object
    is part of them, the bank is named by its content key."""
    bank = _bank("fp8", "e8m0")
    x, ids, weights = _inputs(2)
    key = host_ffi.register(bank)
    args = (jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights))
    compiled = jax.jit(lambda x, i, w: host_ffi.host_experts(key, x, i, w, limit=6.0, round_bf16=False,
                                                             threads=1)).lower(*args).compile()
    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    loaded = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    np.testing.assert_array_equal(loaded(*args), compiled(*args))


def test_the_key_is_the_content():
    a, b = _bank("fp4", "e8m0", seed=1), _bank("fp4", "e8m0", seed=1)
    assert host_ffi.fingerprint(a) == host_ffi.fingerprint(b)
    b.raw("w2")[3, 10] ^= 1  # one bit of one expert's w2 (its first 4 KiB)
    assert host_ffi.fingerprint(a) != host_ffi.fingerprint(b)
    c = _bank("fp4", "e8m0", seed=1, held=list(range(11)))
    assert host_ffi.fingerprint(c) != host_ffi.fingerprint(a)


def test_a_key_no_bank_holds_is_an_error_naming_it():
    x, ids, weights = _inputs(1)
    with pytest.raises(Exception, match="no host bank is registered under key 12345"):
        jax.jit(lambda x, i, w: host_ffi.host_experts(12345, x, i, w, limit=0.0, round_bf16=False, threads=1))(
            jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights)).block_until_ready()


def test_a_released_bank_is_no_longer_found():
    bank = _bank("bf16", "e8m0", seed=9)
    key = host_ffi.register(bank)
    x, ids, weights = _inputs(1)
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    ffi_forward(bank, x, ids, weights, jnp.float32)
    del bank
    import gc
    gc.collect()
    with pytest.raises(Exception, match=f"registered under key {key}"):
        jax.jit(lambda x, i, w: host_ffi.host_experts(key, x, i, w, limit=0.0, round_bf16=False, threads=1))(
            jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights)).block_until_ready()


def test_calls_issued_back_to_back_each_get_their_own_result():
    """Calls queued without waiting (as overlapped engine steps issue them) reuse one staging area per
    (bank, shape) on a GPU, in stream order: every result is its own inputs' one."""
    bank = _bank("fp4", "e8m0", seed=4)
    key = host_ffi.register(bank)
    fn = jax.jit(lambda x, i, w: host_ffi.host_experts(key, x, i, w, limit=6.0, round_bf16=False, threads=2) * 2)
    inputs = [_inputs(3, seed=s) for s in range(12)]
    outs = [fn(jnp.asarray(x), jnp.asarray(i), jnp.asarray(w)) for x, i, w in inputs]
    for (x, i, w), got in zip(inputs, outs):
        np.testing.assert_array_equal(np.asarray(got), 2 * moe_forward(bank, x, i, w, limit=6.0))
