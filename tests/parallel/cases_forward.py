"""Sharded forward == unsharded forward (float32, <= 1e-5), for TP 2/4/8, EP 2/4/8 and a mixed
mesh, from a BF16 and from a quantized (FP8 linears, ds_fp4 experts) checkpoint. Run with 8 CPU
devices by test_sharded_forward.py (see devices.py); not collected by name."""

import jax
import numpy as np
import pytest

from jdspark.checkpoint.loader import load_model
from jdspark.checkpoint.synthetic import write_checkpoint
from jdspark.parallel.mesh import make_mesh
from jdspark.parallel.shard import shard_model
from tests.parallel.configs import PARALLEL_CONFIG, QUANTIZED_CONFIG

MESHES = [(2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8), (2, 4)]  # (tensor, expert)
FEATURES = (0, 1)
IDS = np.random.default_rng(0).integers(0, PARALLEL_CONFIG.vocab_size, (2, 24))


@pytest.fixture(scope="module", params=["bf16", "quantized"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(PARALLEL_CONFIG if request.param == "bf16" else QUANTIZED_CONFIG, path, seed=2)
    return path


@pytest.fixture(scope="module")
def unsharded(checkpoint):
    model = load_model(checkpoint, "float32", progress=False)
    return model, model.forward(IDS, FEATURES)


def test_eight_devices_are_present():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("tp,ep", MESHES)
def test_sharded_forward_equals_unsharded(checkpoint, unsharded, tp, ep):
    model = load_model(checkpoint, "float32", progress=False, mesh=make_mesh(tp, ep))
    out, ref = model.forward(IDS, FEATURES), unsharded[1]
    assert np.abs(np.asarray(out.logits) - np.asarray(ref.logits)).max() <= 1e-5
    assert np.abs(np.asarray(out.features) - np.asarray(ref.features)).max() <= 1e-5
    assert np.abs(np.asarray(out.streams) - np.asarray(ref.streams)).max() <= 1e-5


@pytest.mark.parametrize("tp,ep", [(8, 1), (2, 4)])
def test_each_device_holds_only_its_pieces(checkpoint, tp, ep):
    """Heads, groups, vocabulary and experts are split, not replicated: a device's piece of each
    sharded parameter (and of its block scale) is its share, on block boundaries."""
    params = load_model(checkpoint, "float32", progress=False, mesh=make_mesh(tp, ep)).params
    attn, experts = params["layers"][1]["attn"], params["layers"][1]["ffn"]["experts"]

    def piece(array):
        return array.addressable_shards[0].data.shape

    assert piece(attn["wq_b"]["weight"])[0] == attn["wq_b"]["weight"].shape[0] // tp
    assert piece(attn["wo_b"]["weight"])[1] == attn["wo_b"]["weight"].shape[1] // tp
    assert piece(params["head"]["weight"])[0] == PARALLEL_CONFIG.vocab_size // tp
    e, f = experts["w1"]["weight"].shape[:2]
    assert piece(experts["w1"]["weight"])[:2] == (e // ep, f // tp)
    if "scale" in experts["w2"]:  # ds_fp4: [E, D, F/32] scales follow their [E, D, F/2] pairs
        assert piece(experts["w2"]["scale"])[2] * tp == experts["w2"]["scale"].shape[2]
        assert piece(attn["wq_b"]["scale"])[0] * tp == attn["wq_b"]["scale"].shape[0]
    assert params["layers"][1]["attn"]["wkv"]["weight"].sharding.is_fully_replicated  # the one K=V head


def test_sharding_a_loaded_model_equals_loading_onto_the_mesh(checkpoint, unsharded):
    loaded = load_model(checkpoint, "float32", progress=False, mesh=make_mesh(2, 4))
    moved = shard_model(unsharded[0], 2, 4)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(moved.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_more_devices_than_present_is_a_clear_error():
    with pytest.raises(ValueError, match="only 8 are present"):
        make_mesh(4, 4)


@pytest.mark.parametrize("tp,ep", [(2, 4), (1, 8)])
def test_replicated_fp8_linears_keep_the_kernel(checkpoint, unsharded, tp, ep, monkeypatch):
    """Under implementation="pallas" (interpret mode here) the FP8 linears replicated on the mesh (the
    K=V head, compressors, indexer, wq_a; all of them at TP 1) run the FP8 linear kernel, those split
    over `tensor` the XLA form; the forward equals the unsharded one."""
    from jdspark.model.hyper import with_implementation
    from jdspark.model.model import Model
    from pallas_kernels import fp8_linear
    from flax import nnx

    from jdspark.model.quantized import FP8Linear
    if not any(isinstance(node, FP8Linear) for _, node in nnx.iter_graph(unsharded[0].module())):
        pytest.skip("no FP8 linears in the bf16 checkpoint")
    sharded = load_model(checkpoint, "float32", progress=False, mesh=make_mesh(tp, ep))
    model = Model(with_implementation(sharded.graphdef, sharded.params, "pallas"), sharded.params, mesh=sharded.mesh)
    weights = []
    kernel = fp8_linear.fp8_linear
    monkeypatch.setattr(fp8_linear, "fp8_linear", lambda x, w, s, **k: (weights.append(w.shape), kernel(x, w, s, **k))[1])
    out = model.forward(IDS[:, :4], FEATURES)
    ref = unsharded[0].forward(IDS[:, :4], FEATURES)
    split = any(shape[0] == 8 * 128 for shape in weights)  # wq_b (1024 rows): split over tensor at TP 2
    assert weights and split == (tp == 1)
    assert np.abs(np.asarray(out.logits) - np.asarray(ref.logits)).max() <= 1e-5
