"""Drafter training runs the inference draft path: a training block's draft distributions and
confidences equal what the engine's draft cache + `propose` compute for the same anchor."""

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.drafter import dspark
from jdspark.model.model import Model
from jdspark.train import adamw, drafter
from tests.conftest import DSPARK_CONFIG

CONFIG = DSPARK_CONFIG  # window 8, 3 layers + 2 drafter stages, vocabulary 16
GAMMA = CONFIG.dspark.block_size


def engine_proposals(graphdef, state, features, anchor_ids, anchors, exponentials, chunk=7):
    """What the engine drafts at anchors [N]: draft caches pushed `chunk` positions per call (the
    engine's prefill chunks; 7 against a window of 8, so the ring wraps inside chunks), then
    `propose` at T = 1 without top-k / top-p."""
    module = nnx.merge(graphdef, state)
    n = anchors.shape[0]
    cache = dspark.init_draft_cache(CONFIG, n, jnp.float32)
    for start in range(0, features.shape[1], chunk):  # every row pushes its positions start.. < anchor
        rows = features[:, start:start + chunk]
        cache = dspark.push_context(module, cache, rows, jnp.clip(anchors - start, 0, rows.shape[1]))
    ones = jnp.ones((n,), jnp.float32)
    return dspark.propose(module, cache, anchor_ids, ones, jnp.zeros((n,), jnp.int32), ones, exponentials)


def target_features(graphdef, state, ids):
    return drafter.target_outputs(nnx.merge(graphdef, state), ids)[1]


def blocks_on(graphdef, state, features, ids, anchors):
    return drafter.block_outputs(nnx.merge(graphdef, state), features, ids, anchors)


def training_blocks(graphdef, state, ids, anchors):
    module = nnx.merge(graphdef, state)
    _, features = drafter.target_outputs(module, ids)
    return features, drafter.block_outputs(module, features, ids, anchors)


def test_training_blocks_equal_what_propose_draws_from():
    """At each anchor the engine's path (chunked `push_context`, `propose`) samples a block; the
    training block on the sequence continued by those drafts gives the distributions it sampled
    from (q = softmax of the teacher-forced logits) and its confidences."""
    model = Model.random(CONFIG, "float32", seed=5)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(4, CONFIG.vocab_size, (2, 40)), jnp.int32)
    anchors = np.array([[3, 17, 30], [1, 9, 33]])  # before and after the window fills
    features = jax.jit(target_features, static_argnums=0)(model.graphdef, model.params, ids)
    sequence, flat = np.repeat(np.arange(2), 3), jnp.asarray(anchors.reshape(-1), jnp.int32)
    exponentials = jax.random.exponential(jax.random.key(1), (6, GAMMA, CONFIG.vocab_size), jnp.float32)
    proposal = jax.jit(engine_proposals, static_argnums=0)(model.graphdef, model.params, features[sequence],
                                                           ids[sequence, flat], flat, exponentials)
    drafted = np.asarray(ids)[sequence]
    for n, a in enumerate(anchors.reshape(-1)):
        drafted[n, a + 1:a + 1 + GAMMA] = np.asarray(proposal.tokens[n])  # the sequence the drafts continue
    logits, z, labels, _ = jax.jit(blocks_on, static_argnums=0)(model.graphdef, model.params, features[sequence],
                                                               jnp.asarray(drafted), flat[:, None])
    assert CONFIG.dspark.confidence_temperatures is None  # propose's confidence is sigmoid(z)
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits, axis=-1)), np.asarray(proposal.q), atol=2e-5)
    np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(z)), np.asarray(proposal.confidence), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(labels), np.asarray(proposal.tokens))
    assert len(np.unique(np.asarray(proposal.tokens))) > 3  # sampled, not one token repeated


@pytest.mark.slow  # compiles train_step and evaluate: about 15 s on a 2-core CPU
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
    z, accept = drafter.calibration_data(params, frozen, ids, anchors, graphdef=graphdef)  # what STS fits on
    assert z.shape == accept.shape == (16, GAMMA)
    np.testing.assert_allclose(np.asarray(accept).mean(axis=0), np.asarray(last["accept"]), atol=1e-6)
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


@pytest.mark.slow  # two 4-stage drafters and a train_step: about 20 s
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
