"""Nothing is hard-coded to one config: Flash and Pro instantiate and trace abstractly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.config import EngineConfig, flash_config, pro_config, tiny_config, tiny_dspark_config
from jdspark.model.dsv4 import DSV4
from jdspark.model.layers import Keys
from jdspark.model.model import Model
from jdspark.model.state import init_state


@functools.cache
def abstract_model(make) -> DSV4:
    """The full-size model of `make()`, instantiated abstractly (once per module: about 2 s each)."""
    cfg = make()
    return nnx.eval_shape(lambda: DSV4(cfg, dtype=jnp.bfloat16, rngs=Keys(0)))


@functools.cache
def tiny_float32_model() -> Model:
    return Model.random(tiny_config(), "float32")


@pytest.mark.parametrize("make,params_b", [(flash_config, 284), (pro_config, 1600)])
def test_full_size_models_instantiate_and_trace(make, params_b):
    cfg = make()
    model = abstract_model(make)
    _, state = nnx.split(model)
    leaves = jax.tree_util.tree_leaves(nnx.to_pure_dict(state))
    total = sum(int(np.prod(x.shape)) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
    assert abs(total / 1e9 - params_b) / params_b < 0.05  # spec §1: 284B / 1.6T total parameters
    for length in (8, 260):  # no compressed entry yet; two HCA entries and 65 CSA entries
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
        logits, streams, _ = jax.eval_shape(lambda m, ids: m(ids), model, ids)
        assert logits.shape == (1, length, cfg.vocab_size) and logits.dtype == jnp.float32
        assert streams.shape == (1, length, cfg.hc_mult, cfg.hidden_size) and streams.dtype == jnp.bfloat16


@pytest.mark.parametrize("make,entry_bytes_per_token", [(flash_config, 6880), (pro_config, 30 * 320 + 31 * 8)])
def test_full_size_decode_state_and_extend_trace(make, entry_bytes_per_token):
    """Spec §6.1: compressed KV costs 320 B/token per CSA layer and 8 B/token per HCA layer (bf16)."""
    cfg = make()
    engine = EngineConfig(max_seq_len=65536, gamma=5, max_batch=2)
    decode = jax.eval_shape(lambda: init_state(cfg, engine, jnp.bfloat16))
    entries = [c.entries for layer in decode.layers for c in (layer.compressor, layer.indexer) if c is not None]
    per_token = sum(x.size * x.dtype.itemsize for x in entries) / engine.max_batch / engine.max_seq_len
    assert per_token == entry_bytes_per_token
    model = abstract_model(make)
    ids, n_valid = jax.ShapeDtypeStruct((2, 6), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    logits, features, new = jax.eval_shape(lambda m, d, i, n: m.extend(i, d, n, (40, 41, 42)), model, decode, ids, n_valid)
    assert logits.shape == (2, 6, cfg.vocab_size) and features.shape == (2, 6, 3 * cfg.hidden_size)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(decode)


def test_bfloat16_residual_streams_and_float32_logits():
    model = Model.random(tiny_config(), "bfloat16")
    logits, streams, _ = model.forward(np.arange(20)[None])
    assert streams.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_short_sequences_without_compressed_entries():
    model = tiny_float32_model()
    for length in (3, 5):  # fewer tokens than one CSA window; one CSA entry but no HCA entry
        assert np.isfinite(model.logits(np.arange(length))).all()


def test_batch_rows_are_independent():
    model = tiny_float32_model()
    ids = np.random.default_rng(0).integers(0, 512, (2, 24))
    batched = np.asarray(model.forward(ids)[0])
    np.testing.assert_allclose(batched[1], model.logits(ids[1]), atol=1e-5)


def test_qat_simulation_is_wired_in_and_small():
    base = Model.random(tiny_config(), "float32", seed=3)
    qat = Model.random(tiny_config(), "float32", seed=3, qat_sim=True)
    ids = np.arange(40) * 7 % 512
    a, b = base.logits(ids), qat.logits(ids)
    diff = np.abs(a - b)
    assert diff.max() > 1e-4  # the FP8/FP4 roundings change the result ...
    assert np.median(diff) < 0.1 * np.abs(a).mean()  # ... by a rounding-sized amount


def test_bad_token_ids_raise_clear_errors():
    model = tiny_float32_model()
    with pytest.raises(ValueError, match="token id 512 is outside"):
        model.logits([1, 512])
    with pytest.raises(ValueError, match="1-D"):
        model.logits([[1, 2]])
    with pytest.raises(ValueError, match="depth=1"):
        model.mtp_logits([1, 2], depth=1)


def test_mtp_logits_refuses_drafter_stages():
    model = Model.random(tiny_dspark_config(), "float32")
    with pytest.raises(ValueError, match="DSpark drafter stages, not MTP blocks"):
        model.mtp_logits([0, 1, 2])
