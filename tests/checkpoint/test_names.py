"""The one name table: official and transformers names -> parameter paths, and back."""

import jax
from flax import nnx

from jdspark.checkpoint.names import Piece, hf_to_official, locate, official_to_path, path_to_official
from jdspark.config import QuantConfig, tiny_config
from jdspark.model.quantized import Storage, abstract_model


def test_names_round_trip():
    for name in ["layers.3.hc_ffn_base", "hc_head_fn", "layers.0.attn.indexer.compressor.wkv.weight",
                 "mtp.0.e_proj.weight", "layers.2.ffn.gate.tid2eid"]:
        path, expert = official_to_path(name)
        assert expert is None and path_to_official(path) == name
    path, expert = official_to_path("layers.7.ffn.experts.12.w3.weight")
    assert path == ("layers", 7, "ffn", "experts", "w3", "weight") and expert == 12
    assert path_to_official(path, expert) == "layers.7.ffn.experts.12.w3.weight"
    assert hf_to_official("model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight") == \
        "layers.2.attn.indexer.weights_proj.weight"
    assert hf_to_official("model.layers.2.self_attn.compressor.kv_norm.weight") == \
        "layers.2.attn.compressor.norm.weight"
    assert hf_to_official("model.layers.2.self_attn.kv_norm.weight") == "layers.2.attn.kv_norm.weight"
    assert hf_to_official("model.layers.0.attn_hc.fn") == "layers.0.hc_attn_fn"



def test_scales_and_quantized_experts():
    path, expert = official_to_path("layers.1.ffn.experts.3.w2.scale")
    assert path == ("layers", 1, "ffn", "experts", "w2", "scale") and expert == 3
    assert path_to_official(path, expert) == "layers.1.ffn.experts.3.w2.scale"
    assert official_to_path("layers.1.attn.wq_a.scale") == (("layers", 1, "attn", "wq_a", "scale"), None)
    assert hf_to_official("model.layers.1.self_attn.q_a_proj.weight_scale_inv") == "layers.1.attn.wq_a.scale"
    assert locate("mtp.0.emb.tok_emb.weight", (4, 4)) == [] and locate("mtp.0.head.weight", (4, 4)) == []


def test_transformers_stacked_experts_split_into_w1_and_w3():
    prefix = ("layers", 2, "ffn", "experts")
    for suffix, leaf in (("", "weight"), ("_scale_inv", "scale")):
        pieces = locate(f"model.layers.2.mlp.experts.gate_up_proj{suffix}", (8, 10, 4))
        assert pieces == [Piece((*prefix, "w1", leaf), None, (slice(None), slice(0, 5))),
                          Piece((*prefix, "w3", leaf), None, (slice(None), slice(5, None)))]
        assert locate(f"model.layers.2.mlp.experts.down_proj{suffix}", (8, 4, 5)) == \
            [Piece((*prefix, "w2", leaf), None)]


def test_every_parameter_of_every_layout_has_an_official_name():
    """hf_to_official leaves official names alone (one code path for both vocabularies), and
    official names round-trip to the parameter paths of float and quantized layouts alike."""
    quantized = tiny_config(expert_dtype="fp4", quantization=QuantConfig())
    for storage in (Storage(), Storage.from_config(quantized)):
        _, state = abstract_model(quantized, "float32", storage)
        for kp, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
            path = tuple(k.key for k in kp)
            expert = 0 if "experts" in path[-3:-2] else None
            name = path_to_official(path, expert)
            assert hf_to_official(name) == name
            assert locate(name, leaf.shape) == [Piece(path, expert)]
