"""`DSV4Config`: the model's hyper-parameters, read from any checkpoint vocabulary, and their validation.

All three vocabularies (`vocab_hf`, `vocab_official`, `vocab_transformers`) parse into this one
frozen dataclass, which uses the HF names. Invalid or inconsistent values raise `ConfigError` naming
the key and the fix. The DSpark drafter's `dspark_*` keys stay verbatim in `extra` (so a config
writes back what it read) and are parsed once, at construction, into the `dspark` field.
Runtime options (the QAT simulation, the dtype) are not part of the checkpoint config: they are
arguments of `load_model` / `Model.random`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jdspark.config import vocab_hf, vocab_official
from jdspark.config.base import CSA_RATIO, EXPERT_DTYPES, SCORING_FUNCS, ConfigError, QuantConfig
from jdspark.config.dspark import DSparkConfig
from jdspark.config.vocab import REQUIRED


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
    # The checkpoint's `dspark_*` keys, verbatim (written back by `to_dict`); outside hash/eq so the
    # config stays hashable. Change the drafter with `replace(extra=...)`: `dspark` is parsed anew.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    # The DSpark drafter's settings parsed from `extra` at construction, or None for a model without
    # one. Its stages are the extra layers after the main ones (`num_nextn_predict_layers` of them).
    dspark: DSparkConfig | None = dataclasses.field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self):
        _validate(self)
        object.__setattr__(self, "dspark", DSparkConfig.from_keys(self.extra, self))

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

    def replace(self, **changes) -> "DSV4Config":
        return dataclasses.replace(self, **changes)

    # ---- the vocabularies --------------------------------------------------------------------
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
        return cls(**(vocab_official.read(data, source) if official else vocab_hf.read(data, source)))

    def to_dict(self) -> dict[str, Any]:
        """The HF checkpoint vocabulary (`config.json` as shipped with the official weights)."""
        return vocab_hf.write(self)

    def to_official_dict(self) -> dict[str, Any]:
        """The reference code's `inference/config.json` vocabulary."""
        return vocab_official.write(self)


# ---- validation --------------------------------------------------------------------------------

_POSITIVE = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
             "o_lora_rank", "sliding_window", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters")


def _bad(key, value, why):
    raise ConfigError(f"{key}={value!r}: {why}")


def _validate(c: DSV4Config) -> None:
    _validate_counts(c)
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.head_dim:
        _bad("qk_rope_head_dim", c.qk_rope_head_dim, f"must be even and in (0, head_dim={c.head_dim}]")
    if c.qk_rope_head_dim > c.index_head_dim:
        _bad("index_head_dim", c.index_head_dim, f"must be >= qk_rope_head_dim={c.qk_rope_head_dim}")
    if (c.num_attention_heads * c.head_dim) % c.o_groups or c.num_attention_heads % c.o_groups:
        _bad("o_groups", c.o_groups, f"must divide num_attention_heads={c.num_attention_heads}")
    if c.num_experts_per_tok > c.n_routed_experts:
        _bad("num_experts_per_tok", c.num_experts_per_tok, f"exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_shared_experts != 1:
        _bad("n_shared_experts", c.n_shared_experts, "DeepSeek-V4 has exactly one shared expert")
    if c.num_hash_layers > c.num_hidden_layers:
        _bad("num_hash_layers", c.num_hash_layers, f"exceeds num_hidden_layers={c.num_hidden_layers}")
    if c.scoring_func not in SCORING_FUNCS:
        _bad("scoring_func", c.scoring_func, f"expected one of {SCORING_FUNCS}")
    if c.expert_dtype not in EXPERT_DTYPES:
        _bad("expert_dtype", c.expert_dtype, f"expected one of {EXPERT_DTYPES}")
    if any(r < 0 for r in c.compress_ratios):
        _bad("compress_ratios", list(c.compress_ratios), "ratios must be >= 0")
    if any(c.compress_ratios[c.num_hidden_layers:]):
        _bad("compress_ratios", list(c.compress_ratios),
             f"entries after the {c.num_hidden_layers} main layers (MTP / drafter layers) must be 0")
    if any(r and c.index_topk == 0 for r in c.compress_ratios if r == CSA_RATIO):
        _bad("index_topk", c.index_topk, "CSA layers need index_topk > 0")
    _validate_rates(c)


def _validate_counts(c: DSV4Config) -> None:
    """Counts are non-negative integers, sizes positive."""
    for key in REQUIRED + ("num_nextn_predict_layers", "hc_mult", "hc_sinkhorn_iters"):
        value = getattr(c, key)
        if key != "compress_ratios" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            _bad(key, value, "expected a non-negative integer")
    for key in _POSITIVE:
        if getattr(c, key) == 0:
            _bad(key, 0, "must be positive")


def _validate_rates(c: DSV4Config) -> None:
    """RoPE bases and YaRN settings are positive finite numbers; epsilons and scales non-negative."""
    for key in ("rope_theta", "compress_rope_theta", "rope_factor", "beta_fast", "beta_slow"):
        value = getattr(c, key)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            _bad(key, value, "expected a positive finite number")
    for key in ("hc_eps", "rms_norm_eps", "swiglu_limit", "routed_scaling_factor"):
        value = getattr(c, key)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            _bad(key, value, "expected a non-negative finite number")
