"""Model configuration: one `DSV4Config` read from either checkpoint vocabulary.

DeepSeek-V4 checkpoints ship two JSON files that name the same hyper-parameters differently: the
HF `config.json` (`hidden_size`, `compress_ratios`, `rope_scaling`, ...) and the reference code's
`inference/config.json` (`dim`, `window_size`, `rope_factor`, ...). transformers' own
`DeepseekV4Config.to_dict()` adds a third spelling (`layer_types` + `compress_rates`,
`mlp_layer_types`, `rope_parameters`). All three parse into the same frozen dataclass, which uses
the HF names. Invalid or inconsistent values raise `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CSA_RATIO = 4  # the reference treats ratio 4 as overlapping CSA with an indexer, any other nonzero as HCA
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
EXPERT_DTYPES = (None, "fp4", "fp8")


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent; the message names the key."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Storage format of the non-expert linears (HF `quantization_config`)."""

    fmt: str = "e4m3"
    scale_fmt: str | None = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_dtype: str = "e8m0"  # "e8m0" (Flash/Pro) or "float32" (the -Base variants)


@dataclasses.dataclass(frozen=True)
class DSV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per main layer, then one per extra (MTP / drafter) layer
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int = 1
    n_shared_experts: int = 1
    num_hash_layers: int = 0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0  # 0 disables the clamp (reference semantics)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 1.0
    original_seq_len: int = 0  # YaRN's original context; 0 disables YaRN (reference semantics)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    expert_dtype: str | None = None
    quantization: QuantConfig | None = None
    qat_sim: bool = False  # runtime option: simulate the reference's FP8/FP4 QAT rounding (spec §5.8)
    # Keys for later stages (dspark_*), kept verbatim; outside hash/eq so the config stays hashable.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        _validate(self)

    # ---- derived facts -----------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of layer `layer_id` (main layers first, then MTP/drafter layers)."""
        return self.compress_ratios[layer_id]

    def layer_kind(self, layer_id: int) -> str:
        """'window' (SWA only), 'csa' (ratio 4, overlapping, indexer) or 'hca' (any other ratio)."""
        ratio = self.compress_ratios[layer_id]
        return "window" if ratio == 0 else "csa" if ratio == CSA_RATIO else "hca"

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    @property
    def dspark(self) -> "DSparkConfig | None":
        """The DSpark drafter's settings (0731 `dspark_*` keys), or None for a model without one.
        Its stages are the extra layers after the main ones (`num_nextn_predict_layers` of them)."""
        if "dspark_block_size" not in self.extra:
            return None
        return DSparkConfig.from_extra(self.extra, self)

    def replace(self, **changes) -> "DSV4Config":
        return dataclasses.replace(self, **changes)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> "DSV4Config":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}: a checkpoint directory needs config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "DSV4Config":
        """Parse the HF, transformers or official `inference/config.json` vocabulary."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ConfigError(f"{source}: model_type={model_type!r} is not 'deepseek_v4' (DeepSeek-V4.1 is a different model)")
        official = "dim" in data and "hidden_size" not in data
        kw = _from_official(data, source) if official else _from_hf(data, source)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The HF checkpoint vocabulary (`config.json` as shipped with the official weights)."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios),
            "compress_rope_theta": self.compress_rope_theta,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hash_layers": self.num_hash_layers,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hidden_act": "silu",
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "expert_dtype": self.expert_dtype,
        }
        if self.original_seq_len > 0:
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
            }
        if self.quantization is not None:
            q = self.quantization
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": q.fmt,
                "activation_scheme": "dynamic",
                "scale_fmt": q.scale_fmt,
                "weight_block_size": list(q.weight_block_size),
            }
        d.update(self.extra)
        return d

    def to_official_dict(self) -> dict[str, Any]:
        """The reference code's `inference/config.json` vocabulary."""
        d = {
            "vocab_size": self.vocab_size,
            "dim": self.hidden_size,
            "moe_inter_dim": self.moe_intermediate_size,
            "n_layers": self.num_hidden_layers,
            "n_hash_layers": self.num_hash_layers,
            "n_mtp_layers": self.num_nextn_predict_layers,
            "n_heads": self.num_attention_heads,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "n_activated_experts": self.num_experts_per_tok,
            "score_func": self.scoring_func,
            "route_scale": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "q_lora_rank": self.q_lora_rank,
            "head_dim": self.head_dim,
            "rope_head_dim": self.qk_rope_head_dim,
            "norm_eps": self.rms_norm_eps,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "window_size": self.sliding_window,
            "compress_ratios": list(self.compress_ratios),
            "compress_rope_theta": self.compress_rope_theta,
            "original_seq_len": self.original_seq_len,
            "rope_theta": self.rope_theta,
            "rope_factor": self.rope_factor,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "expert_dtype": self.expert_dtype,
            "dtype": "fp8" if self.quantization is not None else "bf16",
        }
        if self.quantization is not None:
            d["scale_fmt"] = self.quantization.scale_fmt
            d["scale_dtype"] = "fp32" if self.quantization.scale_dtype == "float32" else "fp8"
        return d


# ---- vocabularies ------------------------------------------------------------------------------

# Keys that carry no model semantics for us (metadata, training-only or runtime-only fields).
_IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map",
    "initializer_range", "use_cache", "attention_bias", "mlp_bias", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "pad_token_id",
    "max_batch_size", "max_seq_len", "_name_or_path", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "_attn_implementation_autoset", "scale_fmt", "scale_dtype",
    "default_theta", "ep_size", "first_k_dense_replace",
}

_OFFICIAL_NAMES = {  # official ModelArgs name -> HF name
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

_SAME_NAMES = {
    "vocab_size", "n_routed_experts", "n_shared_experts", "swiglu_limit", "q_lora_rank", "head_dim",
    "o_groups", "o_lora_rank", "compress_ratios", "compress_rope_theta", "rope_theta",
    "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "expert_dtype", "rope_factor", "original_seq_len", "beta_fast", "beta_slow",
    "num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_hash_layers",
    "num_nextn_predict_layers", "num_attention_heads", "num_experts_per_tok", "scoring_func",
    "routed_scaling_factor", "qk_rope_head_dim", "rms_norm_eps", "sliding_window",
    "max_position_embeddings", "bos_token_id", "eos_token_id",
}

_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
    "compress_ratios", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "index_n_heads", "index_head_dim", "index_topk",
)

_LAYER_TYPE_KIND = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


def _from_official(data: dict, source: str) -> dict:
    kw: dict[str, Any] = {"extra": {}}
    for key, value in data.items():
        if key in _OFFICIAL_NAMES:
            kw[_OFFICIAL_NAMES[key]] = value
        elif key in _SAME_NAMES:
            kw[key] = value
        elif key.startswith("dspark_"):
            kw["extra"][key] = value
        elif key not in _IGNORED:
            log.warning("%s: ignoring unknown key %r", source, key)
    if data.get("dtype", "fp8") == "fp8":
        scale_dtype = {"fp8": "e8m0", "fp32": "float32"}.get(data.get("scale_dtype", "fp8"))
        if scale_dtype is None:
            raise ConfigError(f"{source}: scale_dtype={data['scale_dtype']!r}; expected 'fp8' or 'fp32'")
        kw["quantization"] = QuantConfig(scale_fmt=data.get("scale_fmt", "ue8m0"), scale_dtype=scale_dtype)
    elif data["dtype"] != "bf16":
        raise ConfigError(f"{source}: dtype={data['dtype']!r}; expected 'fp8' or 'bf16'")
    _require(kw, source)
    kw.setdefault("num_nextn_predict_layers", 1)
    kw["compress_ratios"] = _ratios(kw, source)
    if kw.get("original_seq_len", 0) > 0:  # the official JSON has no max_position_embeddings: YaRN's target
        kw.setdefault("max_position_embeddings", int(kw["original_seq_len"] * kw.get("rope_factor", 1.0)))
    return kw


def _from_hf(data: dict, source: str) -> dict:
    data = dict(data)
    kw: dict[str, Any] = {"extra": {}}
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
    eos = data.pop("eos_token_id", 1)
    kw["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
    _parse_rope(data, kw, source)
    _parse_quant(data, kw, source)
    layer_types = data.pop("layer_types", None)
    compress_rates = data.pop("compress_rates", None)
    mlp_layer_types = data.pop("mlp_layer_types", None)
    partial = data.pop("partial_rotary_factor", None)
    for key, value in data.items():
        if key in _SAME_NAMES:
            kw[key] = value
        elif key.startswith("dspark_"):
            kw["extra"][key] = value
        elif key not in _IGNORED:
            log.warning("%s: ignoring unknown key %r", source, key)
    if "qk_rope_head_dim" not in kw and partial is not None and "head_dim" in kw:
        kw["qk_rope_head_dim"] = int(kw["head_dim"] * partial)
    if layer_types is not None and "compress_ratios" not in kw:
        kw["compress_ratios"] = _ratios_from_layer_types(layer_types, compress_rates, source)
    if mlp_layer_types is not None and "num_hash_layers" not in kw:
        kw["num_hash_layers"] = _hash_layers_from_types(mlp_layer_types, source)
    _require(kw, source)
    kw.setdefault("num_nextn_predict_layers", 1)
    kw["compress_ratios"] = _ratios(kw, source)
    return kw


def _parse_rope(data: dict, kw: dict, source: str) -> None:
    scaling = data.pop("rope_scaling", None)
    params = data.pop("rope_parameters", None)
    if params and isinstance(params.get("compress"), dict):  # transformers' nested form
        main, scaling = params.get("main") or {}, params["compress"]
        if "rope_theta" in main:
            kw["rope_theta"] = main["rope_theta"]
        if "rope_theta" in scaling:
            kw["compress_rope_theta"] = scaling["rope_theta"]
    elif params:
        scaling = params
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


def _parse_quant(data: dict, kw: dict, source: str) -> None:
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


def _ratios_from_layer_types(layer_types, compress_rates, source) -> list[int]:
    rates = {"csa": CSA_RATIO, "hca": 128}
    for name, value in (compress_rates or {}).items():
        if name not in _LAYER_TYPE_KIND or name == "sliding_attention":
            raise ConfigError(f"{source}: compress_rates has unknown layer type {name!r}")
        rates[_LAYER_TYPE_KIND[name]] = int(value)
    if rates["csa"] != CSA_RATIO:
        raise ConfigError(f"{source}: compress_rates['compressed_sparse_attention']={rates['csa']}; CSA is ratio 4")
    out = []
    for i, t in enumerate(layer_types):
        if t not in _LAYER_TYPE_KIND:
            raise ConfigError(f"{source}: layer_types[{i}]={t!r}; expected one of {sorted(_LAYER_TYPE_KIND)}")
        kind = _LAYER_TYPE_KIND[t]
        out.append(0 if kind == "window" else rates[kind])
    return out


def _hash_layers_from_types(mlp_layer_types, source) -> int:
    n = 0
    while n < len(mlp_layer_types) and mlp_layer_types[n] == "hash_moe":
        n += 1
    if any(t != "moe" for t in mlp_layer_types[n:]):
        raise ConfigError(f"{source}: mlp_layer_types must be 'hash_moe' x n followed by 'moe'; got {mlp_layer_types}")
    return n


def _require(kw: dict, source: str) -> None:
    missing = [k for k in _REQUIRED if k not in kw]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing}")


def _ratios(kw: dict, source: str) -> tuple[int, ...]:
    """Main-layer ratios followed by one entry per extra layer; MTP layers are window-only."""
    ratios = [int(r) for r in kw["compress_ratios"]]
    n_layers, n_mtp = int(kw["num_hidden_layers"]), int(kw["num_nextn_predict_layers"])
    if len(ratios) < n_layers:
        raise ConfigError(f"{source}: compress_ratios has {len(ratios)} entries but num_hidden_layers={n_layers}")
    if len(ratios) < n_layers + n_mtp:  # transformers' layer_types cover the main layers only
        ratios += [0] * (n_layers + n_mtp - len(ratios))
    return tuple(ratios)


def _validate(c: DSV4Config) -> None:
    def bad(key, value, why):
        raise ConfigError(f"{key}={value!r}: {why}")

    for key in _REQUIRED + ("num_nextn_predict_layers", "hc_mult", "hc_sinkhorn_iters"):
        value = getattr(c, key)
        if key != "compress_ratios" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            bad(key, value, "expected a non-negative integer")
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "sliding_window", "n_routed_experts", "num_experts_per_tok",
                "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters"):
        if getattr(c, key) == 0:
            bad(key, 0, "must be positive")
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.head_dim:
        bad("qk_rope_head_dim", c.qk_rope_head_dim, f"must be even and in (0, head_dim={c.head_dim}]")
    if c.qk_rope_head_dim > c.index_head_dim:
        bad("index_head_dim", c.index_head_dim, f"must be >= qk_rope_head_dim={c.qk_rope_head_dim}")
    if (c.num_attention_heads * c.head_dim) % c.o_groups or c.num_attention_heads % c.o_groups:
        bad("o_groups", c.o_groups, f"must divide num_attention_heads={c.num_attention_heads}")
    if c.num_experts_per_tok > c.n_routed_experts:
        bad("num_experts_per_tok", c.num_experts_per_tok, f"exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_shared_experts != 1:
        bad("n_shared_experts", c.n_shared_experts, "DeepSeek-V4 has exactly one shared expert")
    if c.num_hash_layers > c.num_hidden_layers:
        bad("num_hash_layers", c.num_hash_layers, f"exceeds num_hidden_layers={c.num_hidden_layers}")
    if c.scoring_func not in SCORING_FUNCS:
        bad("scoring_func", c.scoring_func, f"expected one of {SCORING_FUNCS}")
    if c.expert_dtype not in EXPERT_DTYPES:
        bad("expert_dtype", c.expert_dtype, f"expected one of {EXPERT_DTYPES}")
    if any(r < 0 for r in c.compress_ratios):
        bad("compress_ratios", list(c.compress_ratios), "ratios must be >= 0")
    extra = c.compress_ratios[c.num_hidden_layers:]
    if any(extra):
        bad("compress_ratios", list(c.compress_ratios),
            f"entries after the {c.num_hidden_layers} main layers (MTP / drafter layers) must be 0")
    if any(r and c.index_topk == 0 for r in c.compress_ratios if r == CSA_RATIO):
        bad("index_topk", c.index_topk, "CSA layers need index_topk > 0")
    for key in ("rope_theta", "compress_rope_theta", "rope_factor", "beta_fast", "beta_slow"):
        value = getattr(c, key)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            bad(key, value, "expected a positive finite number")
    for key in ("hc_eps", "rms_norm_eps", "swiglu_limit", "routed_scaling_factor"):
        value = getattr(c, key)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            bad(key, value, "expected a non-negative finite number")
    if c.qat_sim:
        nope = c.nope_head_dim
        if nope % 64 or c.index_head_dim & (c.index_head_dim - 1) or c.index_head_dim % 32:
            bad("qat_sim", True, "needs (head_dim - qk_rope_head_dim) % 64 == 0 and a power-of-two "
                "index_head_dim (FP8 blocks of 64, Hadamard, FP4 blocks of 32)")


# ---- presets -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """DSpark drafter settings, named as the DeepSeek-V4-Flash-0731 config names them.

    `target_layer_ids` are 0-based main layers whose outputs feed the drafter (reading (A) of spec
    dspark.md §3.9: the output of layer l, averaged over the HC streams).
    """

    block_size: int  # gamma: drafted tokens per block
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_stages: int
    # Sequential temperature scaling of the confidence logits (spec dspark.md §10): c_k =
    # sigmoid(z_k / T_k). Key `dspark_confidence_temperatures`; absent means all 1 (raw head).
    confidence_temperatures: tuple[float, ...] | None = None

    @classmethod
    def from_extra(cls, extra: dict, config: "DSV4Config") -> "DSparkConfig":
        try:
            d = cls(block_size=int(extra["dspark_block_size"]), noise_token_id=int(extra["dspark_noise_token_id"]),
                    target_layer_ids=tuple(int(i) for i in extra["dspark_target_layer_ids"]),
                    markov_rank=int(extra["dspark_markov_rank"]), num_stages=config.num_nextn_predict_layers,
                    confidence_temperatures=_temperatures(extra.get("dspark_confidence_temperatures")))
        except KeyError as e:
            raise ConfigError(f"config has dspark_block_size but lacks {e.args[0]}; a DSpark config needs "
                              "dspark_noise_token_id, dspark_target_layer_ids and dspark_markov_rank") from None
        if d.block_size < 1 or d.markov_rank < 1 or d.num_stages < 1:
            raise ConfigError(f"dspark_block_size={d.block_size}, dspark_markov_rank={d.markov_rank} and "
                              f"num_nextn_predict_layers={d.num_stages} (drafter stages) must all be >= 1")
        if not 0 <= d.noise_token_id < config.vocab_size:
            raise ConfigError(f"dspark_noise_token_id={d.noise_token_id} is outside the vocabulary [0, {config.vocab_size})")
        temps = d.confidence_temperatures
        if temps is not None and (len(temps) != d.block_size or not all(t > 0 for t in temps)):
            raise ConfigError(f"dspark_confidence_temperatures={list(temps)}: need {d.block_size} positive numbers "
                              "(one per draft position)")
        bad = [i for i in d.target_layer_ids if not 0 <= i < config.num_hidden_layers]
        if bad or not d.target_layer_ids:
            raise ConfigError(f"dspark_target_layer_ids={list(d.target_layer_ids)}: need one or more layer ids in "
                              f"[0, {config.num_hidden_layers})")
        return d


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving-time sizes that fix the decode state's static shapes.

    `max_seq_len` bounds prompt + generated tokens per slot; `gamma` is the DSpark block size, so one
    verification writes up to gamma + 1 rows ahead of the committed frontier; `max_batch` is the
    number of sequence slots.
    """

    max_seq_len: int = 4096
    gamma: int = 5
    max_batch: int = 1

    def __post_init__(self):
        for key, low in (("max_seq_len", 1), ("gamma", 0), ("max_batch", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"EngineConfig.{key}={value!r}: must be an integer >= {low}")

    @property
    def rollback_rows(self) -> int:
        """Most rows one call may write and later roll back: a verification of the full block."""
        return self.gamma + 1


def _temperatures(value) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(t) for t in value)


def tiny_config(**overrides) -> DSV4Config:
    """The CPU test config of spec §11.1: every feature at toy size (SWA, SWA, CSA, HCA, CSA, HCA + MTP)."""
    base = dict(
        vocab_size=512, hidden_size=256, num_hidden_layers=6, num_nextn_predict_layers=1,
        num_hash_layers=3, num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128,
        o_groups=2, o_lora_rank=64, sliding_window=8, compress_ratios=(0, 0, 4, 16, 4, 16, 0),
        index_n_heads=16, index_head_dim=128, index_topk=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=128, scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5, swiglu_limit=1.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=32,
        rope_factor=4.0, beta_fast=32.0, beta_slow=1.0, max_position_embeddings=128,
    )
    base.update(overrides)
    return DSV4Config(**base)


def tiny_dspark_config(**overrides) -> DSV4Config:
    """The tiny config with a 2-stage DSpark drafter (gamma 5, Markov rank 32) reading layers 3 and 5."""
    base = dict(num_nextn_predict_layers=2, compress_ratios=(0, 0, 4, 16, 4, 16, 0, 0),
                extra=dict(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[3, 5],
                           dspark_markov_rank=32))
    base.update(overrides)
    return tiny_config(**base)


def flash_config(**overrides) -> DSV4Config:
    """DeepSeek-V4-Flash (spec §2.1)."""
    base = dict(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_nextn_predict_layers=1,
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
        o_lora_rank=1024, sliding_window=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=2048, num_hash_layers=3,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
        compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
        expert_dtype="fp4", quantization=QuantConfig(),
    )
    base.update(overrides)
    return DSV4Config(**base)


def pro_config(**overrides) -> DSV4Config:
    """DeepSeek-V4-Pro (spec §2.1)."""
    base = dict(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_nextn_predict_layers=1,
        num_attention_heads=128, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1536, o_groups=16,
        o_lora_rank=1024, sliding_window=128, compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
        index_n_heads=64, index_head_dim=128, index_topk=1024, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=6, moe_intermediate_size=3072, num_hash_layers=3,
        scoring_func="sqrtsoftplus", routed_scaling_factor=2.5, swiglu_limit=10.0,
        compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
        expert_dtype="fp4", quantization=QuantConfig(),
    )
    base.update(overrides)
    return DSV4Config(**base)


def tiny_code_config(**overrides) -> DSV4Config:
    """The embedded model (`jdspark/assets/tiny-code`): every DSV4 feature on (mHC, SWA, CSA with
    the indexer, HCA, hash layers, MoE with a shared expert) at a size trained on one GPU in
    minutes, with a 2-stage DSpark drafter (gamma 5) reading layers 1, 3 and 5. The shipped drafter's
    Markov head was later widened from rank 32 to 256 (`train_drafter.py --markov-rank 256`)."""
    base = dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_nextn_predict_layers=2,
        num_hash_layers=3, num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, sliding_window=64, compress_ratios=(0, 0, 4, 16, 4, 16, 0, 0),
        index_n_heads=8, index_head_dim=64, index_topk=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=256, scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
        extra=dict(dspark_block_size=5, dspark_noise_token_id=2, dspark_target_layer_ids=[1, 3, 5],
                   dspark_markov_rank=32),
    )
    base.update(overrides)
    return DSV4Config(**base)
