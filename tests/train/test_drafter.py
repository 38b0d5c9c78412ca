"""Drafter training runs the inference draft path: a training block's draft logits and confidences
equal what the engine's draft cache + `propose` machinery computes for the same anchor."""

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.drafter import dspark
from jdspark.model.model import Model
from jdspark.train import adamw, drafter
from tests.conftest import SPEC_CONFIG

CONFIG = SPEC_CONFIG  # window 8, 3 layers + 2 drafter stages, vocabulary 16
GAMMA = CONFIG.dspark.block_size


def inference_block(graphdef, state, ids, features, anchor):
    """Draft logits and confidence logits the engine's path gives for one anchor: a draft cache
    pushed with the first `anchor` positions' features, `draft_hidden`, teacher-forced Markov bias."""
    module = nnx.merge(graphdef, state)
    cache = dspark.init_draft_cache(CONFIG, 1, jnp.float32)
    cache = dspark.push_context(module, cache, features[None], anchor[None])  # writes rows < anchor
    h = dspark.draft_hidden(module, cache, ids[anchor][None])
    last = module.mtp[-1]
    e = last.markov_head.embed.weight[...][jax.lax.dynamic_slice(ids, (anchor,), (GAMMA,))][None]
    return module.head(last.norm(h)) + last.markov_head.head(e), dspark.confidence_logits(module, h, e)


def training_blocks(graphdef, state, ids, anchors):
    module = nnx.merge(graphdef, state)
    _, features = drafter.target_outputs(module, ids)
    return features, drafter.block_outputs(module, features, ids, anchors)


def test_training_blocks_equal_the_inference_draft_path():
    model = Model.random(CONFIG, "float32", seed=5)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(4, CONFIG.vocab_size, (2, 40)), jnp.int32)
    anchors = jnp.asarray([[3, 17, 30], [1, 9, 33]], jnp.int32)  # before and after the window fills
    features, (logits, z, labels, _) = jax.jit(training_blocks, static_argnums=0)(model.graphdef, model.params, ids,
                                                                                  anchors)
    infer = jax.jit(inference_block, static_argnums=0)
    for b in range(2):
        for j, a in enumerate(np.asarray(anchors[b])):
            expected_logits, expected_z = infer(model.graphdef, model.params, ids[b], features[b], jnp.int32(a))
            n = b * anchors.shape[1] + j
            np.testing.assert_allclose(np.asarray(logits[n]), np.asarray(expected_logits[0]), atol=2e-5)
            np.testing.assert_allclose(np.asarray(z[n]), np.asarray(expected_z[0]), atol=2e-5)
            np.testing.assert_array_equal(np.asarray(labels[n]), np.asarray(ids[b, a + 1:a + 1 + GAMMA]))


def test_a_few_steps_lower_the_loss_and_touch_only_the_drafter():
    model = Model.random(CONFIG, "float32", seed=6)
    graphdef, params, frozen = nnx.split(model.module(), drafter.DRAFTER, ...)
    frozen_before = jax.tree.map(np.asarray, frozen)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(4, CONFIG.vocab_size, (2, 32)), jnp.int32)
    anchors = jnp.asarray(drafter.sample_anchors(rng, 2, 32, GAMMA, 8))
    opt = adamw.init(params, total_steps=8)
    config = adamw.AdamWConfig(lr=3e-3, warmup_steps=2)
    first = drafter.evaluate(params, frozen, ids, anchors, graphdef=graphdef)
    for _ in range(8):
        params, opt, info = drafter.train_step(params, frozen, opt, ids, anchors, graphdef=graphdef, config=config)
    last = drafter.evaluate(params, frozen, ids, anchors, graphdef=graphdef)
    assert float(last["l1"]) < float(first["l1"]) and float(last["ce"]) < float(first["ce"])
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), frozen_before, frozen))


def test_anchors_are_distinct_and_leave_room_for_every_label():
    anchors = drafter.sample_anchors(np.random.default_rng(0), 3, 64, GAMMA, 20)
    assert anchors.shape == (3, 20)
    assert all(len(set(row)) == 20 for row in anchors.tolist())
    assert anchors.min() >= 1 and anchors.max() + GAMMA <= 63


def assert_same_drafts(model: Model, changed: Model, seed: int, atol: float):
    """Draft logits and confidence logits of `changed` equal `model`'s on random blocks; returns them."""
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(4, CONFIG.vocab_size, (2, 40)), jnp.int32)
    anchors = jnp.asarray(drafter.sample_anchors(rng, 2, 40, GAMMA, 6))
    run = jax.jit(training_blocks, static_argnums=0)
    _, (logits, z, _, _) = run(model.graphdef, model.params, ids, anchors)
    _, (changed_logits, changed_z, _, _) = run(changed.graphdef, changed.params, ids, anchors)
    np.testing.assert_allclose(np.asarray(changed_logits), np.asarray(logits), atol=atol)
    np.testing.assert_allclose(np.asarray(changed_z), np.asarray(z), atol=atol)
    return ids, anchors


def test_a_widened_markov_head_computes_what_the_narrow_one_did():
    model = Model.random(CONFIG, "float32", seed=7)
    wide = drafter.widen_markov_head(model, CONFIG.dspark.markov_rank + 5, seed=1)
    assert wide.config.dspark.markov_rank == CONFIG.dspark.markov_rank + 5
    head = wide.module().mtp[-1].markov_head
    assert head.embed.weight.shape == (CONFIG.vocab_size, CONFIG.dspark.markov_rank + 5)
    assert np.abs(np.asarray(head.embed.weight[...])[:, -5:]).max() > 0  # room to learn: W1 is not zero
    assert_same_drafts(model, wide, seed=1, atol=1e-5)
    with pytest.raises(ValueError, match="can only be widened"):
        drafter.widen_markov_head(model, 1)


def test_added_stages_compute_what_the_drafter_did():
    model = Model.random(CONFIG, "float32", seed=8)
    deep = drafter.add_stages(model, 2, seed=1)
    assert deep.config.dspark.num_stages == CONFIG.dspark.num_stages + 2
    assert deep.config.compress_ratios[-4:] == (0, 0, 0, 0)
    new = deep.module().mtp[1]
    assert np.abs(np.asarray(new.attn.wq_a.weight[...])).max() > 0  # room to learn: only the outputs are zero
    ids, anchors = assert_same_drafts(model, deep, seed=2, atol=1e-4)
    graphdef, params, frozen = nnx.split(deep.module(), drafter.DRAFTER, ...)
    params, _, _ = drafter.train_step(params, frozen, adamw.init(params, total_steps=2), ids, anchors,
                                      graphdef=graphdef, config=adamw.AdamWConfig(lr=1e-3, warmup_steps=0))
    trained = nnx.merge(graphdef, params, frozen).mtp[1]
    assert np.abs(np.asarray(trained.attn.wo_b.weight[...])).max() > 0  # the zero branches learn at once
    assert np.abs(np.asarray(trained.ffn.experts.w2.weight[...])).max() > 0
    with pytest.raises(ValueError, match="count >= 1"):
        drafter.add_stages(model, 0)
