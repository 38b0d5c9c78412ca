"""The engine's drafts equal a from-scratch recomputation over the committed context.

Mid-generation (accepts and rejections behind it), the proposal the engine drafted at a step —
seen through its confidences, which the next step's record carries as `stale_confidence` and which
read the drafter's hidden states and every drafted token (W1[prev]) — is recomputed from nothing
but the committed tokens: one target forward over them, a fresh draft cache pushed from its
features, and `dspark.propose` from the anchor. Greedy requests, so no noise needs reproducing.

Mutation caught: the drafter's context missing the anchor row (the verify block's row 0 not pushed,
or the drafter attending one context row short); greedy output equality cannot see drafter bugs.
(Checked with an engine whose verify steps push the block without its anchor row: its
confidences differ from the recomputation by 0.12-0.46 at the checked steps, against a tolerance
of 1e-5, and it accepts no draft.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.drafter import dspark
from jdspark.engine.request import SamplingParams
from tests.conftest import DSPARK_CONFIG

# The session engine with every width (tests/conftest.py dspark_engine) is compiled for these: minutes on
# a 2-core CPU. `make test-fast` leaves them out; `make test` (CI) runs them.
pytestmark = pytest.mark.slow


PROMPT = np.array([5, 9, 2, 14, 7, 7, 1, 12, 0, 4], np.int32)


PAD = 96  # every recomputation runs at one length: one compilation (the forward is causal)


@functools.partial(jax.jit, static_argnums=0)  # the model by identity: its weights are constants here
def _fresh_proposal(model, padded: jax.Array, n: jax.Array, anchor: jax.Array) -> dspark.Proposal:
    features = model.forward(padded[None], DSPARK_CONFIG.dspark.target_layer_ids).features
    module = model.module()
    cache = dspark.init_draft_cache(DSPARK_CONFIG, 1, model.dtype)
    cache = dspark.push_context(module, cache, features, n[None])
    zeros, ones = jnp.zeros(1, jnp.float32), jnp.ones(1, jnp.float32)
    noise = jnp.ones((1, DSPARK_CONFIG.dspark.block_size, DSPARK_CONFIG.vocab_size), jnp.float32)
    return dspark.propose(module, cache, anchor[None], zeros, jnp.zeros(1, jnp.int32), ones, noise)


def fresh_proposal(model, committed: np.ndarray, anchor: int) -> dspark.Proposal:
    """The greedy proposal after `committed` tokens with `anchor` next, computed from scratch."""
    padded = np.zeros(PAD, np.int32)
    padded[:len(committed)] = committed
    return _fresh_proposal(model, padded, np.int32(len(committed)), np.int32(anchor))


def test_drafts_equal_a_recomputation_over_the_committed_context(dspark_engine, dspark_model):
    engine = dspark_engine
    saved = engine.policy()  # the shared engine's, restored below for the tests after this one
    engine.set_policy(speculative=True, width_policy=lambda confidence: 3, overlap=False)  # each step read whole
    first = engine.add(PROMPT, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    rid, tokens = first.request_id, list(first.tokens)
    contexts = []  # (committed tokens, anchor) before each step
    with engine.record_steps() as records:
        for _ in range(10):
            contexts.append((np.concatenate([PROMPT, tokens[:-1]]).astype(np.int32), tokens[-1]))
            tokens += engine.step()[rid].tokens
    engine.cancel(rid)
    engine.set_policy(**saved)
    accepted = [r.rows[0].n_accepted for r in records]
    assert 0 in accepted[2:] and max(accepted) > 0, accepted  # rejections and acceptances behind the checks
    for step in (3, 6, 8):
        committed, anchor = contexts[step]
        want = fresh_proposal(dspark_model, committed, anchor)
        got = records[step + 1].rows[0].stale_confidence  # the proposal drafted at `step`
        np.testing.assert_allclose(got, np.asarray(want.confidence)[0], rtol=1e-5, atol=1e-6, err_msg=str(step))
        n = records[step].rows[0].n_accepted  # the accepted drafts were the proposal's first tokens
        np.testing.assert_array_equal(records[step].rows[0].emitted[:n], np.asarray(want.tokens)[0, :n])
