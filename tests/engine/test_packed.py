"""Packed parameters come back out of an executable exactly as they went in, in a few buffers."""

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.engine.packed import PackedParams, kernel_scales, key_names
from jdspark.model.moe import KERNEL_MIN_WEIGHTS
from jdspark.model.model import Model
from tests.conftest import DSPARK_CONFIG


def test_unpack_inside_jit_returns_every_parameter_exactly():
    params = Model.random(DSPARK_CONFIG, "bfloat16", seed=3).params
    leaves = jax.tree.leaves(params)
    big = max(leaves, key=lambda x: x.nbytes)
    packed = PackedParams(params, small_bytes=big.nbytes - 1)  # the largest tensor stays its own buffer
    dtypes = {x.dtype for x in leaves if x is not big}
    assert len(packed.arrays) == len(dtypes) + sum(x.nbytes == big.nbytes for x in leaves) < len(leaves)
    assert any(a is big for a in packed.arrays)  # not copied
    unpacked = jax.jit(lambda arrays: jax.tree.leaves(packed.unpack(arrays)))(packed.arrays)
    assert jax.tree.structure(packed.unpack(packed.arrays)) == jax.tree.structure(params)
    for got, want in zip(unpacked, leaves):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_tensors_kept_apart_stay_arguments_of_their_own():
    params = Model.random(DSPARK_CONFIG, "bfloat16", seed=3).params
    names = [key_names(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    norms = [n for n in names if n[-2:] == ("attn_norm", "weight")]
    assert norms and all(isinstance(part, (str, int)) for part in norms[0])
    packed = PackedParams(params, apart=lambda path: path[-2:] == ("attn_norm", "weight"))
    together = PackedParams(params)
    assert len(packed.arrays) == len(together.arrays) + len(norms)
    leaves = dict(zip(names, jax.tree.leaves(params)))
    assert all(any(a is leaves[n] for a in packed.arrays) for n in norms)  # passed as they are, not copied
    for got, want in zip(jax.tree.leaves(packed.unpack(packed.arrays)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_views_of_host_memory_are_never_packed():
    """A parameter under a `host_mapped` module (a view of pinned host memory the GPU reads in place,
    `jdspark.experts.mapped`) stays an argument of its own, however small: packing would copy it."""
    small = jnp.ones((4, 8), jnp.bfloat16)
    params = {"layers": {"0": {"ffn": {"experts": {"host_mapped": {"w1": {"weight": small}}, "bias": small + 1}}}}}
    packed = PackedParams(params)
    assert any(a is small for a in packed.arrays) and len(packed.arrays) == 2
    np.testing.assert_array_equal(packed.unpack(packed.arrays)["layers"]["0"]["ffn"]["experts"]["bias"], small + 1)


def test_the_scales_the_fp8_kernel_reads_stay_arguments_of_their_own(monkeypatch):
    """A Pallas call reads its operands whole: a scale sliced out of a packed buffer would be copied before
    every call. Exactly the linears `FP8Linear` reads through the kernel keep their scales apart: under "auto"
    on a GPU those of at least KERNEL_MIN_WEIGHTS, under "pallas" every one, under "xla" none."""
    big = jnp.zeros((KERNEL_MIN_WEIGHTS // 1024, 1024), jnp.float8_e4m3fn)
    small = jnp.zeros((256, 256), jnp.float8_e4m3fn)
    scale_big, scale_small = jnp.ones((big.shape[0] // 128, 8), jnp.uint8), jnp.ones((2, 2), jnp.uint8) + 1
    params = {"layers": {"0": {"attn": {"wq_b": {"weight": big, "scale": scale_big},
                                        "wkv": {"weight": small, "scale": scale_small}}}}}
    big_scale, small_scale = ("layers", "0", "attn", "wq_b", "scale"), ("layers", "0", "attn", "wkv", "scale")
    every = kernel_scales(params, "pallas")
    assert every(big_scale) and every(small_scale) and not every(("layers", "0", "attn", "wq_b", "weight"))
    xla = kernel_scales(params, "xla")
    assert not xla(big_scale) and not xla(small_scale)
    assert not kernel_scales(params, "auto")(big_scale)  # the CPU: "auto" is the XLA form
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # "auto" as it resolves on a GPU
    apart = kernel_scales(params, "auto")
    assert apart(big_scale) and not apart(small_scale)
    packed = PackedParams(params, apart=apart)
    assert any(a is scale_big for a in packed.arrays) and not any(a is scale_small for a in packed.arrays)
    unpacked = packed.unpack(packed.arrays)["layers"]["0"]["attn"]
    np.testing.assert_array_equal(unpacked["wkv"]["scale"], scale_small)
    np.testing.assert_array_equal(unpacked["wq_b"]["scale"], scale_big)
