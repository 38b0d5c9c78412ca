"""Synthetic checkpoints: the official layout and storage dtypes, sharded, loadable; and the device
memory of the loaded quantized model is what the formats imply."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import jdspark
from jdspark.checkpoint.safetensors_io import CheckpointDir
from jdspark.checkpoint.synthetic import tensor_list, write_checkpoint
from jdspark.config import QuantConfig, tiny_config

FLASH_LIKE = tiny_config(expert_dtype="fp4", quantization=QuantConfig())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(FLASH_LIKE, tmp_path_factory.mktemp("synthetic"), seed=1, shard_bytes=2 << 20,
                            progress=False)


def test_official_layout_and_dtypes(checkpoint):
    ckpt = CheckpointDir(checkpoint)
    assert len(ckpt.files) == 5  # about 9 MiB in shards of at most 2 MiB
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ckpt.names()) == {name for name, _, _ in tensor_list(FLASH_LIKE)}
    expect = {  # spec §7.2, tiny dimensions
        "embed.weight": ("BF16", (512, 256)), "hc_head_fn": ("F32", (4, 1024)),
        "layers.2.attn_norm.weight": ("BF16", (256,)), "layers.2.attn.attn_sink": ("F32", (4,)),
        "layers.2.attn.wq_a.weight": ("F8_E4M3", (128, 256)), "layers.2.attn.wq_a.scale": ("F8_E8M0", (1, 2)),
        "layers.2.attn.wo_a.weight": ("F8_E4M3", (128, 256)), "layers.2.attn.indexer.wq_b.scale": ("F8_E8M0", (16, 1)),
        "layers.2.attn.compressor.wkv.weight": ("BF16", (256, 256)),
        "layers.0.ffn.gate.tid2eid": ("I64", (512, 2)), "layers.3.ffn.gate.bias": ("F32", (8,)),
        "layers.3.ffn.experts.7.w1.weight": ("I8", (128, 128)),
        "layers.3.ffn.experts.7.w1.scale": ("F8_E8M0", (128, 8)), "layers.3.ffn.experts.0.w2.weight": ("I8", (256, 64)),
        "layers.3.ffn.shared_experts.w2.weight": ("F8_E4M3", (256, 128)),
        "mtp.0.e_proj.scale": ("F8_E8M0", (2, 2)), "mtp.0.hc_head_scale": ("F32", (1,)),
    }
    for name, (dtype, shape) in expect.items():
        assert (ckpt.dtype_name(name), ckpt.shape(name)) == (dtype, shape), name
    tid2eid = ckpt.get("layers.0.ffn.gate.tid2eid")
    assert (np.sort(tid2eid, axis=1)[:, 0] != np.sort(tid2eid, axis=1)[:, 1]).all()  # distinct experts per token


def test_loaded_model_is_sane(checkpoint):
    model = jdspark.load_model(checkpoint, dtype="bfloat16", progress=False)
    assert model.config == FLASH_LIKE
    logits = model.logits(np.arange(24) * 5 % 512)
    assert np.isfinite(logits).all() and 0.1 < logits.std() < 100


def test_device_memory_is_what_the_formats_imply(checkpoint):
    """FP8 linears 1 + 1/128^2 bytes per weight, ds_fp4 experts 0.5 + 1/32, everything else at its
    dtype."""
    model = jdspark.load_model(checkpoint, dtype="bfloat16", progress=False)
    arrays = {tuple(k.key for k in kp): v for kp, v in
              jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(model.params))[0]}
    device = sum(a.nbytes for a in arrays.values())
    ckpt = CheckpointDir(checkpoint)
    implied = sum(ckpt.where[n].nbytes(n) for n in ckpt.names())  # BF16 / F32 floats are kept as stored
    assert abs(device / implied - 1) < 0.05, (device, implied)
    wq_a = arrays[("layers", 2, "attn", "wq_a", "weight")], arrays[("layers", 2, "attn", "wq_a", "scale")]
    fp8_bytes = (wq_a[0].nbytes + wq_a[1].nbytes) / wq_a[0].size
    w1 = arrays[("layers", 3, "ffn", "experts", "w1", "weight")], arrays[("layers", 3, "ffn", "experts", "w1", "scale")]
    fp4_bytes = (w1[0].nbytes + w1[1].nbytes) / (2 * w1[0].size)
    assert fp8_bytes == 1 + 2 / (128 * 256) and fp4_bytes == 0.53125
    print(f"device {device} B, implied {implied} B ({device / implied - 1:+.2%}); bytes per weight: "
          f"FP8 linear [128, 256] {fp8_bytes:.6f}, FP4 experts {fp4_bytes}")
