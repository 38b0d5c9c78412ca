"""save_model writes the official layout the loader reads back: quantized as the config says
(values = quantize-then-dequantize of the float weights), sharded with an index when asked."""

import json

import jax
import numpy as np
from flax import nnx

from jdspark.checkpoint.export import save_model
from jdspark.checkpoint.loader import load_model
from jdspark.checkpoint.quantize import roundtrip
from jdspark.config import QuantConfig, tiny_dspark_config
from jdspark.model.model import Model
from jdspark.model.quantized import Storage


def leaves(model: Model) -> dict:
    pure = nnx.to_pure_dict(model.params)
    return {tuple(k.key for k in kp): np.asarray(v) for kp, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def test_quantized_export_loads_back_as_the_roundtrip_values(tmp_path):
    config = tiny_dspark_config()
    model = Model.random(config, "float32", seed=1)
    stored = config.replace(quantization=QuantConfig(), expert_dtype="fp4")
    save_model(model, tmp_path, stored, shard_bytes=1 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = leaves(load_model(tmp_path, dtype="float32", dequantize=True, progress=False))
    storage = Storage.from_config(stored)
    quantized = 0
    for path, value in leaves(model).items():
        if storage.format_of(path) is not None:  # FP8 / FP4: exactly what the quantizers give
            quantized += 1
            np.testing.assert_array_equal(loaded[path], roundtrip(path, value, storage), err_msg=str(path))
        else:  # stored in the official dtype (bf16 or fp32), or integers
            np.testing.assert_allclose(loaded[path].astype(np.float64), value.astype(np.float64), rtol=1e-2,
                                       err_msg=str(path))
    assert quantized > 10


def test_exporting_again_what_was_loaded_is_lossless(tmp_path):
    """Quantizing dequantized values reproduces them (the drafter script re-exports the target)."""
    config = tiny_dspark_config(quantization=QuantConfig(), expert_dtype="fp4")
    save_model(Model.random(tiny_dspark_config(), "float32", seed=2), tmp_path / "a", config)
    first = load_model(tmp_path / "a", dtype="float32", dequantize=True, progress=False)
    save_model(first, tmp_path / "b", config)
    second = load_model(tmp_path / "b", dtype="float32", dequantize=True, progress=False)
    for path, value in leaves(first).items():
        np.testing.assert_array_equal(leaves(second)[path], value, err_msg=str(path))
