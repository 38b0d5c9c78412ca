"""`qat_sim` is a load option: the checkpoint config does not carry it, `load_model` builds with it."""

import json

import numpy as np
import pytest

import jdspark
from jdspark.checkpoint import orbax_io
from jdspark.checkpoint.export import official_tensors
from jdspark.checkpoint.loader import convert
from jdspark.config import ConfigError, tiny_config
from jdspark.model.model import Model
from tests.checkpoint import helpers

CFG = tiny_config(num_hidden_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1)
IDS = np.arange(30) * 7 % CFG.vocab_size


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return helpers.write(tmp_path_factory.mktemp("src"), official_tensors(Model.random(CFG, "float32", seed=4)), CFG)


def test_load_model_builds_with_the_qat_option(source):
    plain = jdspark.load_model(source, dtype="float32", progress=False)
    qat = jdspark.load_model(source, dtype="float32", qat_sim=True, progress=False)
    assert (plain.qat_sim, qat.qat_sim) == (False, True) and qat.config == plain.config == CFG
    assert "qat_sim" not in json.loads((source / "config.json").read_text())
    reference = Model.random(CFG, "float32", seed=4, qat_sim=True)
    np.testing.assert_array_equal(qat.logits(IDS), reference.logits(IDS))
    assert np.abs(qat.logits(IDS) - plain.logits(IDS)).max() > 1e-4  # the option reaches the layers


def test_converted_checkpoint_restores_with_the_qat_option(source, tmp_path):
    dst = convert(source, tmp_path / "conv", dtype="float32", progress=False)
    assert "qat_sim" not in json.loads((dst / "config.json").read_text())
    qat = orbax_io.restore(dst, "float32", qat_sim=True)
    assert qat.qat_sim and not jdspark.load_model(dst, dtype="float32").qat_sim
    reference = jdspark.load_model(source, dtype="float32", qat_sim=True, progress=False)
    np.testing.assert_array_equal(qat.logits(IDS), reference.logits(IDS))


def test_qat_option_checks_the_checkpoint_dims(tmp_path):
    cfg = CFG.replace(head_dim=96, qk_rope_head_dim=64)
    path = helpers.write(tmp_path / "odd", official_tensors(Model.random(cfg, "float32", seed=1)), cfg)
    with pytest.raises(ConfigError, match="qat_sim=True: needs .* = 32 and index_head_dim = 128"):
        jdspark.load_model(path, dtype="float32", qat_sim=True, progress=False)
