"""The checkpoint vocabularies: the key tables and steps their readers share.

DeepSeek-V4 checkpoints ship two JSON files that name the same hyper-parameters differently: the
HF `config.json` (`hidden_size`, `compress_ratios`, `rope_scaling`, ...; `vocab_hf`) and the
reference code's `inference/config.json` (`dim`, `window_size`, `rope_factor`, ...;
`vocab_official`). transformers' own `DeepseekV4Config.to_dict()` adds a third spelling
(`layer_types` + `compress_rates`, `mlp_layer_types`, `rope_parameters`; `vocab_transformers`),
read as part of the HF vocabulary. Each reader returns the keyword arguments of `DSV4Config`
(HF names); the `dspark_*` keys go verbatim into `extra`. This module holds what they share.
"""

from __future__ import annotations

import logging
from typing import Any

from jdspark.config.dspark import PREFIX as DSPARK_PREFIX
from jdspark.config.base import ConfigError

log = logging.getLogger("jdspark.config")

# Keys that carry no model semantics for us (metadata, training-only or runtime-only fields).
IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "initializer_range", "use_cache", "attention_bias", "mlp_bias", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "pad_token_id",
    "max_batch_size", "max_seq_len", "_name_or_path", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "_attn_implementation_autoset", "scale_fmt", "scale_dtype",
    "default_theta", "ep_size", "first_k_dense_replace",
}

SAME_NAMES = {  # HF names that the official vocabulary spells the same way (or that only HF has)
    "vocab_size", "n_routed_experts", "n_shared_experts", "swiglu_limit", "q_lora_rank", "head_dim",
    "o_groups", "o_lora_rank", "compress_ratios", "compress_rope_theta", "rope_theta",
    "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "expert_dtype", "rope_factor", "original_seq_len", "beta_fast", "beta_slow",
    "num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_hash_layers",
    "num_nextn_predict_layers", "num_attention_heads", "num_experts_per_tok", "scoring_func",
    "routed_scaling_factor", "qk_rope_head_dim", "rms_norm_eps", "sliding_window",
    "max_position_embeddings", "bos_token_id", "eos_token_id",
}

REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
    "compress_ratios", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "index_n_heads", "index_head_dim", "index_topk",
)


def take(kw: dict[str, Any], key: str, value: Any, source: str, renames: dict[str, str] | None = None) -> None:
    """One key the vocabulary has no special rule for: a (renamed) field, a drafter key, ignored
    metadata, or unknown (logged, dropped)."""
    if renames and key in renames:
        kw[renames[key]] = value
    elif key in SAME_NAMES:
        kw[key] = value
    elif key.startswith(DSPARK_PREFIX):
        kw.setdefault("extra", {})[key] = value
    elif key not in IGNORED:
        log.warning("%s: ignoring unknown key %r", source, key)


def finish(kw: dict[str, Any], source: str) -> dict[str, Any]:
    """Check the required keys and complete `compress_ratios` with the extra (MTP/drafter) layers."""
    missing = [k for k in REQUIRED if k not in kw]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing}")
    kw.setdefault("num_nextn_predict_layers", 1)
    kw.setdefault("extra", {})
    ratios = [int(r) for r in kw["compress_ratios"]]
    n_layers, n_mtp = int(kw["num_hidden_layers"]), int(kw["num_nextn_predict_layers"])
    if len(ratios) < n_layers:
        raise ConfigError(f"{source}: compress_ratios has {len(ratios)} entries but num_hidden_layers={n_layers}")
    if len(ratios) < n_layers + n_mtp:  # transformers' layer_types cover the main layers only
        ratios += [0] * (n_layers + n_mtp - len(ratios))
    kw["compress_ratios"] = tuple(ratios)
    return kw
