"""DSV4Config: the three vocabularies parse to the same config; bad values name their key."""

import dataclasses
import json

import pytest

from flax import nnx

from jdspark.assets import default_model_dir
from jdspark.config import (ConfigError, DSparkConfig, DSV4Config, flash_config, pro_config, tiny_code_config,
                            tiny_config, tiny_dspark_config)
from jdspark.model.dsv4 import DSV4
from jdspark.model.layers import Keys


@pytest.mark.parametrize("make", [tiny_config, flash_config, pro_config])
def test_hf_and_official_vocabularies_round_trip(make):
    cfg = make()
    assert DSV4Config.from_dict(cfg.to_dict()) == cfg
    official = DSV4Config.from_dict(cfg.to_official_dict())
    assert official == cfg


def test_flash_schedule_and_kinds():
    cfg = flash_config()
    assert len(cfg.compress_ratios) == 44
    assert [cfg.layer_kind(i) for i in range(5)] == ["window", "window", "csa", "hca", "csa"]
    assert cfg.layer_kind(43) == "window"  # the MTP block
    assert cfg.is_hash_layer(2) and cfg.layer_kind(2) == "csa" and not cfg.is_hash_layer(3)
    assert pro_config().layer_kind(0) == "hca"


def test_transformers_vocabulary():
    pytest.importorskip("transformers")
    from tests.model.hf_oracle import hf_config
    cfg = tiny_config()
    d = json.loads(hf_config(cfg).to_json_string())
    d["num_nextn_predict_layers"] = 1  # transformers builds no MTP; the checkpoint has one
    parsed = DSV4Config.from_dict(d)
    assert parsed.compress_ratios == cfg.compress_ratios  # layer_types + compress_rates, MTP appended
    assert parsed.num_hash_layers == 3  # from mlp_layer_types
    assert (parsed.original_seq_len, parsed.rope_factor) == (32, 4.0)  # nested rope_parameters
    assert parsed.qk_rope_head_dim == 64


def test_flash_hf_config_json_excerpt():
    d = flash_config().to_dict()
    d["rope_scaling"] = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1}
    d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    cfg = DSV4Config.from_dict(d)
    assert cfg.quantization.scale_dtype == "e8m0" and cfg.expert_dtype == "fp4"
    assert cfg.original_seq_len == 65536


def test_0731_style_extra_stages_and_dspark_keys():
    d = flash_config().to_dict()
    d["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]
    d.update(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[40], dspark_markov_rank=64)
    cfg = DSV4Config.from_dict(d)
    assert len(cfg.compress_ratios) == 46 and cfg.extra["dspark_block_size"] == 5
    assert cfg.dspark == DSparkConfig(block_size=5, noise_token_id=3, target_layer_ids=(40,), markov_rank=64,
                                      num_stages=1)
    assert cfg.to_dict() == d  # the drafter's keys are written back verbatim


@pytest.mark.parametrize("key,value,match", [
    ("scoring_func", "relu", "scoring_func='relu'"),
    ("o_groups", 3, "o_groups=3"),
    ("num_experts_per_tok", 999, "num_experts_per_tok=999"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim=63"),
    ("compress_ratios", [0, 0, 4, 16, 4, 16, 4], "compress_ratios"),
    ("compress_ratios", [0, 0, 4], "compress_ratios has 3 entries"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("expert_dtype", "int4", "expert_dtype='int4'"),
    ("model_type", "deepseek_v41", "model_type"),
    ("rope_theta", -1.0, "rope_theta=-1.0"),
    ("n_shared_experts", 2, "n_shared_experts=2"),
    ("topk_method", "greedy", "topk_method"),
])
def test_bad_values_name_the_key(key, value, match):
    d = tiny_config().to_dict()
    d[key] = value
    with pytest.raises(ConfigError, match=match):
        DSV4Config.from_dict(d)


def test_missing_key_and_bad_yarn():
    d = tiny_config().to_dict()
    del d["head_dim"]
    with pytest.raises(ConfigError, match="head_dim"):
        DSV4Config.from_dict(d)
    d = tiny_config().to_dict()
    d["rope_scaling"] = {"type": "linear", "factor": 2}
    with pytest.raises(ConfigError, match="'linear'"):
        DSV4Config.from_dict(d)


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        DSV4Config.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DSV4Config.from_json(tmp_path / "config.json")


def test_qat_sim_is_a_build_option_that_needs_compatible_dims():
    assert "qat_sim" not in {f.name for f in dataclasses.fields(DSV4Config)}
    bad = tiny_config(head_dim=96, qk_rope_head_dim=64)  # a valid config: qat_sim is not its business
    with pytest.raises(ConfigError, match=r"qat_sim=True: .* = 32 and index_head_dim = 128"):
        DSV4(bad, rngs=Keys(0), qat_sim=True)
    with pytest.raises(ConfigError, match="qat_sim=True: .*power-of-two index_head_dim"):
        DSV4(tiny_config(index_head_dim=96), rngs=Keys(0), qat_sim=True)
    assert nnx.eval_shape(lambda: DSV4(tiny_config(), rngs=Keys(0), qat_sim=True)).qat_sim
    assert not nnx.eval_shape(lambda: DSV4(bad, rngs=Keys(0))).qat_sim


def test_dspark_is_parsed_once_at_construction():
    cfg = tiny_dspark_config()
    assert cfg.dspark is cfg.dspark  # a field, not a property that parses `extra` on every read
    assert cfg.dspark == DSparkConfig(block_size=5, noise_token_id=3, target_layer_ids=(3, 5), markov_rank=32,
                                      num_stages=2)
    assert tiny_config().dspark is None
    wide = cfg.replace(extra={**cfg.extra, "dspark_markov_rank": 256})  # replace parses anew
    assert wide.dspark.markov_rank == 256 and wide.to_dict()["dspark_markov_rank"] == 256
    deep = cfg.replace(num_nextn_predict_layers=3, compress_ratios=cfg.compress_ratios + (0,))
    assert deep.dspark.num_stages == 3  # the drafter's stages are the extra layers
    assert cfg.replace(extra={}).dspark is None
    with pytest.raises(ConfigError, match="lacks dspark_markov_rank"):  # at construction, not on first use
        tiny_dspark_config(extra=dict(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[3]))
    with pytest.raises(ConfigError, match=r"dspark_target_layer_ids=\[6\]"):
        tiny_dspark_config(extra={**cfg.extra, "dspark_target_layer_ids": [6]})
    with pytest.raises(ConfigError, match="dspark_noise_token_id=512 is outside the vocabulary"):
        tiny_dspark_config(extra={**cfg.extra, "dspark_noise_token_id": 512})
    with pytest.raises(ConfigError, match="dspark_confidence_temperatures"):
        tiny_dspark_config(extra={**cfg.extra, "dspark_confidence_temperatures": [1.0, 2.0]})


def test_tiny_code_config_is_the_shipped_config_and_writes_it_back_byte_for_byte():
    path = default_model_dir() / "config.json"
    shipped = DSV4Config.from_json(path)
    assert tiny_code_config() == shipped and tiny_code_config().dspark == shipped.dspark
    assert tiny_code_config().extra == shipped.extra
    assert json.dumps(shipped.to_dict(), indent=2) == path.read_text()  # what `save_model` writes
    assert json.dumps(tiny_code_config().to_dict(), indent=2) == path.read_text()
