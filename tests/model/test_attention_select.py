"""CSA attention reads only the indexer's top-k entries (gathered per query): the same result as
masking all compressed entries, which is what it replaced (kept here as the reference)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.config import EngineConfig, tiny_config
from jdspark.model import state
from jdspark.model.attention import Attention, sink_attention, sink_attention_selected
from jdspark.model.indexer import Indexer
from jdspark.model.layers import Keys

RNG = np.random.default_rng(5)
CFG = tiny_config()  # layer 2: CSA (ratio 4, index_topk 4)


def old_select(indexer, scores, visible):
    """The masked form: boolean [B, S, T], the top-k visible entries per query."""
    k = min(indexer.topk, scores.shape[-1])
    _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), k)
    return jnp.any(idx[..., :, None] == jnp.arange(scores.shape[-1]), axis=-2) & visible


def old_attend(self, x, q, qr, positions, keys, mask, entries, index_keys):
    """`Attention._attend` as it was: every compressed entry concatenated, the unselected masked."""
    if entries is not None:
        visible = jnp.arange(entries.shape[1]) < ((positions + 1) // self.ratio)[..., None]
        if index_keys is not None:
            visible = old_select(self.indexer, self.indexer.scores(x, qr, positions, index_keys), visible)
        keys = jnp.concatenate([keys, entries], axis=1)
        mask = jnp.concatenate([mask, visible], axis=-1)
    return self.output(sink_attention(q, keys, mask, self.attn_sink[...], self.head_dim ** -0.5), positions)


def test_sink_attention_selected_equals_masked_concatenation():
    b, s, n, h, tw, t, k = 2, 6, 3, 16, 7, 12, 5
    q = RNG.normal(size=(b, s, n, h)).astype(np.float32)
    kv = RNG.normal(size=(b, tw, h)).astype(np.float32)
    entries = RNG.normal(size=(b, t, h)).astype(np.float32)
    sink = RNG.normal(size=n).astype(np.float32)
    mask = RNG.random((b, s, tw)) < 0.5
    idx = np.stack([[RNG.permutation(t)[:k] for _ in range(s)] for _ in range(b)])  # distinct per query
    valid = RNG.random((b, s, k)) < 0.7
    mask[0, 1], valid[0, 1] = False, False  # no key at all: only the sink, output 0
    mask[1, 2] = False  # only selected keys
    valid[1, 3] = False  # only window keys
    selected = entries[np.arange(b)[:, None, None], idx]  # [B, S, K, H]
    chosen = np.zeros((b, s, t), bool)
    np.put_along_axis(chosen, idx, valid, axis=-1)
    want = sink_attention(jnp.asarray(q), jnp.asarray(np.concatenate([kv, entries], 1)),
                          jnp.asarray(np.concatenate([mask, chosen], -1)), jnp.asarray(sink), 0.3)
    got = sink_attention_selected(jnp.asarray(q), jnp.asarray(kv), jnp.asarray(mask), jnp.asarray(selected),
                                  jnp.asarray(valid), jnp.asarray(sink), 0.3)
    assert got.dtype == jnp.float32 and got.shape == (b, s, n, h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.asarray(got)[0, 1].any()
    assert np.abs(np.asarray(got)[1, 2]).min() > 0 and np.abs(np.asarray(got)[1, 3]).min() > 0


@pytest.mark.parametrize("t", [0, 3, 10])
def test_select_indices_cover_the_masked_selection(t):
    """Fewer visible entries than k (early queries, t < k) leave invalid slots; T = 0 gives K = 0."""
    indexer = Indexer(CFG, dtype=jnp.float32, rngs=Keys(concrete=True, seed=3))
    s = 48
    scores = jnp.asarray(RNG.normal(size=(2, s, t)), jnp.float32)
    visible = jnp.arange(t) < ((jnp.arange(s) + 1) // 4)[None, :, None]
    visible = jnp.broadcast_to(visible, (2, s, t))
    idx, valid = indexer.select(scores, visible)
    assert idx.shape == valid.shape == (2, s, min(CFG.index_topk, t)) and idx.dtype == jnp.int32
    chosen = np.zeros((2, s, t), bool)
    np.put_along_axis(chosen, np.asarray(idx), np.asarray(valid), axis=-1)
    np.testing.assert_array_equal(chosen, np.asarray(old_select(indexer, scores, visible)))
    assert (np.asarray(valid).sum(-1) == np.minimum(np.asarray(visible).sum(-1), CFG.index_topk)).all()


@pytest.mark.parametrize("layer", [2, 3])  # CSA (gathered) and HCA (unchanged)
def test_attention_call_and_extend_equal_the_masked_form(layer, monkeypatch):
    """Full sequence and two extend chunks (prefill, then a decode-sized one reading cached entries)."""
    attn = Attention(CFG, layer, dtype=jnp.float32, rngs=Keys(concrete=True, seed=9))
    x = jnp.asarray(RNG.normal(size=(2, 43, CFG.hidden_size)), jnp.float32)
    cache = state.init_state(CFG, EngineConfig(max_seq_len=64, gamma=2, max_batch=2), jnp.float32).layers[layer]

    def run():
        # One compiled program instead of ~600 eager ops; a new function per call, so the second
        # call traces again, with `_attend` patched.
        def forward(attn, x, cache):
            full = attn(x, jnp.broadcast_to(jnp.arange(43), (2, 43)))
            first, c = attn.extend(x[:, :40], jnp.broadcast_to(jnp.arange(40), (2, 40)), cache,
                                   jnp.zeros(2, jnp.int32), jnp.array([40, 37], jnp.int32))
            length = jnp.array([40, 37], jnp.int32)
            second, _ = attn.extend(x[:, 40:], length[:, None] + jnp.arange(3), c, length, jnp.full(2, 3, jnp.int32))
            return full, first, second
        return [np.asarray(a) for a in jax.jit(forward)(attn, x, cache)]

    got = run()
    monkeypatch.setattr(Attention, "_attend", old_attend)
    for g, w in zip(got, run()):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
