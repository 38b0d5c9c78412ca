"""Ready-made `DSV4Config`s: the CPU test configs, the embedded model and the released models.
Each takes keyword overrides (any `DSV4Config` field)."""

from __future__ import annotations

from jdspark.config.base import QuantConfig
from jdspark.config.model_config import DSV4Config


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


# What DeepSeek-V4-Flash and -Pro share (spec §2.1): the vocabulary, head shapes, window, indexer
# width, routing, RoPE / YaRN, one MTP block and the storage (FP8 linears, ds_fp4 experts).
_RELEASED = dict(
    vocab_size=129280, num_nextn_predict_layers=1, head_dim=512, qk_rope_head_dim=64, o_lora_rank=1024,
    sliding_window=128, index_n_heads=64, index_head_dim=128, n_shared_experts=1, num_experts_per_tok=6,
    num_hash_layers=3, scoring_func="sqrtsoftplus", swiglu_limit=10.0, compress_rope_theta=160000.0,
    rope_factor=16.0, original_seq_len=65536, expert_dtype="fp4", quantization=QuantConfig(),
)


def flash_config(**overrides) -> DSV4Config:
    """DeepSeek-V4-Flash (spec §2.1)."""
    return _released(overrides, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
                     o_groups=8, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), index_topk=512,
                     n_routed_experts=256, moe_intermediate_size=2048, routed_scaling_factor=1.5)


def pro_config(**overrides) -> DSV4Config:
    """DeepSeek-V4-Pro (spec §2.1)."""
    return _released(overrides, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                     o_groups=16, compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0), index_topk=1024,
                     n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5)


def _released(overrides: dict, **sizes) -> DSV4Config:
    """A released model: what Flash and Pro share, its own sizes, then the caller's overrides."""
    return DSV4Config(**{**_RELEASED, **sizes, **overrides})


def tiny_code_config(**overrides) -> DSV4Config:
    """The embedded model as shipped (`jdspark/assets/tiny-code/config.json`; a test keeps the two
    equal): every DSV4 feature on (mHC, SWA, CSA with the indexer, HCA, hash layers, MoE with a
    shared expert) at a size trained on one GPU in minutes, stored as FP8 linears with ds_fp4
    experts, with a 2-stage DSpark drafter (gamma 5, Markov rank 256, fitted confidence
    temperatures) reading layers 1, 3 and 5."""
    base = dict(
        vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_nextn_predict_layers=2,
        num_hash_layers=3, num_attention_heads=4, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, sliding_window=64, compress_ratios=(0, 0, 4, 16, 4, 16, 0, 0),
        index_n_heads=8, index_head_dim=64, index_topk=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=256, scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
        expert_dtype="fp4", quantization=QuantConfig(),
        extra=dict(dspark_block_size=5, dspark_noise_token_id=2, dspark_target_layer_ids=[1, 3, 5],
                   dspark_markov_rank=256,
                   dspark_confidence_temperatures=[1.189207115002721, 1.090507732665258, 1.0,
                                                   0.8408964152537147, 0.8408964152537147]),
    )
    base.update(overrides)
    return DSV4Config(**base)
