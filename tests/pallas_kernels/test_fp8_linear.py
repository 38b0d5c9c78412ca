"""The FP8 linear kernel equals its jnp reference on fresh random inputs (e8m0 and float32 block
scales, rows 1..64, split K): interpret mode on the CPU, compiled on the GPU (`gpu`); its rows do
not depend on the call (bits, GPU)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8_linear import Tiles, fp8_linear, ref_fp8_linear, supported


def weights(rng, n, k, scale_dtype):
    raw = rng.integers(0, 256, (n, k), dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
    scale = (rng.integers(114, 120, (n // 128, k // 128), dtype=np.uint8) if scale_dtype == "e8m0"
             else rng.uniform(2e-5, 1e-4, (n // 128, k // 128)).astype(np.float32))
    return jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn)), jnp.asarray(scale)


def check(rows, dtype, scale_dtype, interpret, n=256, k=512, tiles=None, seed=None):
    rng = np.random.default_rng(rows if seed is None else seed)
    w, s = weights(rng, n, k, scale_dtype)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    assert supported(n, k, rows, tiles)
    got = np.asarray(jax.jit(lambda *a: fp8_linear(*a, interpret=interpret, tiles=tiles))(x, w, s))
    want = np.asarray(jax.jit(ref_fp8_linear)(x, w, s))
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


CASES = [("e8m0", jnp.bfloat16), ("float32", jnp.bfloat16), ("e8m0", jnp.float32)]


@pytest.mark.parametrize("scale_dtype,dtype", CASES, ids=["e8m0-bf16", "f32scale-bf16", "e8m0-f32"])
@pytest.mark.parametrize("rows", [1, 6, 64])
def test_kernel_equals_ref_interpret(scale_dtype, dtype, rows):
    check(rows, dtype, scale_dtype, interpret=True)


@pytest.mark.parametrize("tiles", [Tiles(out=32, split=4), Tiles(out=128, split=1), Tiles(swap=False)],
                         ids=["split4", "nosplit", "rows-first"])
def test_other_tilings_interpret(tiles):
    check(3, jnp.bfloat16, "e8m0", interpret=True, tiles=tiles)


def test_splits_fill_the_gpu_and_divide_k():
    assert Tiles(out=64).splits(32768, 1024) == 1  # 512 output tiles already
    assert Tiles(out=64).splits(1024, 4096) == 16  # 16 output tiles x 16 chunks of 2 blocks
    assert Tiles(out=64).splits(512, 384) == 1  # 3 blocks: no power of two above 1 divides them
    assert Tiles(out=64, split=2).splits(512, 4096) == 2


def test_unsupported_sizes_are_refused():
    assert not supported(100, 512, 1) and not supported(256, 500, 1) and not supported(256, 512, 65)
    x = jnp.zeros((2, 500), jnp.bfloat16)
    with pytest.raises(ValueError, match="K=500"):
        fp8_linear(x, jnp.zeros((256, 500), jnp.float8_e4m3fn), jnp.zeros((2, 4), jnp.uint8), interpret=True)


def _gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype,dtype", CASES, ids=["e8m0-bf16", "f32scale-bf16", "e8m0-f32"])
@pytest.mark.parametrize("rows", [1, 6, 17, 64])
def test_kernel_equals_ref_compiled(scale_dtype, dtype, rows):
    _gpu()
    check(rows, dtype, scale_dtype, interpret=False, n=1024, k=4096)


@pytest.mark.gpu
def test_rows_do_not_depend_on_the_call():
    """Batch invariance: each row of a 1..6-row call is bitwise the same as that row alone."""
    _gpu()
    rng = np.random.default_rng(7)
    w, s = weights(rng, 1024, 4096, "e8m0")
    x = jnp.asarray(rng.standard_normal((6, 4096)), jnp.bfloat16)
    run = jax.jit(fp8_linear)
    alone = [np.asarray(run(x[r:r + 1], w, s))[0] for r in range(6)]
    for rows in range(1, 7):
        got = np.asarray(run(x[:rows], w, s))
        for r in range(rows):
            np.testing.assert_array_equal(got[r].view(np.uint32), alone[r].view(np.uint32))


def test_grouped_linear_interpret():
    """x [R, G, K]: output rows of group g read x[:, g] (the attention's wo_a)."""
    rng = np.random.default_rng(11)
    w, s = weights(rng, 512, 256, "e8m0")
    x = jnp.asarray(rng.standard_normal((3, 2, 256)), jnp.bfloat16)
    got = np.asarray(fp8_linear(x, w, s, interpret=True))
    want = np.concatenate([np.asarray(ref_fp8_linear(x[:, g], w[g * 256:(g + 1) * 256], s[2 * g:2 * g + 2]))
                           for g in range(2)], axis=1)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    np.testing.assert_allclose(np.asarray(ref_fp8_linear(x, w, s)), want, atol=1e-6 * np.abs(want).max(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 6])
def test_grouped_linear_compiled(rows):
    """wo_a at Flash dims: 8 groups of 1024 outputs over 4096 inputs each."""
    _gpu()
    rng = np.random.default_rng(rows)
    w, s = weights(rng, 8192, 4096, "e8m0")
    x = jnp.asarray(rng.standard_normal((rows, 8, 4096)), jnp.bfloat16)
    got = np.asarray(jax.jit(fp8_linear)(x, w, s))
    want = np.asarray(jax.jit(ref_fp8_linear)(x, w, s))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
