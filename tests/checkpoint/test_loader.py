"""Loading the official layout: names, sharded files, and clear errors that leave nothing half-loaded."""

import json

import ml_dtypes
import numpy as np
import pytest

import jdspark
from jdspark.checkpoint.export import official_tensors
from jdspark.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from jdspark.cli import main
from jdspark.config import tiny_config
from jdspark.model.model import Model
from tests.checkpoint import helpers

CFG = tiny_config(num_hidden_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1)


@pytest.fixture(scope="module")
def source():
    return Model.random(CFG, "float32", seed=11)


def write(path, tensors, config=CFG):
    return helpers.write(path, tensors, config)


def test_round_trip_bitwise_and_bf16_storage(source, tmp_path):
    tensors = official_tensors(source)
    assert "layers.0.ffn.gate.tid2eid" in tensors and "layers.1.hc_attn_fn" in tensors
    assert "layers.1.attn.indexer.compressor.ape" in tensors and "mtp.0.hc_head_scale" in tensors
    loaded = jdspark.load_model(write(tmp_path / "f32", tensors), dtype="float32")
    ids = np.arange(30) % CFG.vocab_size
    np.testing.assert_array_equal(loaded.logits(ids), source.logits(ids))
    bf16 = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    bf16["layers.1.attn.wq_a.weight"] = tensors["layers.1.attn.wq_a.weight"]  # float dtypes may mix
    model = jdspark.load_model(write(tmp_path / "bf16", bf16), dtype="bfloat16")
    assert np.isfinite(model.logits(ids)).all()


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("layers.1.attn.wq_a.weight"),
     r"missing 1 tensor\(s\), first 'layers.1.attn.wq_a.weight' \(BF16/F16/F32 \[128, 256\]\)"),
    (lambda t: t.pop("layers.2.ffn.experts.5.w2.weight"), "layers.2.ffn.experts.5.w2.weight"),
    (lambda t: t.update({"layers.1.attn.wq_a.weight": np.zeros((3, 3), np.float32)}),
     r"'layers.1.attn.wq_a.weight' in model.safetensors has shape \[3, 3\], expected \[128, 256\]"),
    (lambda t: t.update({"layers.9.attn_norm.weight": np.ones(256, np.float32)}),
     "unexpected tensor 'layers.9.attn_norm.weight'"),
    (lambda t: t.update({"layers.1.attn.wq_a.weight": np.zeros((128, 256), ml_dtypes.float8_e4m3fn)}),
     r"mixed storage: FP8 linear weights .* 'layers.1.attn.wq_a.weight' in model.safetensors as F8_E4M3"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": np.full((512, 2), 8, np.int64)}),
     r"expert ids must lie in \[0, 8\)"),
])
def test_bad_checkpoints_raise_clear_errors(source, tmp_path, edit, match):
    tensors = official_tensors(source)
    edit(tensors)
    with pytest.raises(CheckpointError, match=match):
        jdspark.load_model(write(tmp_path, tensors), dtype="float32")


def test_truncated_file_and_config_mismatch(source, tmp_path):
    path = write(tmp_path / "t", official_tensors(source))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(path / "model.safetensors")
    other = write(tmp_path / "m", official_tensors(source), CFG.replace(hidden_size=128))
    with pytest.raises(CheckpointError, match="expected"):
        jdspark.load_model(other, dtype="float32")
    with pytest.raises(CheckpointError, match="no config.json"):
        jdspark.load_model(tmp_path / "nowhere")


def test_cli_info_and_logits(source, tmp_path, capsys):
    path = write(tmp_path / "cli", official_tensors(source))
    assert main(["info", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["compress_ratios"] == [0, 4, 16, 0]
    assert main(["logits", str(path), "1,2,3", "--dtype", "float32", "--top", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["logits", str(path), "1,999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err


@pytest.mark.skipif(__import__("jax").default_backend() != "cpu", reason="the CPU backend's default")
def test_faces_decode_small_checkpoints_at_load_on_a_cpu(tmp_path):
    """`Generator.from_pretrained` decodes quantized weights at load on a CPU backend (decoding them
    in every call costs more there), but not a checkpoint over the size bound, a sharded one or one
    with host experts."""
    from jdspark.assets import default_model_dir
    from jdspark.checkpoint.loader import CPU_DECODE_AT_LOAD_MAX_BYTES, decode_at_load_by_default
    assert decode_at_load_by_default(default_model_dir())
    assert not decode_at_load_by_default(default_model_dir(), gpu_memory=1e9)
    assert not decode_at_load_by_default(default_model_dir(), mesh=object())
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:  # sparse: no disk written
        f.truncate(CPU_DECODE_AT_LOAD_MAX_BYTES + 1)
    assert not decode_at_load_by_default(big)
