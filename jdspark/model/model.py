"""`Model`: a DSV4 network split into (graph, parameters) with jitted full-sequence entry points."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jdspark.config import DSV4Config, EngineConfig
from jdspark.model import state
from jdspark.model.dsv4 import DSV4
from jdspark.model.layers import Keys
from jdspark.model.state import DecodeState
from jdspark.parallel import mesh as mesh_lib


@functools.partial(jax.jit, static_argnums=(0, 3))
def _forward(graphdef, params, ids, feature_layers):
    return nnx.merge(graphdef, params)(ids, feature_layers)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _mtp_forward(graphdef, params, streams, next_ids, depth):
    return nnx.merge(graphdef, params).mtp_logits(streams, next_ids, depth)


@functools.partial(jax.jit, static_argnames=("graphdef", "feature_layers"), donate_argnames="decode")
def _extend(graphdef, params, decode, ids, n_valid, feature_layers):
    return nnx.merge(graphdef, params).extend(ids, decode, n_valid, feature_layers)


@functools.partial(jax.jit, donate_argnums=0)
def _commit(decode, n_keep):
    return state.commit(decode, n_keep)


class ForwardResult(NamedTuple):
    logits: jax.Array  # [B, S, V] fp32
    streams: jax.Array  # [B, S, C, D] final residual streams (before the HC head)
    features: jax.Array | None  # [B, S, n_feature_layers * D], drafter context features


class ExtendResult(NamedTuple):
    logits: jax.Array  # [B, S, V] fp32
    features: jax.Array | None  # [B, S, n_feature_layers * D], drafter context features
    state: DecodeState


class Model:
    """A loaded DeepSeek-V4 model. Parameters stay on the device; calls are jitted per shape."""

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh | None = None):
        """`mesh`: the devices the parameters are sharded over (`jdspark.parallel.shard`), or None."""
        self.graphdef, self.params, self.mesh = graphdef, params, mesh
        module = nnx.merge(graphdef, params)
        self.config: DSV4Config = module.config
        self.dtype = module.dtype
        self.qat_sim: bool = module.qat_sim  # a build option (see `DSV4`), not part of the config

    @classmethod
    def random(cls, config: DSV4Config, dtype="bfloat16", seed: int = 0, qat_sim: bool = False) -> "Model":
        """A randomly initialised model (tests, benchmarks), drawn on the host."""
        return cls(*nnx.split(DSV4(config, dtype=jnp.dtype(dtype), rngs=Keys(seed, concrete=True), qat_sim=qat_sim)))

    def module(self) -> DSV4:
        return nnx.merge(self.graphdef, self.params)

    def forward(self, ids, feature_layers: tuple[int, ...] = ()) -> ForwardResult:
        """Full sequences ids [B, S] from position 0 (the reference path; no state)."""
        return ForwardResult(*_forward(self.graphdef, self.params, jnp.asarray(ids, jnp.int32), tuple(feature_layers)))

    def init_state(self, engine: EngineConfig) -> DecodeState:
        """An empty decode state with `engine.max_batch` slots (see `jdspark.model.state`), on the
        model's mesh: replicated, since every query head reads the one shared K=V head."""
        return self.on_devices(state.init_state(self.config, engine, self.dtype))

    def on_devices(self, tree):
        """A state-like pytree (decode state, draft cache) placed replicated on the model's mesh."""
        return mesh_lib.place_tree(tree, self.mesh)

    def extend(self, decode: DecodeState, ids, n_valid=None, feature_layers: tuple[int, ...] = ()) -> ExtendResult:
        """Run ids [B, S] after the tokens each slot holds (prefill, chunked prefill, decode or a
        verification block); only the first n_valid[b] tokens of slot b are written (default all).
        `decode` is donated: use the returned state. Compiled once per (B, S, feature_layers)."""
        ids = jnp.asarray(ids, jnp.int32)
        if ids.ndim != 2 or ids.shape[0] != decode.batch:
            raise ValueError(f"ids must be [batch={decode.batch}, S], got shape {ids.shape}")
        if n_valid is None:
            n_valid = np.full(decode.batch, ids.shape[1], np.int32)
        elif not isinstance(n_valid, jax.Array):  # host values: check them (device values are the engine's)
            n_valid = np.asarray(n_valid, np.int32)
            if n_valid.shape != (decode.batch,) or n_valid.min() < 0 or n_valid.max() > ids.shape[1]:
                raise ValueError(f"n_valid={n_valid.tolist()} must be {decode.batch} counts in 0..{ids.shape[1]}")
        return ExtendResult(*_extend(self.graphdef, self.params, decode, ids, n_valid, tuple(feature_layers)))

    def commit(self, decode: DecodeState, n_keep) -> DecodeState:
        """Keep the first n_keep[b] tokens the last extend wrote to slot b (0..written); the rest are
        rolled back. `decode` is donated."""
        return _commit(decode, jnp.asarray(n_keep, jnp.int32))

    def prefill(self, token_ids, engine: EngineConfig, chunk: int | None = None) -> tuple[np.ndarray, DecodeState]:
        """One sequence into slot 0 of a fresh state, in chunks of `chunk` tokens (default: one
        call). Returns (logits [S, V] float32, state)."""
        ids = _check_ids(token_ids, self.config.vocab_size)
        if len(ids) > engine.max_seq_len:
            raise ValueError(f"{len(ids)} tokens exceed max_seq_len={engine.max_seq_len}; raise it in EngineConfig")
        decode = self.init_state(engine)
        step = chunk or len(ids)
        out = []
        for start in range(0, len(ids), step):
            piece = np.zeros((decode.batch, step), np.int32)
            n = min(step, len(ids) - start)
            piece[0, :n] = ids[start:start + n]
            n_valid = np.zeros(decode.batch, np.int32)
            n_valid[0] = n
            logits, _, decode = self.extend(decode, piece, n_valid)
            out.append(np.asarray(logits[0, :n]))
        return np.concatenate(out), decode

    def logits(self, token_ids) -> np.ndarray:
        """Full-sequence logits [S, vocab] (float32) for one sequence of token ids from position 0."""
        ids = _check_ids(token_ids, self.config.vocab_size)
        return np.asarray(self.forward(ids[None]).logits[0])

    def mtp_logits(self, token_ids, depth: int = 0) -> np.ndarray:
        """MTP block `depth` over one sequence: row t predicts token t+2 from (streams at t, token t+1).
        Returns [S-1, vocab] float32."""
        if self.config.dspark is not None:
            raise ValueError("this checkpoint's mtp.* layers are DSpark drafter stages, not MTP blocks; "
                             "use jdspark.drafter.dspark.propose")
        if not 0 <= depth < self.config.num_nextn_predict_layers:
            raise ValueError(f"depth={depth}: the model has {self.config.num_nextn_predict_layers} MTP block(s)")
        ids = _check_ids(token_ids, self.config.vocab_size)
        if len(ids) < 2:
            raise ValueError("mtp_logits needs at least 2 tokens (row t reads token t+1)")
        streams = self.forward(ids[None]).streams
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
