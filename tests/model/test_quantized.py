"""Compact storage layouts: which modules are quantized, that they compute with the decoded weights,
and that full-size models have the checkpoint's size in memory."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jdspark.config import QuantConfig, flash_config, pro_config, tiny_config
from jdspark.model.layers import Keys, Linear
from jdspark.model.moe import ExpertWeights
from jdspark.model.quantized import (FP4ExpertWeights, FP8ExpertWeights, FP8Linear, Storage, abstract_model, build,
                                     is_fp8_linear)
from tests.model.dequant_ref import decode_fp4, decode_fp8

FLASH = Storage(linears="fp8", experts="fp4", scale_dtype="e8m0")
BASE = Storage(linears="fp8", experts="fp8", scale_dtype="float32")


def modules(model) -> dict[str, nnx.Module]:
    return {".".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}


def test_fp8_linears_are_those_of_the_official_checkpoint():
    model = build(tiny_config(), jnp.float32, Storage(), Keys(0, concrete=True))
    fp8 = {name.split(".", 2)[-1] for name, m in modules(model).items()  # relative to layers.i / mtp.0
           if isinstance(m, Linear) and is_fp8_linear((*name.split("."), "weight"))}
    assert fp8 == {  # spec §7.2: the F8_E4M3 tensors with a .scale
        "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
        "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "e_proj", "h_proj"}


@pytest.mark.parametrize("storage", [FLASH, BASE], ids=["flash", "base"])
def test_build_swaps_in_compact_modules(storage):
    model = build(tiny_config(), jnp.bfloat16, storage, Keys(0, concrete=True))
    mods = modules(model)
    assert isinstance(mods["layers.2.attn.wq_a"], FP8Linear)
    assert isinstance(mods["mtp.0.e_proj"], FP8Linear) and isinstance(mods["layers.0.ffn.shared_experts.w2"], FP8Linear)
    assert isinstance(mods["layers.2.attn.wo_a"], FP8Linear)  # FP8 on disk; the grouped product decodes it
    assert type(mods["layers.2.attn.compressor.wkv"]) is Linear and type(mods["head"]) is Linear
    experts = FP4ExpertWeights if storage.experts == "fp4" else FP8ExpertWeights
    assert isinstance(mods["layers.1.ffn.experts.w1"], experts)
    scale = mods["layers.2.attn.wq_b"].scale
    assert scale.dtype == (jnp.uint8 if storage.scale_dtype == "e8m0" else jnp.float32)
    assert scale.shape == (4, 1)  # [ceil(512 / 128), ceil(128 / 128)]


def test_quantized_modules_compute_with_the_decoded_weights():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 200)), jnp.float32)
    lin = FP8Linear(200, 136, scale_dtype="e8m0")
    lin.weight[...] = rng.integers(0, 0x7F, (136, 200), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    lin.scale[...] = rng.integers(115, 130, (2, 2), dtype=np.uint8)
    dense = decode_fp8(np.asarray(lin.weight[...]), np.asarray(lin.scale[...]))
    want = np.asarray(x) @ dense.T
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(lin, x)), want, atol=1e-5 * np.abs(want).max())
    bank = FP4ExpertWeights(3, 64, 10)
    bank.weight[...] = rng.integers(-128, 128, (3, 10, 32), dtype=np.int8)
    bank.scale[...] = rng.integers(115, 130, (3, 10, 2), dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(bank.dense(jnp.float32)),
                                  decode_fp4(np.asarray(bank.weight[...]), np.asarray(bank.scale[...])))
    assert isinstance(bank, ExpertWeights)


def test_storage_from_config():
    assert Storage.from_config(tiny_config()) == Storage()
    assert Storage.from_config(flash_config()) == FLASH
    base = flash_config(expert_dtype=None, quantization=QuantConfig(scale_fmt=None, scale_dtype="float32"))
    assert Storage.from_config(base) == BASE  # the reference: experts take the default (FP8) format


def _device_bytes(cfg) -> float:
    _, state = abstract_model(cfg, jnp.bfloat16, Storage.from_config(cfg))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for _, x in leaves)


@pytest.mark.parametrize("make,checkpoint_bytes", [(flash_config, 159.6e9), (pro_config, 805 * 2 ** 30)])
def test_full_size_models_are_compact(make, checkpoint_bytes):
    """Spec §7.6 / §7.1: Flash + MTP ~159.6 GB; the Pro files hold 805 GiB: in memory every tensor
    has the checkpoint's size."""
    total = _device_bytes(make())
    assert abs(total / checkpoint_bytes - 1) < 0.01, total


# ---- routed experts: the gather path against the every-expert oracle ------------------------------

def ref_experts(ex, x, weights, idx):
    """The former production path, kept as the oracle: every expert decoded and run on every row,
    weighted by a dense [N, E] routing matrix (zero for unselected experts)."""
    from jdspark.model.moe import swiglu
    dense = jnp.sum(jax.nn.one_hot(idx, ex.n_experts, dtype=jnp.float32) * weights[..., None], axis=-2)
    dtype = x.dtype
    gate = jnp.einsum("nd,efd->nef", x, ex.w1.dense(dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum("nd,efd->nef", x, ex.w3.dense(dtype), preferred_element_type=jnp.float32)
    h = (swiglu(gate.astype(dtype), up.astype(dtype), ex.limit) * dense[..., None]).astype(dtype)
    out = jnp.einsum("nef,edf->ned", h, ex.w2.dense(dtype), preferred_element_type=jnp.float32)
    return jnp.sum(out.astype(dtype).astype(jnp.float32), axis=1)


def random_experts(storage: Storage, dtype, seed: int, width: int = 160, n_experts: int = 12):
    """Experts of a small config in `storage`, filled with random stored values (every code)."""
    from jdspark.model.moe import Experts
    cfg = tiny_config(hidden_size=256, moe_intermediate_size=width, n_routed_experts=n_experts, num_experts_per_tok=3,
                      swiglu_limit=4.0)
    ex = Experts(cfg, dtype=dtype, rngs=Keys(seed, concrete=True))
    rng = np.random.default_rng(seed)
    for name in ("w1", "w3", "w2"):
        bank = getattr(ex, name)
        e, out_f, in_f = bank.weight.shape
        if storage.experts == "fp4":
            bank = FP4ExpertWeights(e, in_f, out_f)
            bank.weight[...] = rng.integers(-128, 128, bank.weight.shape, dtype=np.int8)
            bank.scale[...] = rng.integers(120, 126, bank.scale.shape, dtype=np.uint8)
        elif storage.experts == "fp8":
            bank = FP8ExpertWeights(e, in_f, out_f, scale_dtype=storage.scale_dtype)
            raw = rng.integers(0, 256, bank.weight.shape, dtype=np.uint8)
            raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
            bank.weight[...] = raw.view(ml_dtypes.float8_e4m3fn)
            bank.scale[...] = (rng.integers(112, 118, bank.scale.shape, dtype=np.uint8) if storage.scale_dtype == "e8m0"
                               else rng.uniform(2e-5, 1e-4, bank.scale.shape).astype(np.float32))
        setattr(ex, name, bank)
    return ex


def routing(rng, rows: int, n_experts: int, k: int, pool: int):
    """Rows drawing k distinct experts out of a pool of `pool`, so experts repeat across rows."""
    experts = rng.permutation(n_experts)[:pool]
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]).astype(np.int32)
    return idx, rng.uniform(0.1, 1.0, (rows, k)).astype(np.float32)


@pytest.mark.parametrize("storage", [Storage(), FLASH, Storage(experts="fp8"), BASE],
                         ids=["float", "fp4", "fp8", "fp8_f32"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_routed_experts_read_only_selected_equal_every_expert_oracle(storage, dtype):
    ex = random_experts(storage, dtype, seed=3)
    rng = np.random.default_rng(11)
    call = jax.jit(lambda m, x, w, i: m(x, w, i))
    oracle = jax.jit(ref_experts)
    for rows, pool in [(1, 3), (3, 4), (6, 12), (17, 5)]:
        idx, w = routing(rng, rows, 12, 3, pool)
        x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
        got, want = call(ex, x, jnp.asarray(w), jnp.asarray(idx)), oracle(ex, x, jnp.asarray(w), jnp.asarray(idx))
        scale = float(jnp.abs(want).max())
        assert scale > 0
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol * scale, rtol=0)


def test_routed_slots_hold_each_selected_expert_once():
    from jdspark.model.moe import routed_slots
    idx = jnp.asarray([[5, 2], [2, 7], [5, 2]], jnp.int32)
    w = jnp.asarray([[0.25, 0.5], [1.0, 2.0], [4.0, 8.0]], jnp.float32)
    experts, dense = routed_slots(w, idx, n_experts=9)
    assert experts.tolist() == [2, 5, 7, -1, -1, -1]  # M = min(6, 9); padding slots are missing, weight 0
    np.testing.assert_array_equal(np.asarray(dense), [[0.5, 0.25, 0, 0, 0, 0], [1.0, 0, 2.0, 0, 0, 0],
                                                      [8.0, 4.0, 0, 0, 0, 0]])
    experts, dense = routed_slots(w, jnp.asarray([[8, 2], [2, 7], [8, 2]], jnp.int32), n_experts=9)
    assert experts.tolist() == [2, 7, 8, -1, -1, -1]
    np.testing.assert_array_equal(np.asarray(dense)[:, 2:].sum(0), [0.25 + 4.0, 0, 0, 0])  # expert 8's slot only


@pytest.mark.parametrize("storage", [Storage(), FLASH, BASE], ids=["float", "fp4", "fp8_f32"])
@pytest.mark.parametrize("rows", [6, 70], ids=["slots", "grouped"])
def test_routed_expert_kernel_in_the_model_equals_the_gather_path(storage, rows):
    """implementation="pallas" (interpret mode here) computes what the XLA gather path does, in the
    kernel's slot form and, from GROUPED_MIN_ROWS rows, its grouped form."""
    from jdspark.model.moe import GROUPED_MIN_ROWS
    assert (rows >= GROUPED_MIN_ROWS) == (rows == 70)
    ex = random_experts(storage, jnp.bfloat16, seed=5, width=256)
    rng = np.random.default_rng(12)
    idx, w = routing(rng, rows, 12, 3, 5)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    want = jax.jit(lambda m, x, w, i: m(x, w, i))(ex, x, jnp.asarray(w), jnp.asarray(idx))
    ex.implementation = "pallas"
    got = jax.jit(lambda m, x, w, i: m(x, w, i))(ex, x, jnp.asarray(w), jnp.asarray(idx))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2 * float(jnp.abs(want).max()), rtol=0)


@pytest.mark.parametrize("rows,k,n_experts", [(1, 6, 256), (6, 6, 256), (64, 6, 256), (7, 3, 12), (100, 6, 256)])
def test_expert_slots_equal_numpy_unique(rows, k, n_experts):
    """The distinct experts, sorted and padded with -1 (missing: read by no one), and each choice's
    slot, at decode, verify and prefill sizes."""
    from jdspark.model.moe import expert_slots
    rng = np.random.default_rng(rows)
    pool = rng.permutation(n_experts)[:max(k, rows // 2)]
    idx = np.stack([rng.choice(pool, k, replace=False) for _ in range(rows)]).astype(np.int32)
    experts, slot = jax.jit(expert_slots, static_argnums=1)(jnp.asarray(idx), n_experts)
    if rows == 1:  # one row's distinct choices are the slots, in router order
        np.testing.assert_array_equal(np.asarray(experts), idx[0])
        np.testing.assert_array_equal(np.asarray(slot), np.arange(k)[None])
        return
    m = min(rows * k, n_experts)
    distinct = np.unique(idx)
    want = np.concatenate([distinct, np.full(m - len(distinct), -1)])
    np.testing.assert_array_equal(np.asarray(experts), want)
    np.testing.assert_array_equal(np.asarray(slot), np.searchsorted(distinct, idx))


@pytest.mark.parametrize("scale_dtype", ["e8m0", "float32"])
def test_fp8_linear_kernel_in_the_model_equals_the_decoded_weights(scale_dtype):
    """implementation="pallas" (interpret mode here) sends every FP8 linear of a quantized model through
    `pallas_kernels.fp8_linear`: the extend's logits equal the decoding path's."""
    from jdspark.config import EngineConfig
    from jdspark.model import state as state_lib
    from jdspark.model.hyper import with_implementation
    # One layer of each kind (window, CSA, HCA): every FP8 linear of every kind, each shape of the
    # kernel (the tiny config's second window / CSA / HCA layers repeat the same 25 sites).
    cfg = tiny_config(num_nextn_predict_layers=0, num_hidden_layers=3, compress_ratios=(0, 4, 16), num_hash_layers=1,
                      quantization=QuantConfig(scale_dtype=scale_dtype), expert_dtype="fp4")
    model = build(cfg, jnp.float32, Storage.from_config(cfg), Keys(3, concrete=True))
    rng = np.random.default_rng(4)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, FP8Linear):
            raw = rng.integers(0, 256, node.weight.shape, dtype=np.uint8)
            raw[(raw & 0x7F) == 0x7F] = 0
            node.weight[...] = jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn))
            node.scale[...] = (jnp.asarray(rng.integers(117, 121, node.scale.shape), jnp.uint8) if scale_dtype == "e8m0"
                               else jnp.asarray(rng.uniform(1e-3, 4e-3, node.scale.shape), jnp.float32))
    graphdef, params = nnx.split(model)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 5)), jnp.int32)

    def logits(implementation):
        g = with_implementation(graphdef, params, implementation)
        decode = state_lib.init_state(cfg, EngineConfig(max_seq_len=64, max_batch=1), jnp.float32)
        run = jax.jit(lambda p, d, i: nnx.merge(g, p).extend(i, d, jnp.full((1,), 5, jnp.int32))[0])
        return np.asarray(run(params, decode, ids))

    want, got = logits("xla"), logits("pallas")
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
