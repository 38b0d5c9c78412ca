"""Quantized checkpoints: random float weights -> quantized as the official files store them ->
written -> loaded -> dequantized equals the stored values bit for bit, for every format; the format
is detected from the tensor dtypes; bad files raise messages that name the tensor and file."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jdspark
from jdspark.checkpoint.export import official_tensors
from jdspark.checkpoint.formats import config_with, detect_storage
from jdspark.checkpoint.names import locate, path_to_official
from jdspark.checkpoint.quantize import quantize_tensors
from jdspark.checkpoint.safetensors_io import CheckpointDir, CheckpointError, save_file
from jdspark.config import tiny_config
from jdspark.model.layers import Linear
from jdspark.model.model import Model
from jdspark.model.moe import ExpertWeights
from jdspark.model.quantized import Storage
from tests.checkpoint.helpers import write
from tests.model.dequant_ref import dequantize_tensors

# Dimensions that are not multiples of 128 (partial FP8 blocks) and an FP4-compatible expert width.
CFG = tiny_config(num_hidden_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1,
                  moe_intermediate_size=96, q_lora_rank=160, o_lora_rank=48)
STORAGES = {
    "flash": Storage(linears="fp8", experts="fp4", scale_dtype="e8m0"),
    "base": Storage(linears="fp8", experts="fp8", scale_dtype="float32"),
    "fp8_experts_e8m0": Storage(linears="fp8", experts="fp8", scale_dtype="e8m0"),  # convert.py's FP4 -> FP8
    "fp4_experts_only": Storage(linears=None, experts="fp4"),
}
IDS = np.arange(40) * 7 % CFG.vocab_size


@pytest.fixture(scope="module")
def floats():
    return official_tensors(Model.random(CFG, "float32", seed=5))


@pytest.fixture(scope="module", params=sorted(STORAGES))
def stored(request, floats, tmp_path_factory):
    """(storage, config, stored tensors, their float32 decoding, checkpoint path) for one format."""
    storage = STORAGES[request.param]
    config = config_with(CFG, storage)
    tensors, dtype_names = quantize_tensors(floats, storage)
    path = write(tmp_path_factory.mktemp(request.param), tensors, config, shards=3, dtype_names=dtype_names)
    return storage, config, tensors, dequantize_tensors(tensors), path


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


def leaves(model: Model) -> dict[tuple, np.ndarray]:
    pure = nnx.to_pure_dict(model.params)
    return {tuple(k.key for k in kp): np.asarray(v) for kp, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def stacked(tensors: dict, path: tuple, n: int) -> np.ndarray:
    return np.stack([tensors[path_to_official(path, e)] for e in range(n)])


def test_compact_load_keeps_the_stored_bytes_and_decodes_them_exactly_inside_jit(stored):
    storage, config, tensors, decoded, path = stored
    model = jdspark.load_model(path, dtype="float32", progress=False)
    assert model.config == config
    e = config.n_routed_experts
    for p, value in leaves(model).items():
        want = stacked(tensors, p, e) if "experts" in p[-3:-2] else tensors[path_to_official(p)]
        if p[-1] == "tid2eid":
            np.testing.assert_array_equal(value, want)
            continue
        assert value.dtype == want.dtype, p
        np.testing.assert_array_equal(value.view(np.uint8), want.view(np.uint8), err_msg=p)
    dense = jax.jit(lambda m: {".".join(map(str, p)): m.dense_weight(jnp.float32) if isinstance(m, Linear)
                               else m.dense(jnp.float32) for p, m in nnx.iter_graph(m)
                               if isinstance(m, (Linear, ExpertWeights))})(model.module())
    assert len(dense) > 40
    for name, value in dense.items():
        path = tuple(int(x) if x.isdigit() else x for x in name.split("."))
        want = stacked(decoded, (*path, "weight"), e) if "experts" in path[-2:-1] else decoded[f"{name}.weight"]
        np.testing.assert_array_equal(bits(value), bits(want), err_msg=name)


def test_dequantize_at_load_gives_the_decoded_values(stored):
    _, config, _, decoded, path = stored
    expanded = jdspark.load_model(path, dtype="float32", dequantize=True, progress=False)
    for p, value in leaves(expanded).items():
        if p[-1] != "tid2eid":
            want = stacked(decoded, p, config.n_routed_experts) if "experts" in p[-3:-2] else \
                decoded[path_to_official(p)]
            np.testing.assert_array_equal(bits(value), bits(want), err_msg=p)


def test_dequantize_at_load_gives_the_same_logits(floats, tmp_path):
    """Up to float32 summation order: the weights are the same bits (the test above), but XLA fuses
    the compact model's in-program decode and the expanded model's dense weights differently (the
    logits were identical bits until a change elsewhere in the MoE program moved a fusion; 2e-6 since)."""
    tensors, dtype_names = quantize_tensors(floats, STORAGES["flash"])
    path = write(tmp_path, tensors, config_with(CFG, STORAGES["flash"]), dtype_names=dtype_names)
    compact = jdspark.load_model(path, dtype="float32", progress=False)
    expanded = jdspark.load_model(path, dtype="float32", dequantize=True, progress=False)
    np.testing.assert_allclose(expanded.logits(IDS), compact.logits(IDS), rtol=1e-5, atol=1e-5)


def test_format_is_detected_from_the_tensors(stored):
    storage, _, _, _, path = stored
    ckpt = CheckpointDir(path)
    pieces = {n: locate(n, ckpt.shape(n)) for n in ckpt.names()}
    assert detect_storage(ckpt, pieces, CFG) == storage  # the float config states no format: tensors decide


@pytest.fixture()
def flash(floats):
    tensors, dtype_names = quantize_tensors(floats, STORAGES["flash"])
    return tensors, dtype_names, config_with(CFG, STORAGES["flash"])


def load(tmp_path, tensors, config, dtype_names, shards=1):
    return jdspark.load_model(write(tmp_path, tensors, config, shards, dtype_names), dtype="float32", progress=False)


def rescale(t: dict, names: dict, name: str, value: np.ndarray) -> None:
    t[name] = value
    names.pop(name)


@pytest.mark.parametrize("edit,match", [
    (lambda t, names: t.pop("layers.0.attn.wq_a.scale"),
     r"missing 1 tensor\(s\), first 'layers.0.attn.wq_a.scale' \(F8_E8M0 \[2, 2\]\)"),
    (lambda t, names: t.pop("layers.2.ffn.experts.7.w2.weight"),
     r"'layers.2.ffn.experts.7.w2.weight' \(I8 \[256, 48\]\)"),
    (lambda t, names: t.update({"layers.1.ffn.experts.3.w2.weight": np.zeros((256, 96), np.int8)}),
     r"'layers.1.ffn.experts.3.w2.weight' in model.safetensors has shape \[256, 96\], expected \[256, 48\] \(I8\)"),
    (lambda t, names: rescale(t, names, "layers.1.attn.wq_b.scale", np.ones((4, 2), ml_dtypes.bfloat16)),
     r"mixed storage: FP8 block scales .* 'layers.1.attn.wq_b.scale' in model.safetensors as BF16"),
    (lambda t, names: t.update({"layers.1.ffn.experts.9.w1.weight": t["layers.1.ffn.experts.0.w1.weight"]}),
     r"'layers.1.ffn.experts.9.w1.weight' in model.safetensors: expert 9 is outside \[0, 8\)"),
    (lambda t, names: rescale(t, names, "layers.1.attn.wkv.scale", np.ones((4, 2), np.float32)),
     r"mixed storage: FP8 block scales .* 'layers.1.attn.wkv.scale' in model.safetensors as F32"),
])
def test_bad_quantized_tensors_raise_clear_errors(flash, tmp_path, edit, match):
    tensors, dtype_names, config = flash
    edit(tensors, dtype_names)
    with pytest.raises(CheckpointError, match=match):
        load(tmp_path, tensors, config, dtype_names)


def test_config_and_weights_must_agree(floats, flash, tmp_path):
    tensors, dtype_names = quantize_tensors(floats, STORAGES["base"])
    with pytest.raises(CheckpointError, match=r"config/weights mismatch: the config says expert_dtype='fp4', but "
                                              r"routed expert tensor 'layers.0.ffn.experts.0.w1.weight' in model"
                                              r".safetensors is stored as F8_E4M3 \(expected I8\)"):
        load(tmp_path / "a", tensors, flash[2], dtype_names)
    with pytest.raises(CheckpointError, match=r"config/weights mismatch: the config declares FP8 quantization, but "
                                              r"'layers.0.attn.wkv.weight' in model.safetensors is stored as F32"):
        load(tmp_path / "b", floats, flash[2].replace(expert_dtype=None), {})
    with pytest.raises(CheckpointError, match=r"'embed.weight' in model.safetensors has shape \[512, 256\], "
                                              r"expected \[512, 128\] \(BF16/F16/F32\) from the config"):
        load(tmp_path / "c", flash[0], flash[2].replace(hidden_size=128), flash[1])


def test_truncated_or_repeated_shards_are_named(flash, tmp_path):
    tensors, dtype_names, config = flash
    path = write(tmp_path / "t", tensors, config, shards=3, dtype_names=dtype_names)
    shard = path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: truncated: tensor '.*' ends at"):
        jdspark.load_model(path, progress=False)
    path = write(tmp_path / "r", tensors, config, shards=3, dtype_names=dtype_names)
    (path / "model.safetensors.index.json").unlink()  # now every *.safetensors file of the directory is read
    wq_a = tensors["layers.0.attn.wq_a.weight"]
    save_file({"layers.0.attn.wq_a.weight": wq_a}, path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.attn.wq_a.weight' is in both extra.safetensors "
                                              r"and model-\d+-of-00003.safetensors"):
        jdspark.load_model(path, progress=False)
    save_file({"model.layers.0.self_attn.q_a_proj.weight": wq_a}, path / "extra.safetensors")  # transformers' name
    with pytest.raises(CheckpointError, match=r"repeats 'layers.0.attn.wq_a.weight', already given by "):
        jdspark.load_model(path, progress=False)
