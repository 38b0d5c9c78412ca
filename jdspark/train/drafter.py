"""Training the DSpark drafter on the frozen target (spec dspark.md §12), through the inference code.

A training block is exactly what the engine drafts, computed by the engine's functions
(`jdspark.drafter.dspark`): for an anchor at position a, the context is the drafter's rows of
positions a-W..a-1 (`context_rows` of the target features, gathered as `cache_after`) and the
block is [x_a, noise x (gamma-1)] run by `draft_hidden`. Only the Markov head is teacher-forced
(`teacher_forced_logits`, prev = the corpus tokens x_a..x_{a+gamma-1}). Losses per position k, weighted by
exp(-(k-1)/decay): 0.1 CE(x_{a+k}) + 0.9 L1(p_draft, p_target) + 1.0 BCE(z_k, 1 - L1/2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.drafter import dspark
from jdspark.model.dsv4 import DSV4
from jdspark.model.model import Model
from jdspark.train import adamw

DRAFTER = nnx.All(nnx.Param, nnx.PathContains("mtp"))
LOSS_WEIGHTS = {"ce": 0.1, "l1": 0.9, "confidence": 1.0}


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, gamma: int, count: int,
                   low=1) -> np.ndarray:
    """[batch, count] distinct anchors per sequence in [low, seq_len - gamma - 1] (every label in
    range). `low` (scalar or per row) keeps blocks out of a prompt: only sampled text is supervised."""
    low = np.broadcast_to(np.asarray(low), (batch,))
    return np.stack([np.sort(rng.choice(np.arange(lo, seq_len - gamma), count, replace=False))
                     for lo in low]).astype(np.int32)


def widen_markov_head(model: Model, rank: int, seed: int = 0) -> Model:
    """The same model with a rank-`rank` Markov head that computes exactly what the old one did, so
    training continues from where the drafter stands with room for a sharper prev-token bias: the
    new W1 columns are small random (std 0.02, spec §12.5), the new W2 columns and confidence
    weights zero (the bias W2.W1[prev] and the confidence logit are unchanged, the gradients not)."""
    dspark_config = model.config.dspark
    old = dspark_config.markov_rank
    if rank < old:
        raise ValueError(f"markov rank {rank} < the checkpoint's {old}: a head can only be widened")
    config = model.config.replace(extra={**model.config.extra, "dspark_markov_rank": rank})
    wide = Model.random(config, model.dtype, seed=seed)
    pure = nnx.to_pure_dict(model.params)
    heads = pure["mtp"][dspark_config.num_stages - 1]
    w1, w2 = heads["markov_head"]["embed"]["weight"], heads["markov_head"]["head"]["weight"]
    conf = heads["confidence_head"]["proj"]["weight"]
    noise = 0.02 * jax.random.normal(jax.random.key(seed), (w1.shape[0], rank - old), w1.dtype)
    heads["markov_head"]["embed"]["weight"] = jnp.concatenate([w1, noise], axis=1)
    heads["markov_head"]["head"]["weight"] = jnp.pad(w2, ((0, 0), (0, rank - old)))
    heads["confidence_head"]["proj"]["weight"] = jnp.pad(conf, ((0, 0), (0, rank - old)))
    nnx.replace_by_pure_dict(wide.params, pure)
    return Model(wide.graphdef, wide.params)


IDENTITY_COMB_LOGIT = 30.0  # comb logits 30 * I: Sinkhorn gives the identity to its eps (1e-6)


def add_stages(model: Model, count: int, seed: int = 0) -> Model:
    """The same model with `count` more drafter stages that compute the identity, so a trained
    drafter grows deeper and training continues from where it stands. The new stages go before the
    last one (which keeps its heads); their attention output (`wo_b`) and expert down projections
    (`w2`) are zero, so the branches add nothing, and their comb matrices are the identity (comb rows
    of `fn` zero, bias 30 * I), so the streams pass through unmixed. The other weights are the
    random initialisation: the zero projections get gradients from the first step."""
    config = model.config
    stages = config.num_nextn_predict_layers
    if count < 1 or stages < 2:
        raise ValueError(f"add {count} stages to a {stages}-stage drafter: need count >= 1 and 2 stages or more "
                         "(the first stage owns the context projection, the last the heads)")
    main = config.compress_ratios[:config.num_hidden_layers]
    ratios = main + (0,) * (stages + count)  # drafter stages are window-only
    grown = Model.random(config.replace(num_nextn_predict_layers=stages + count, compress_ratios=ratios),
                         model.dtype, seed=seed)
    old, new = nnx.to_pure_dict(model.params), nnx.to_pure_dict(grown.params)
    c = config.hc_mult
    for i in range(stages - 1, stages - 1 + count):  # the inserted ones
        stage = new["mtp"][i]
        stage["attn"]["wo_b"]["weight"] = jnp.zeros_like(stage["attn"]["wo_b"]["weight"])
        for experts in ("experts", "shared_experts"):
            stage["ffn"][experts]["w2"]["weight"] = jnp.zeros_like(stage["ffn"][experts]["w2"]["weight"])
        for site in ("hc_attn", "hc_ffn"):
            stage[site]["fn"] = stage[site]["fn"].at[2 * c:].set(0.0)
            stage[site]["base"] = stage[site]["base"].at[2 * c:].set(IDENTITY_COMB_LOGIT * jnp.eye(c).reshape(-1))
    for i in range(stages - 1):
        new["mtp"][i] = old["mtp"][i]
    new["mtp"][stages - 1 + count] = old["mtp"][stages - 1]
    for key, value in old.items():
        if key != "mtp":
            new[key] = value
    nnx.replace_by_pure_dict(grown.params, new)
    return Model(grown.graphdef, grown.params)


def target_outputs(module: DSV4, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The frozen target on ids [B, S]: (log-probabilities [B, S, V] fp32, drafter features)."""
    logits, _, features = module(ids, module.config.dspark.target_layer_ids)
    return jax.nn.log_softmax(logits, axis=-1), features


def block_outputs(module: DSV4, features: jax.Array, ids: jax.Array, anchors: jax.Array):
    """Draft logits [N, gamma, V] (Markov bias teacher-forced), raw confidence logits [N, gamma]
    and labels [N, gamma] for the N = B * A blocks at anchors [B, A], with (sequence [N], offsets
    [N, gamma]): block n drafts positions offsets[n] + 1 of ids[sequence[n]]."""
    gamma = module.config.dspark.block_size
    b, s = ids.shape
    rows = dspark.context_rows(module, features, jnp.broadcast_to(jnp.arange(s), (b, s)))
    sequence = jnp.repeat(jnp.arange(b), anchors.shape[1])
    length = anchors.reshape(-1)  # the anchor's position = the context rows the engine holds
    cache = dspark.cache_after(module.config, rows, sequence, length)
    h = dspark.draft_hidden(module, cache, ids[sequence, length])
    offsets = length[:, None] + jnp.arange(gamma)
    prev, labels = ids[sequence[:, None], offsets], ids[sequence[:, None], offsets + 1]
    logits, prev_embed = dspark.teacher_forced_logits(module, h, prev)
    return logits, dspark.confidence_logits(module, h, prev_embed), labels, (sequence, offsets)


def l1_to_target(logp_draft: jax.Array, target_logp: jax.Array, sequence: jax.Array, offsets: jax.Array):
    """L1 [N, gamma] between the draft and target distributions of each block position (= 2 TV;
    1 - L1/2 is the acceptance at T = 1): target row a+k-1 predicts position a+k."""
    return jnp.sum(jnp.abs(jnp.exp(logp_draft) - jnp.exp(target_logp[sequence[:, None], offsets])), axis=-1)


def losses(draft_params, frozen, graphdef, target_logp, features, ids, anchors, decay: float):
    module = nnx.merge(graphdef, draft_params, frozen)
    logits, z, labels, (row, offsets) = block_outputs(module, features, ids, anchors)
    logp_draft = jax.nn.log_softmax(logits, axis=-1)
    l1 = l1_to_target(logp_draft, target_logp, row, offsets)
    ce = -jnp.take_along_axis(logp_draft, labels[..., None], axis=-1)[..., 0]
    accept = jax.lax.stop_gradient(jnp.clip(1 - 0.5 * l1, 0.0, 1.0))
    bce = jnp.maximum(z, 0) - z * accept + jnp.log1p(jnp.exp(-jnp.abs(z)))
    weight = jnp.exp(-jnp.arange(z.shape[-1]) / decay)
    terms = {name: jnp.sum(jnp.mean(v, axis=0) * weight) / jnp.sum(weight)
             for name, v in (("ce", ce), ("l1", l1), ("confidence", bce))}
    total = sum(LOSS_WEIGHTS[k] * v for k, v in terms.items())
    per_position = jnp.mean(1 - 0.5 * l1, axis=0)
    return total, {**terms, "accept": per_position, "tau": 1 + jnp.sum(jnp.cumprod(per_position))}


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "decay"), donate_argnames=("draft_params", "opt"))
def train_step(draft_params, frozen, opt: adamw.AdamWState, ids, anchors, *, graphdef, config: adamw.AdamWConfig,
               decay: float = 4.0):
    module = nnx.merge(graphdef, draft_params, frozen)
    target_logp, features = jax.lax.stop_gradient(target_outputs(module, ids))
    (loss, info), grads = jax.value_and_grad(losses, has_aux=True)(draft_params, frozen, graphdef, target_logp,
                                                                   features, ids, anchors, decay)
    draft_params, opt, opt_info = adamw.update(config, draft_params, grads, opt)
    return draft_params, opt, {"loss": loss, **info, **opt_info}


@functools.partial(jax.jit, static_argnames=("graphdef", "decay"))
def evaluate(draft_params, frozen, ids, anchors, *, graphdef, decay: float = 4.0):
    """Held-out losses and the teacher-forced acceptance per position (1 - TV at T = 1)."""
    module = nnx.merge(graphdef, draft_params, frozen)
    target_logp, features = target_outputs(module, ids)
    return losses(draft_params, frozen, graphdef, target_logp, features, ids, anchors, decay)[1]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def calibration_data(draft_params, frozen, ids, anchors, *, graphdef):
    """(raw confidence logits [N, gamma], conditional acceptance probabilities 1 - TV [N, gamma])."""
    module = nnx.merge(graphdef, draft_params, frozen)
    target_logp, features = target_outputs(module, ids)
    logits, z, _, (row, offsets) = block_outputs(module, features, ids, anchors)
    l1 = l1_to_target(jax.nn.log_softmax(logits, axis=-1), target_logp, row, offsets)
    return z, jnp.clip(1 - 0.5 * l1, 0.0, 1.0)
