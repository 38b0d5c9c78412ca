"""`jdspark convert` + restore: the converted directory restores the identical model."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import jdspark
from jdspark.checkpoint.loader import convert
from jdspark.checkpoint.safetensors_io import CheckpointError
from jdspark.checkpoint.synthetic import write_checkpoint
from jdspark.cli import main
from jdspark.config import QuantConfig, tiny_config

CFG = tiny_config(num_hidden_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1, expert_dtype="fp4",
                  quantization=QuantConfig())
IDS = np.arange(30) * 11 % CFG.vocab_size


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(CFG, tmp_path_factory.mktemp("src"), seed=3, progress=False)


def flat(model) -> list:
    return jax.tree_util.tree_leaves(nnx.to_pure_dict(model.params))


def test_convert_restores_the_identical_model(source, tmp_path):
    dst = convert(source, tmp_path / "conv", dtype="bfloat16", progress=False)
    original = jdspark.load_model(source, progress=False)
    restored = jdspark.load_model(dst)
    assert restored.config == original.config and restored.graphdef == original.graphdef
    for a, b in zip(flat(original), flat(restored), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(restored.logits(IDS), original.logits(IDS))
    with pytest.raises(CheckpointError, match=r"converted for dtype='bfloat16', but dtype='float32' was asked"):
        jdspark.load_model(dst, dtype="float32")
    with pytest.raises(CheckpointError, match="restores its stored layout; convert again with --dequantize"):
        jdspark.load_model(dst, dequantize=True)
    shutil.rmtree(dst / "params")
    with pytest.raises(CheckpointError, match="cannot restore the converted parameters"):
        jdspark.load_model(dst)


def test_cli_convert_dequantized_float32(source, tmp_path, capsys):
    dst = tmp_path / "deq"
    assert main(["convert", str(source), str(dst), "--dtype", "float32", "--dequantize"]) == 0
    assert "wrote" in capsys.readouterr().out
    restored = jdspark.load_model(dst, dtype="float32")
    assert all(x.dtype == np.float32 or x.dtype == np.int32 for x in flat(restored))
    expanded = jdspark.load_model(source, "float32", dequantize=True, progress=False)
    for a, b in zip(flat(expanded), flat(restored), strict=True):
        np.testing.assert_array_equal(a, b)
    assert main(["convert", str(source), str(dst)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
