"""Hybrid MoE layers (experts split between the device and host banks) compute what the all-device
model does: per layer in every storage, the logits of a tiny model, vmap, clear errors; the engine's
greedy tokens and the losslessness of speculative sampling (slow); the GPU's PCIe share of the host
experts. float32 within 1e-6 on the CPU, 4e-6 on a GPU (the host GEMV sums in another order than the
device's dot, and a GPU's dot in yet another; logits within 3e-6, those differences carried through
the layers), bfloat16 within one bf16 rounding of an intermediate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.checkpoint.loader import load_model
from jdspark.checkpoint.synthetic import write_checkpoint
from jdspark.config import EngineConfig, QuantConfig, tiny_config
from jdspark.engine.engine import Engine
from jdspark.engine.request import SamplingParams
from jdspark.experts.hybrid import HybridExperts, host_banks, is_main_expert, pcie_split, with_host_experts
from jdspark.model.model import Model
from jdspark.model.quantized import Storage
from tests.conftest import DSPARK_CONFIG, generate_to_end
from tests.model.test_quantized import BASE, FLASH, random_experts, routing

CFG = tiny_config(num_hidden_layers=3, compress_ratios=(0, 4, 16, 0), num_hash_layers=1)
HOST = {0: [1, 2, 5], 2: list(range(8))}  # part of layer 0, all of layer 2 (no device part there)
CALL = jax.jit(lambda m, x, w, i: m(x, w, i))
F32_BOUND = 1e-6 if jax.default_backend() == "cpu" else 4e-6


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def bf16_valued(model: Model) -> Model:
    """`model` with its float routed experts rounded to bf16 values (what a host bank holds)."""
    module = model.module()
    for layer in module.layers:
        for name in ("w1", "w3", "w2"):
            w = getattr(layer.ffn.experts, name).weight
            w[...] = w[...].astype(jnp.bfloat16).astype(w.dtype)
    return Model(*nnx.split(module))


@pytest.mark.parametrize("storage", [Storage(), FLASH, Storage(experts="fp8"), BASE],
                         ids=["float", "fp4", "fp8", "fp8_f32"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_layer_equals_device_experts(storage, dtype):
    ex = random_experts(storage, dtype, seed=3)
    if storage.experts is None and dtype == jnp.float32:
        bf16_valued_experts(ex)
    rng = np.random.default_rng(4)
    for host in ([0, 3, 4, 9], list(range(12))):
        hybrid = HybridExperts(ex, host, dtype=dtype)
        assert (hybrid.w1 is None) == (len(host) == 12) and len(hybrid.bank.expert_ids) == len(host)
        for rows, pool in [(1, 3), (6, 12), (17, 5)]:
            idx, w = routing(rng, rows, 12, 3, pool)
            x = jnp.asarray(rng.standard_normal((rows, 256)), dtype)
            args = (x, jnp.asarray(w), jnp.asarray(idx))
            want, got = CALL(ex, *args), CALL(hybrid, *args)
            assert got.dtype == jnp.float32 and got.shape == want.shape
            assert rel(got, want) <= (F32_BOUND if dtype == jnp.float32 else 2 ** -7), (host, rows, rel(got, want))


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("storage", [Storage(), FLASH], ids=["float", "fp4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pcie_share_equals_device_experts(storage, dtype, share):
    """Host experts split between the GPU's PCIe share (the device's own kernel or gather over the
    bank's memory) and the CPU compute the all-device layer."""
    ex = bf16_valued_experts(random_experts(storage, dtype, seed=3)) if storage.experts is None \
        else random_experts(storage, dtype, seed=3)
    rng = np.random.default_rng(5)
    for host in ([0, 3, 4, 9], list(range(12))):
        hybrid = HybridExperts(ex, host, dtype=dtype, pcie_share=share)
        for rows, pool in [(1, 3), (6, 12), (17, 5)]:
            idx, w = routing(rng, rows, 12, 3, pool)
            args = (jnp.asarray(rng.standard_normal((rows, 256)), dtype), jnp.asarray(w), jnp.asarray(idx))
            want, got = CALL(ex, *args), CALL(hybrid, *args)
            assert rel(got, want) <= (F32_BOUND if dtype == jnp.float32 else 2 ** -7), (host, rows, rel(got, want))


@pytest.mark.parametrize("pairwise_max", [2048, 0], ids=["pairwise", "sorted"])
def test_pcie_split_gives_each_distinct_host_expert_to_one_share(pairwise_max, monkeypatch):
    """The GPU takes the first round(q * n) of a call's n distinct host experts in bank order, every
    pair of an expert goes where its expert goes, the pairs of device experts go to neither, and the
    share's slots hold the GPU's experts, then -1: by pairwise comparisons (decode, verify) and by a
    sort (calls past PAIRWISE_MAX pairs)."""
    from jdspark.experts import hybrid
    monkeypatch.setattr(hybrid, "PAIRWISE_MAX", pairwise_max)
    rng = np.random.default_rng(0)
    slot_of = np.full(16, -1, np.int32)
    held = np.sort(rng.choice(16, 9, replace=False))
    slot_of[held] = np.arange(9)
    for share in (0.0, 0.3, 0.5, 1.0):
        for rows in (1, 3, 8):
            idx = np.stack([rng.choice(16, 4, replace=False) for _ in range(rows)]).astype(np.int32)
            split = pcie_split(jnp.asarray(slot_of), jnp.asarray(idx), share, 9)
            slots = slot_of[idx]
            distinct = np.unique(slots[slots >= 0])
            gpu = distinct[:int(np.floor(share * len(distinct) + 0.5))]
            np.testing.assert_array_equal(np.asarray(split.on_gpu), np.isin(slots, gpu) & (slots >= 0))
            np.testing.assert_array_equal(np.asarray(split.on_cpu), (slots >= 0) & ~np.isin(slots, gpu))
            experts = np.asarray(split.experts)
            g = int(np.floor(share * min(rows * 4, 9) + 0.5))
            assert experts.shape == (g + 1,) and list(experts[:len(gpu)]) == list(gpu) and (experts[len(gpu):] == -1).all()
            chosen = np.asarray(split.slot)
            np.testing.assert_array_equal(np.where(np.asarray(split.on_gpu), experts[chosen], -1),
                                          np.where(np.asarray(split.on_gpu), slots, -1))
            assert (chosen[~np.asarray(split.on_gpu)] == g).all()


def bf16_valued_experts(ex):
    """Float routed experts rounded to bf16 values (what a host bank holds)."""
    for name in ("w1", "w3", "w2"):
        w = getattr(ex, name).weight
        w[...] = w[...].astype(jnp.bfloat16).astype(w.dtype)
    return ex


@pytest.mark.parametrize("share", [0.0, 0.5], ids=["cpu", "pcie"])
@pytest.mark.parametrize("rows", [6, 70], ids=["slots", "grouped"])
def test_device_parts_through_the_kernel_equal_device_experts(rows, share):
    """The device part of a hybrid layer and its PCIe share through the routed-expert kernel
    (interpret mode here), in its slot form and its grouped form (the other pairs dropped), compute
    the all-device layer."""
    ex = random_experts(FLASH, jnp.float32, seed=6, width=256)
    ex.implementation = "pallas"
    hybrid = HybridExperts(ex, [0, 3, 4, 9], dtype=jnp.float32, pcie_share=share)
    rng = np.random.default_rng(7)
    idx, w = routing(rng, rows, 12, 3, 12)
    args = (jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32), jnp.asarray(w), jnp.asarray(idx))
    assert rel(CALL(hybrid, *args), CALL(ex, *args)) <= F32_BOUND


@pytest.mark.parametrize("via", ["ffi", "callback"])
def test_pairs_of_weight_zero_read_no_host_expert(via):
    """Rows a call does not keep route with weight 0 (`moe.route_kept_rows_only`): the host computes
    none of their pairs, so their experts are not read there, and the output is the device layer's."""
    ex = random_experts(FLASH, jnp.float32, seed=1)
    hybrid = HybridExperts(ex, list(range(12)), dtype=jnp.float32, via=via)
    idx = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], np.int32)
    w = np.array([[0.5, 0.3, 0.2], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 256)), jnp.float32)
    hybrid.host_stats(reset=True)
    got = CALL(hybrid, x, jnp.asarray(w), jnp.asarray(idx))
    assert hybrid.host_stats()["experts"] == 3
    assert rel(got, CALL(ex, x, jnp.asarray(w), jnp.asarray(idx))) <= F32_BOUND
    np.testing.assert_array_equal(np.asarray(got)[1:], 0.0)


def test_vmap_is_one_batched_call():
    ex = random_experts(FLASH, jnp.float32, seed=1)
    hybrid = HybridExperts(ex, [2, 7], dtype=jnp.float32)
    rng = np.random.default_rng(0)
    idx, w = routing(rng, 8, 12, 3, 6)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
    batched = jax.jit(jax.vmap(lambda x, w, i: hybrid(x, w, i)))
    got = batched(x.reshape(2, 4, 256), jnp.asarray(w).reshape(2, 4, 3), jnp.asarray(idx).reshape(2, 4, 3))
    assert rel(got.reshape(8, 256), CALL(ex, x, jnp.asarray(w), jnp.asarray(idx))) <= F32_BOUND


def test_errors():
    ex = random_experts(Storage(), jnp.float32, seed=2)
    with pytest.raises(ValueError, match="not bfloat16 values"):
        HybridExperts(ex, [1], dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"in \[0, 12\)"):
        HybridExperts(ex, [12], dtype=jnp.float32)
    model = Model.random(CFG, "bfloat16")
    with pytest.raises(ValueError, match="main layers 0..2"):
        with_host_experts(model, {3: [0]})


@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory):
    cfg = CFG.replace(expert_dtype="fp4", quantization=QuantConfig())
    return write_checkpoint(cfg, tmp_path_factory.mktemp("fp4"), seed=1, progress=False)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "fp4"])
def test_model_logits_equal_the_all_device_model(quantized, fp4_checkpoint):
    model = load_model(fp4_checkpoint, "float32", progress=False) if quantized \
        else bf16_valued(Model.random(CFG, "float32", seed=1))
    hybrid = with_host_experts(model, HOST)
    assert sorted(host_banks(hybrid)) == [0, 2]
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 20)
    assert rel(hybrid.logits(ids), model.logits(ids)) <= 3e-6


def test_a_given_bank_stands_for_experts_never_held(fp4_checkpoint):
    """A layer's host experts given as a bank (`banks=`) while the model holds only their shapes
    (what scripts/bench_flash.py builds: a model too large to hold whole) gives the logits of the
    model built from the arrays; a bank of other experts is refused."""
    model = load_model(fp4_checkpoint, "float32", progress=False)
    whole = with_host_experts(model, HOST)
    bank = host_banks(whole)[2]
    pure = nnx.to_pure_dict(model.params)
    shapes = jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        if is_main_expert(tuple(k.key for k in kp)) and kp[1].key == 2 else x, pure)
    params = jax.tree.map(lambda x: x, model.params)
    nnx.replace_by_pure_dict(params, shapes)
    held = Model(model.graphdef, params)
    given = with_host_experts(held, HOST, banks={2: bank})
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 12)
    np.testing.assert_array_equal(given.logits(ids), whole.logits(ids))
    with pytest.raises(ValueError, match="does not hold"):
        with_host_experts(held, {2: list(range(7))}, banks={2: bank})


@pytest.mark.slow
def test_engine_greedy_tokens_equal_and_nothing_recompiles(compile_counter):
    """Target-only and speculative (width 2) decoding of a hybrid model emit the all-device
    model's greedy tokens; after the first request nothing compiles."""
    model = bf16_valued(Model.random(DSPARK_CONFIG, "float32", seed=3))
    hybrid = with_host_experts(model, {0: [0, 3, 6], 2: [1, 2]})
    prompt = np.array([5, 9, 2, 14, 7, 7, 1, 12], np.int32)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # One bucket (one set of executables); target_engine's shapes, so the target-only run is cached.
    config = EngineConfig(max_seq_len=64, gamma=5, max_batch=2, batch_buckets=(2,))
    want = generate_to_end(Engine(model, config, prefill_chunk=16, speculative=False), prompt, greedy).token_ids
    engine = Engine(hybrid, config, prefill_chunk=16, widths=(2,), width_policy=lambda confidence: 2)
    counts = []
    for _ in range(2):
        for speculative in (False, True):
            engine.set_policy(speculative=speculative, width_policy=lambda confidence: 2)
            assert generate_to_end(engine, prompt, greedy).token_ids == want, speculative
        counts.append(compile_counter.count)
    assert counts[1] == counts[0]


def test_load_model_with_gpu_memory_places_experts_on_the_host(fp4_checkpoint, caplog):
    """load_model(gpu_memory=...) keeps the non-expert weights and the experts that fit on the
    device, the rest in host banks, logs the placement, and computes the all-device logits."""
    model = load_model(fp4_checkpoint, "float32", progress=False)
    leaves = {tuple(k.key for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(
        model.params))[0]}
    expert_bytes = sum(v.nbytes for p, v in leaves.items() if is_main_expert(p))
    total = sum(v.nbytes for v in leaves.values())
    with caplog.at_level("INFO", logger="jdspark.checkpoint.loader"):
        hybrid = load_model(fp4_checkpoint, "float32", progress=False, gpu_memory=total - expert_bytes // 2)
    banks = host_banks(hybrid)
    host = sum(len(b.expert_ids) for b in banks.values())
    assert banks and host * banks[min(banks)].weight_nbytes >= expert_bytes // 2 - 1
    assert "host share of routed uses" in caplog.text and "GPU " in caplog.text
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, 20)
    assert rel(hybrid.logits(ids), model.logits(ids)) <= 3e-6
    with pytest.raises(ValueError, match="not routed experts"):
        load_model(fp4_checkpoint, "float32", progress=False, gpu_memory=1000)
    with pytest.raises(ValueError, match="host banks hold the checkpoint's storage"):
        load_model(fp4_checkpoint, "float32", progress=False, dequantize=True, gpu_memory=total)


@pytest.mark.slow
def test_speculative_sampling_with_host_experts_is_lossless():
    """The fast tier of tests/engine/test_lossless.py (2560 requests at T = 1, each row verified at
    width 1 or 2) through a model with part of its experts in host banks, half of a call's host
    experts read by the device (the PCIe share), half by the CPU (one pair of custom calls per
    hybrid MoE layer in every executable). The exact joint is the all-device model's (their logits
    agree within 3e-6, far below what 2560 samples resolve). Mutation caught (before the PCIe share):
    the host call returning zeros (the host experts' share lost): pair p-values 4e-38, 7e-15, 2e-7."""
    from tests.engine.test_lossless import ALPHA, STAT_CONFIG, WARPS, lossless_p_values, stat_engine_for
    model = bf16_valued(Model.random(STAT_CONFIG, "float32", seed=3))
    hybrid = with_host_experts(model, {0: [0, 3, 6], 2: [1, 2]}, pcie_share=0.5)
    p_values, widths, mixed = lossless_p_values(stat_engine_for(hybrid, "xla"), model, WARPS["T=1"], 10)
    assert min(p_values) > ALPHA, p_values
    assert widths[1] > 0 and widths[2] > 0 and mixed > 0
