"""The compiled step functions of the engine, built ahead of time (JAX's counterpart of CUDA graphs).

- prefill: a prompt chunk into some slots (others pass n_valid = 0), drafter context pushed,
  the first token sampled from each slot's last real row;
- draft: one DSpark proposal (gamma tokens, their distributions q, confidences) per slot;
- verify[k] for k = 0..gamma: target extend over [anchor, k drafts], exact rejection sampling,
  commit of the accepted prefix + 1 in the target state, and the committed rows' features pushed
  into the drafter's context. Width 0 is plain target decoding: it still emits one token.

Every function takes the parameters as an argument (never baked in as constants; on the GPU packed
into a few buffers, `jdspark.engine.packed`, since each argument buffer costs host time per call), donates the
decode state and the draft cache, and draws its randomness on the device from per-slot (seed,
counter) keys, so a request's samples depend only on its own seed and step.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import packed
from jdspark.model import state
from jdspark.model.model import Model
from jdspark.spec.sampling import sample, warp_probs
from jdspark.spec.verify import rejection_sample

_PREFILL, _DRAFT, _VERIFY = 1, 2, 3  # key purposes: independent streams per kind of draw


@struct.dataclass
class SlotSampling:
    """Per-slot sampling parameters and randomness source, as device arrays [B]."""

    temperature: jax.Array  # f32, 0 = greedy
    top_k: jax.Array  # i32, 0 = off
    top_p: jax.Array  # f32, 1 = off
    seed: jax.Array  # u32
    counter: jax.Array  # i32: the slot's step number, so every call draws fresh noise


def enable_compile_cache(path: str | None = None) -> None:
    """Keep compiled executables on disk (default $JDSPARK_CACHE/xla, ~/.cache/jdspark/xla), so a
    restart with the same model and engine config skips compilation. Leaves a cache the caller
    already configured alone."""
    if jax.config.jax_compilation_cache_dir:
        return
    root = os.environ.get("JDSPARK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jdspark"))
    jax.config.update("jax_compilation_cache_dir", path or os.path.join(root, "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _keys(sampling: SlotSampling, purpose: int) -> jax.Array:
    base = jax.random.key(purpose)
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(base, s), c))(sampling.seed,
                                                                                     sampling.counter)


def _exponentials(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda k: jax.random.exponential(k, shape, jnp.float32))(keys)


class Executables:
    """AOT-compiled prefill, draft and verify[k] for one model, engine config and prefill chunk."""

    def __init__(self, model: Model, engine: EngineConfig, prefill_chunk: int, use_kernel: bool,
                 widths: tuple[int, ...], pack_params: bool):
        self.graphdef, self.config = model.graphdef, model.config
        # Pass `params.arrays` as every call's first argument.
        self.params = packed.PackedParams(model.params, packed.SMALL_BYTES if pack_params else None)
        self.dspark = model.config.dspark
        self.gamma = engine.gamma
        self.use_kernel = use_kernel
        self.feature_layers = self.dspark.target_layer_ids if self.dspark else ()
        self.prefill_chunk = prefill_chunk
        self.widths = widths
        self.prefill = None
        self.draft = None
        self.verify: dict[int, jax.stages.Compiled] = {}

    def compile(self, decode, draft_cache, sampling: SlotSampling) -> None:
        """Lower and compile every executable for these (example) arguments' shapes."""
        params = self.params.arrays
        b = decode.batch
        ids = jnp.zeros((b, self.prefill_chunk), jnp.int32)
        counts, flags = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)
        self.prefill = jax.jit(self._prefill, donate_argnums=(1, 2)).lower(
            params, decode, draft_cache, ids, counts, flags, sampling).compile()
        anchor = jnp.zeros((b,), jnp.int32)
        tokens = jnp.zeros((b, self.gamma), jnp.int32)
        q = jnp.zeros((b, self.gamma, self.config.vocab_size), jnp.float32)
        if draft_cache is not None and any(self.widths):
            self.draft = jax.jit(self._draft).lower(params, draft_cache, anchor, sampling).compile()
        for k in self.widths:
            self.verify[k] = jax.jit(self._verify_fn(k), donate_argnums=(1, 2)).lower(
                params, decode, draft_cache, anchor, tokens, q, flags, sampling).compile()

    def _model(self, arrays):
        return nnx.merge(self.graphdef, self.params.unpack(arrays))

    def _prefill(self, params, decode, draft_cache, ids, n_valid, reset, sampling):
        model = self._model(params)
        decode = state.reset_slots(decode, reset)
        logits, features, decode = model.extend(ids, decode, n_valid, self.feature_layers)
        if draft_cache is not None:
            draft_cache = dspark.push_context(model, dspark.reset_draft_slots(draft_cache, reset), features, n_valid)
        last = jnp.take_along_axis(logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
        p = warp_probs(last, sampling.temperature, sampling.top_k, sampling.top_p)
        token = sample(p, _exponentials(_keys(sampling, _PREFILL), (self.config.vocab_size,)))
        return token, decode, draft_cache

    def _draft(self, params, draft_cache, anchor, sampling):
        shape = (self.gamma, self.config.vocab_size)
        return dspark.propose(self._model(params), draft_cache, anchor, sampling.temperature, sampling.top_k,
                              sampling.top_p, _exponentials(_keys(sampling, _DRAFT), shape))

    def _verify_fn(self, k: int):
        def verify(params, decode, draft_cache, anchor, tokens, q, active, sampling):
            model = self._model(params)
            drafts = tokens[:, :k]
            ids = jnp.concatenate([anchor[:, None], drafts], axis=1)
            logits, features, decode = model.extend(ids, decode, jnp.where(active, k + 1, 0), self.feature_layers)
            keys = _keys(sampling, _VERIFY)
            uniforms = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0), (k,)))(keys)
            exps = jax.vmap(lambda key: jax.random.exponential(jax.random.fold_in(key, 1),
                                                               (self.config.vocab_size,)))(keys)
            n_acc, token = rejection_sample(logits, q[:, :k], drafts, uniforms, exps, sampling.temperature,
                                            sampling.top_k, sampling.top_p, use_kernel=self.use_kernel)
            n_keep = jnp.where(active, n_acc + 1, 0)
            decode = state.commit(decode, n_keep)
            if draft_cache is not None:
                draft_cache = dspark.push_context(model, draft_cache, features, n_keep)
            return n_acc, token, decode, draft_cache
        return verify
