"""Parameters of the DSpark drafter's stages (`mtp.{i}.*`, spec dspark.md §3.9).

Each stage is a window-only DeepSeek-V4 block (layer id L + i: no compressor, no hash routing).
Stage 0 also owns the context combiner (`main_proj`, `main_norm`); the last stage owns the heads:
`norm` and `hc_head` (for the base logits through the target's head), the rank-r Markov head
(`markov_head.embed` = W1 [V, r], `markov_head.head` = W2 [V, r]) and the bias-free fp32
confidence head (`confidence_head.proj` [1, D + r]). Tensor names follow the public DSV4 DSpark
loaders; the algorithm that uses them is `jdspark.drafter.dspark`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model.block import Block, HyperHead
from jdspark.model.layers import Embedding, Keys, Linear, RMSNorm


class MarkovHead(nnx.Module):
    """bias(prev, .) = W2 . W1[prev]: W1 = `embed` [V, r], W2 = `head` [V, r]."""

    def __init__(self, vocab: int, rank: int, *, dtype, rngs: Keys):
        self.embed = Embedding(vocab, rank, dtype=jnp.float32, rngs=rngs)
        self.head = Linear(rank, vocab, dtype=dtype, rngs=rngs, compute_dtype=jnp.float32)


class ConfidenceHead(nnx.Module):
    """c = sigmoid(proj . [h; W1[prev]]) in fp32, no bias."""

    def __init__(self, width: int, *, rngs: Keys):
        self.proj = Linear(width, 1, dtype=jnp.float32, rngs=rngs, compute_dtype=jnp.float32)


class DraftStage(Block):
    def __init__(self, config: DSV4Config, index: int, *, dtype, rngs: Keys, qat_sim: bool = False):
        super().__init__(config, config.num_hidden_layers + index, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
        dspark, d = config.dspark, config.hidden_size
        if index == 0:
            self.main_proj = Linear(len(dspark.target_layer_ids) * d, d, dtype=dtype, rngs=rngs,
                                    fp8_input=qat_sim)
            self.main_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        if index == dspark.num_stages - 1:
            self.norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
            self.hc_head = HyperHead(config, rngs=rngs)
            self.markov_head = MarkovHead(config.vocab_size, dspark.markov_rank, dtype=dtype, rngs=rngs)
            self.confidence_head = ConfidenceHead(d + dspark.markov_rank, rngs=rngs)
