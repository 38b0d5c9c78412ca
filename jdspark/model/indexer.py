"""Lightning indexer (spec §5.3.4): picks the top-k CSA entries each query attends to.

score(p, s) = sum_h w_h(x) * ReLU(q_h(qr) . K_s) over the indexer's own compressed keys, for entries
visible to p (s < (p+1) // 4); only the selected indices are used, never the scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import CSA_RATIO, DSV4Config
from jdspark.model import quant_sim
from jdspark.model.compressor import Compressor
from jdspark.model.layers import Keys, Linear
from jdspark.model.rope import apply_rope, layer_rope


class Indexer(nnx.Module):
    def __init__(self, config: DSV4Config, *, dtype, rngs: Keys, qat_sim: bool = False):
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, rngs=rngs,
                           fp8_input=qat_sim)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, dtype=dtype, rngs=rngs)
        self.compressor = Compressor(config, CSA_RATIO, self.head_dim, indexer=True, dtype=dtype, rngs=rngs,
                                     qat_sim=qat_sim)
        self.rope = layer_rope(config, compressed=True)
        self.qat_sim = qat_sim

    def scores(self, x: jax.Array, qr: jax.Array, positions: jax.Array, keys: jax.Array) -> jax.Array:
        """Index scores [B, S, T] (fp32) of queries at `positions` against indexer keys [B, T, c]."""
        b, s, _ = x.shape
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim)
        q = apply_rope(q, positions, self.rope)
        if self.qat_sim:
            q = quant_sim.fp4_sim(quant_sim.hadamard(q), 32)
        w = self.weights_proj(x).astype(jnp.float32) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        dots = jnp.einsum("bshc,btc->bsht", q.astype(jnp.float32), keys.astype(jnp.float32))
        return jnp.einsum("bsht,bsh->bst", jax.nn.relu(dots), w)

    def select(self, scores: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The top-k visible entries per query: indices [B, S, K] int32 and their validity [B, S, K],
        K = min(topk, T); with fewer than K visible, the masked entries top_k fills in are invalid."""
        k = min(self.topk, scores.shape[-1])
        _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
        return idx, jnp.take_along_axis(visible, idx, axis=-1, mode="promise_in_bounds")
