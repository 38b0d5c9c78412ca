"""The HF `config.json` vocabulary (as shipped with the official weights): reader and writer.

The reader also takes transformers' spellings (`vocab_transformers`). Keys whose value is fixed for
DeepSeek-V4 (`FIXED`) are checked on reading and written as those values.
"""

from __future__ import annotations

from typing import Any

from jdspark.config import vocab, vocab_transformers
from jdspark.config.base import ConfigError, QuantConfig

FIXED = {"num_key_value_heads": 1, "topk_method": "noaux_tc", "norm_topk_prob": True, "hidden_act": "silu",
         "tie_word_embeddings": False}

ORDER = (  # the keys `write` emits before rope_scaling, quantization_config and extra, in checkpoint order
    "vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "sliding_window", "compress_ratios", "compress_rope_theta", "rope_theta", "max_position_embeddings",
    "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "moe_intermediate_size", "num_hash_layers", "scoring_func", "topk_method",
    "norm_topk_prob", "routed_scaling_factor", "swiglu_limit", "hidden_act", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings", "expert_dtype",
)


def read(data: dict, source: str) -> dict[str, Any]:
    """`DSV4Config` keyword arguments from an HF (or transformers) `config.json` object."""
    data = dict(data)
    kw: dict[str, Any] = {"extra": {}}
    _check_fixed(data, source)
    eos = data.pop("eos_token_id", 1)
    kw["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
    _read_rope(data, kw, source)
    _read_quant(data, kw, source)
    spelled = vocab_transformers.pop(data)
    for key, value in data.items():
        vocab.take(kw, key, value, source)
    vocab_transformers.apply(spelled, kw, source)
    return vocab.finish(kw, source)


def write(config) -> dict[str, Any]:
    """A `DSV4Config` in the HF vocabulary; its `extra` (the drafter's keys) verbatim at the end."""
    d: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    for key in ORDER:
        d[key] = FIXED[key] if key in FIXED else getattr(config, key)
    d["compress_ratios"] = list(config.compress_ratios)
    if config.original_seq_len > 0:
        d["rope_scaling"] = {
            "type": "yarn",
            "factor": config.rope_factor,
            "original_max_position_embeddings": config.original_seq_len,
            "beta_fast": config.beta_fast,
            "beta_slow": config.beta_slow,
        }
    if config.quantization is not None:
        q = config.quantization
        d["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": q.fmt,
            "activation_scheme": "dynamic",
            "scale_fmt": q.scale_fmt,
            "weight_block_size": list(q.weight_block_size),
        }
    d.update(config.extra)
    return d


def _check_fixed(data: dict, source: str) -> None:
    """Pop the keys DeepSeek-V4 fixes, raising on any other value."""
    if data.pop("num_key_value_heads", 1) != 1:
        raise ConfigError(f"{source}: num_key_value_heads must be 1 (DeepSeek-V4 has one shared K=V head)")
    if data.pop("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act must be 'silu'")
    if data.pop("tie_word_embeddings", False):
        raise ConfigError(f"{source}: tie_word_embeddings must be false (embed and head are separate tensors)")
    if not data.pop("norm_topk_prob", True):
        raise ConfigError(f"{source}: norm_topk_prob=false is not supported (the reference always renormalises)")
    topk_method = data.pop("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"{source}: topk_method={topk_method!r}; DeepSeek-V4 uses 'noaux_tc'")
    for key in ("n_group", "topk_group"):
        if data.pop(key, 1) not in (1, None):
            raise ConfigError(f"{source}: {key} is set, but DeepSeek-V4 routing has no group limit")


def _read_rope(data: dict, kw: dict, source: str) -> None:
    scaling = data.pop("rope_scaling", None)
    params = data.pop("rope_parameters", None)
    if params:
        scaling = vocab_transformers.rope_scaling(params, kw)
    if not scaling:
        return
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return
    if rope_type != "yarn":
        raise ConfigError(f"{source}: rope_scaling type={rope_type!r}; DeepSeek-V4 uses 'yarn'")
    if scaling.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: rope attention_factor must be 1.0 (DeepSeek-V4 applies no YaRN mscale)")
    try:
        kw["rope_factor"] = float(scaling["factor"])
        kw["original_seq_len"] = int(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ConfigError(f"{source}: rope_scaling needs {e.args[0]!r}") from None
    kw["beta_fast"] = float(scaling.get("beta_fast", 32))
    kw["beta_slow"] = float(scaling.get("beta_slow", 1))


def _read_quant(data: dict, kw: dict, source: str) -> None:
    q = data.pop("quantization_config", None)
    if q is None:
        return
    fmt = q.get("fmt", "e4m3")
    if q.get("quant_method", "fp8") != "fp8" or fmt != "e4m3":
        raise ConfigError(f"{source}: quantization_config {q!r}: only fp8 e4m3 block quantization is known")
    block = tuple(q.get("weight_block_size", (128, 128)))
    if block != (128, 128):
        raise ConfigError(f"{source}: quantization_config.weight_block_size={list(block)}; expected [128, 128]")
    scale_fmt = q.get("scale_fmt")
    kw["quantization"] = QuantConfig(scale_fmt=scale_fmt, weight_block_size=block,
                                     scale_dtype="e8m0" if scale_fmt == "ue8m0" else "float32")
    if "expert_dtype" in q and "expert_dtype" not in data:
        kw["expert_dtype"] = q["expert_dtype"]
