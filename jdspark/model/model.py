"""`Model`: a DSV4 network split into (graph, parameters) with jitted full-sequence entry points."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model.dsv4 import DSV4
from jdspark.model.layers import Keys


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, ids):
    return nnx.merge(graphdef, params)(ids)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _mtp_forward(graphdef, params, streams, next_ids, depth):
    return nnx.merge(graphdef, params).mtp_logits(streams, next_ids, depth)


class Model:
    """A loaded DeepSeek-V4 model. Parameters stay on the device; calls are jitted per shape."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State):
        self.graphdef, self.params = graphdef, params
        module = nnx.merge(graphdef, params)
        self.config: DSV4Config = module.config
        self.dtype = module.dtype

    @classmethod
    def random(cls, config: DSV4Config, dtype="bfloat16", seed: int = 0) -> "Model":
        """A randomly initialised model (tests, benchmarks), drawn on the host."""
        return cls(*nnx.split(DSV4(config, dtype=jnp.dtype(dtype), rngs=Keys(seed, concrete=True))))

    def module(self) -> DSV4:
        return nnx.merge(self.graphdef, self.params)

    def forward(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """ids [B, S] from position 0 -> (logits [B, S, V] fp32, final streams [B, S, C, D])."""
        return _forward(self.graphdef, self.params, jnp.asarray(ids, jnp.int32))

    def logits(self, token_ids) -> np.ndarray:
        """Full-sequence logits [S, vocab] (float32) for one sequence of token ids from position 0."""
        ids = _check_ids(token_ids, self.config.vocab_size)
        logits, _ = self.forward(ids[None])
        return np.asarray(logits[0])

    def mtp_logits(self, token_ids, depth: int = 0) -> np.ndarray:
        """MTP block `depth` over one sequence: row t predicts token t+2 from (streams at t, token t+1).
        Returns [S-1, vocab] float32."""
        if not 0 <= depth < self.config.num_nextn_predict_layers:
            raise ValueError(f"depth={depth}: the model has {self.config.num_nextn_predict_layers} MTP block(s)")
        ids = _check_ids(token_ids, self.config.vocab_size)
        if len(ids) < 2:
            raise ValueError("mtp_logits needs at least 2 tokens (row t reads token t+1)")
        _, streams = self.forward(ids[None])
        out = _mtp_forward(self.graphdef, self.params, streams[:, :-1], jnp.asarray(ids[None, 1:]), depth)
        return np.asarray(out[0])


def _check_ids(token_ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)
