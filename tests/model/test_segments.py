"""Segments in one extend (`DSV4.extend_segments`): a verify block and a prompt chunk of other slots run
together equal each run alone (tiny config in float32: window, CSA and HCA layers, hash-routed layers;
the routed experts through the XLA gather and through the kernel, interpret mode, where rows past
n_valid take no expert of their own: `moe.route_kept_rows_only`), an empty segment (n_valid 0)
changes nothing, and a segment's logits at each row's last real token alone (`last_logits`) are those
rows of its full logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.config import EngineConfig, tiny_config
from jdspark.model.model import Model
from jdspark.model.moe import Experts

TOL = 1e-5
FEATURES = (2, 3)  # a CSA and an HCA layer's output
ENGINE = EngineConfig(max_seq_len=64, gamma=5, max_batch=4)
HELD = (21, 9, 30, 4)  # tokens each slot holds before the calls: entries completed, windows part-full


@pytest.fixture(scope="module")
def model():
    return Model.random(tiny_config(), "float32", seed=3)


@pytest.fixture(scope="module")
def kernel_model():
    """32 experts of 256 through the routed-expert kernel: the path that reads the joined rows' kept mask."""
    module = Model.random(tiny_config(moe_intermediate_size=256, n_routed_experts=32), "float32", seed=3).module()
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Experts):
            node.implementation = "pallas"
    return Model(*nnx.split(module))


def held_state(model):
    """Four slots holding HELD tokens each."""
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 512, (4, max(HELD))).astype(np.int32)
    return model.extend(model.init_state(ENGINE), ids, np.asarray(HELD, np.int32)).state


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run(graphdef, n_segments, last_logits, params, segments):
    results = nnx.merge(graphdef, params).extend_segments(segments, FEATURES, last_logits)
    assert len(results) == n_segments
    return results


def extend_segments(model, *segments, last_logits=()):
    """[(logits, features, state)] of the segments run in one call, each (ids, state, n_valid)."""
    segments = tuple((jnp.asarray(i, jnp.int32), s, jnp.asarray(n, jnp.int32)) for i, s, n in segments)
    return _run(model.graphdef, len(segments), tuple(last_logits), model.params, segments)


def rows(tree, slots):
    return jax.tree.map(lambda a: a[np.asarray(slots)], tree)


def assert_close(a, b, what):
    for path, x, y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        finite = np.isfinite(x)
        np.testing.assert_array_equal(finite, np.isfinite(y), err_msg=f"{what} {path[0]}")
        err = np.abs(np.where(finite, x, 0.0) - np.where(finite, y, 0.0)).max(initial=0.0)
        assert err <= TOL, (what, jax.tree_util.keystr(path[0]), err)


def valid(logits, n_valid):
    """Logits of the rows each slot keeps (the others are computed but not used)."""
    return [np.asarray(logits)[b, :n] for b, n in enumerate(n_valid)]


@pytest.mark.parametrize("experts", ["gather", "kernel"])
def test_a_verify_block_and_a_prompt_chunk_together_equal_each_alone(experts, request):
    model = request.getfixturevalue("model" if experts == "gather" else "kernel_model")
    state = held_state(model)
    rng = np.random.default_rng(9)
    verify, verify_valid = rng.integers(0, 512, (2, 6)), np.array([6, 3])  # slots 0 and 2, widths 5 and 2
    prompt, prompt_valid = rng.integers(0, 512, (1, 11)), np.array([8])  # slot 1: an 8-token chunk
    together = extend_segments(model, (verify, rows(state, [0, 2]), verify_valid),
                               (prompt, rows(state, [1]), prompt_valid))
    alone = [extend_segments(model, (verify, rows(state, [0, 2]), verify_valid))[0],
             extend_segments(model, (prompt, rows(state, [1]), prompt_valid))[0]]
    for (logits, features, new), (logits_1, features_1, new_1), n_valid in zip(together, alone,
                                                                               (verify_valid, prompt_valid)):
        assert_close(valid(logits, n_valid), valid(logits_1, n_valid), "logits")
        assert_close(valid(features, n_valid), valid(features_1, n_valid), "features")
        assert_close(new, new_1, "state")
    np.testing.assert_array_equal(together[1][2].length, [HELD[1] + 8])


def test_an_empty_segment_changes_nothing(model):
    """A segment whose rows keep nothing (n_valid 0: no prompt this call) leaves its slots as they were
    and the other segment's results as they are alone."""
    state = held_state(model)
    rng = np.random.default_rng(10)
    verify, verify_valid = rng.integers(0, 512, (3, 4)), np.array([4, 1, 2])
    empty = rng.integers(0, 512, (1, 8))
    (logits, _, new), (_, _, untouched) = extend_segments(
        model, (verify, rows(state, [0, 1, 2]), verify_valid), (empty, rows(state, [3]), np.array([0])))
    (logits_1, _, new_1), = extend_segments(model, (verify, rows(state, [0, 1, 2]), verify_valid))
    assert_close(valid(logits, verify_valid), valid(logits_1, verify_valid), "logits")
    assert_close(new, new_1, "state")
    np.testing.assert_array_equal(untouched.length, [HELD[3]])
    np.testing.assert_array_equal(untouched.written, [0])
    assert_close(untouched.layers, rows(state, [3]).layers, "the empty segment's caches")


def test_a_segments_last_logits_are_its_rows_last_real_tokens(model):
    """`last_logits` (a prompt chunk's: the engine draws its first token there): [B, 1, V] at each row's
    n_valid - 1 (row 0 where it keeps nothing), the other segment's logits and every state as without it."""
    state = held_state(model)
    rng = np.random.default_rng(11)
    verify, verify_valid = rng.integers(0, 512, (1, 6)), np.array([4])
    chunk, chunk_valid = rng.integers(0, 512, (3, 9)), np.array([9, 5, 0])
    segments = (verify, rows(state, [0]), verify_valid), (chunk, rows(state, [1, 2, 3]), chunk_valid)
    full = extend_segments(model, *segments)
    last = extend_segments(model, *segments, last_logits=(False, True))
    assert np.asarray(last[1][0]).shape == (3, 1, model.config.vocab_size)
    assert_close(np.asarray(last[1][0])[:, 0], np.asarray(full[1][0])[np.arange(3), [8, 4, 0]], "last logits")
    assert_close(valid(last[0][0], verify_valid), valid(full[0][0], verify_valid), "the verify logits")
    assert_close([s for _, _, s in last], [s for _, _, s in full], "states")
