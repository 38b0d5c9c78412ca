"""The configs of the sharded tests, sized so that every rule really splits at TP 8 and EP 8: 8
query heads in 8 output groups, 8 routed experts, and quantized dimensions in whole blocks per
device (wq_b 1024 rows = 8 FP8 blocks, wo_b input 8 x 128 = 8 blocks, shared expert width 1024 = 8
blocks, routed expert width 1024 = 32 ds_fp4 blocks)."""

from jdspark.config import tiny_dspark_config
from jdspark.config.base import QuantConfig

PARALLEL_CONFIG = tiny_dspark_config(
    vocab_size=512, hidden_size=128, num_hidden_layers=2, compress_ratios=(4, 16, 0, 0), num_hash_layers=1,
    num_attention_heads=8, o_groups=8, o_lora_rank=128, moe_intermediate_size=1024,
    extra=dict(dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=[0, 1], dspark_markov_rank=16))
QUANTIZED_CONFIG = PARALLEL_CONFIG.replace(expert_dtype="fp4", quantization=QuantConfig())
