"""Blocks of one kind share one traced `extend` (`block.shared_extend`): their graphs are equal exactly
when their kinds (hash routing, compression ratio) are, a model's program holds one function per kind
called once per layer, and its results are the blocks' own to float32 rounding. (Not bit for bit: XLA
inlines the calls, but the CPU program it then makes orders some sums differently, ~2e-6 apart.)"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from jdspark.config import EngineConfig, tiny_config
from jdspark.model import block, dsv4
from jdspark.model.model import Model, _extend

ENGINE = EngineConfig(max_seq_len=64, gamma=5, max_batch=2)


@pytest.fixture(scope="module")
def model():
    return Model.random(tiny_config(), "float32", seed=5)  # 6 layers: ratios 0, 0, 4, 16, 4, 16; 3 hash layers


def kinds(config):
    return [(config.is_hash_layer(i), config.layer_ratio(i)) for i in range(config.num_hidden_layers)]


def test_blocks_have_equal_graphs_exactly_when_their_kinds_are_equal(model):
    graphs, kind = [nnx.split(layer)[0] for layer in model.module().layers], kinds(model.config)
    for i in range(len(graphs)):
        for j in range(len(graphs)):
            assert (graphs[i] == graphs[j]) == (kind[i] == kind[j]), (i, j)


def test_the_program_lowers_each_kind_once_and_calls_it_per_layer(model):
    ids, n_valid = np.zeros((2, 3), np.int32), np.full((2,), 3, np.int32)
    text = _extend.lower(graphdef=model.graphdef, params=model.params, decode=model.init_state(ENGINE), ids=ids,
                         n_valid=n_valid, feature_layers=()).as_text()
    assert len(set(re.findall(r"func\.func private @(extend_one_kind\w*)", text))) == len(set(kinds(model.config))) == 4
    assert len(re.findall(r"call @extend_one_kind", text)) == model.config.num_hidden_layers


def test_the_shared_extend_gives_the_blocks_own_results(model, monkeypatch):
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9)).astype(np.int32)
    n_valid = np.array([9, 4], np.int32)

    def run():  # a fresh trace each time: the monkeypatch below applies
        return jax.jit(lambda params, decode: nnx.merge(model.graphdef, params).extend(ids, decode, n_valid, (2, 4)))(
            model.params, model.init_state(ENGINE))
    shared = run()
    monkeypatch.setattr(dsv4, "shared_extend", lambda: lambda block, *args: block.extend(*args))
    own = run()
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(own), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_each_program_traces_afresh_so_patched_code_is_seen(model, monkeypatch):
    """The shared trace lives as long as one program's trace: a block method patched before the next
    program is traced is what that program runs (benchmarks compare implementations so)."""
    ids, n_valid = np.zeros((2, 3), np.int32), np.full((2,), 3, np.int32)

    def logits():
        extend = jax.jit(lambda params, decode: nnx.merge(model.graphdef, params).extend(ids, decode, n_valid)[0])
        return np.asarray(extend(model.params, model.init_state(ENGINE)))
    before = logits()
    monkeypatch.setattr(block.Block, "_ffn", lambda self, x, ids, kept=None: x)  # every MoE sublayer skipped
    assert not np.allclose(logits(), before)


def test_settings_equal_in_value_but_not_in_type_are_different_kinds():
    """Graphs compare static attributes by value (2 == 2.0 == True), so two blocks apart only in a
    setting's type would share one trace without the repr in the shared function's key."""
    class Toy(nnx.Module):
        def __init__(self, setting):
            self.setting = setting
            self.w = nnx.Param(np.ones(2, np.float32))

    as_int, as_float, again = (nnx.split(Toy(v))[0] for v in (2, 2.0, 2))
    assert as_int == as_float  # what the key must not rely on alone
    assert block._Kind(as_int) != block._Kind(as_float)
    assert block._Kind(as_int) == block._Kind(again) and hash(block._Kind(as_int)) == hash(block._Kind(again))
