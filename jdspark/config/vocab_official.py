"""The reference code's `inference/config.json` vocabulary (its `ModelArgs` names): reader and writer."""

from __future__ import annotations

from typing import Any

from jdspark.config import vocab
from jdspark.config.base import ConfigError, QuantConfig

NAMES = {  # official ModelArgs name -> HF name
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
}

ORDER = (  # the keys `write` emits, in the order of the reference's inference/config.json
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_hash_layers", "n_mtp_layers", "n_heads",
    "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "route_scale", "swiglu_limit",
    "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank", "window_size",
    "compress_ratios", "compress_rope_theta", "original_seq_len", "rope_theta", "rope_factor", "beta_fast",
    "beta_slow", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "expert_dtype",
)

SCALE_DTYPES = {"fp8": "e8m0", "fp32": "float32"}  # official scale_dtype -> QuantConfig.scale_dtype


def read(data: dict, source: str) -> dict[str, Any]:
    """`DSV4Config` keyword arguments from an official `inference/config.json` object."""
    kw: dict[str, Any] = {"extra": {}}
    for key, value in data.items():
        vocab.take(kw, key, value, source, renames=NAMES)
    if data.get("dtype", "fp8") == "fp8":
        scale_dtype = SCALE_DTYPES.get(data.get("scale_dtype", "fp8"))
        if scale_dtype is None:
            raise ConfigError(f"{source}: scale_dtype={data['scale_dtype']!r}; expected 'fp8' or 'fp32'")
        kw["quantization"] = QuantConfig(scale_fmt=data.get("scale_fmt", "ue8m0"), scale_dtype=scale_dtype)
    elif data["dtype"] != "bf16":
        raise ConfigError(f"{source}: dtype={data['dtype']!r}; expected 'fp8' or 'bf16'")
    vocab.finish(kw, source)
    if kw.get("original_seq_len", 0) > 0:  # the official JSON has no max_position_embeddings: YaRN's target
        kw.setdefault("max_position_embeddings", int(kw["original_seq_len"] * kw.get("rope_factor", 1.0)))
    return kw


def write(config) -> dict[str, Any]:
    """A `DSV4Config` in the official vocabulary."""
    d: dict[str, Any] = {key: getattr(config, NAMES.get(key, key)) for key in ORDER}
    d["compress_ratios"] = list(config.compress_ratios)
    q = config.quantization
    d["dtype"] = "fp8" if q is not None else "bf16"
    if q is not None:
        d["scale_fmt"] = q.scale_fmt
        d["scale_dtype"] = "fp32" if q.scale_dtype == "float32" else "fp8"
    return d
