"""The routed-expert kernel equals its jnp reference on fresh random inputs: every storage format,
rows 1..64, experts repeated across rows; interpret mode on the CPU, compiled on the GPU (`gpu`)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jdspark.model.moe import expert_slots, routed_slots
from pallas_kernels.moe import TILES, Tiles, moe, ref_moe, supported

D, F, E, K = 256, 256, 10, 3  # small: the interpret mode runs every program in Python


def stored(fmt, rng, out_f, in_f, scale_dtype="e8m0"):
    if fmt == "fp4":
        return (rng.integers(-128, 128, (E, out_f, in_f // 2), dtype=np.int8),
                rng.integers(121, 126, (E, out_f, in_f // 32), dtype=np.uint8))
    if fmt == "fp8":
        raw = rng.integers(0, 256, (E, out_f, in_f), dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
        scale = (rng.integers(114, 118, (E, out_f // 128, in_f // 128), dtype=np.uint8) if scale_dtype == "e8m0"
                 else rng.uniform(2e-5, 1e-4, (E, out_f // 128, in_f // 128)).astype(np.float32))
        return raw.view(ml_dtypes.float8_e4m3fn), scale
    return ((rng.standard_normal((E, out_f, in_f)) * in_f ** -0.5).astype(ml_dtypes.bfloat16),)


def inputs(fmt, rows, seed, dtype, scale_dtype="e8m0", d=D, f=F):
    rng = np.random.default_rng(seed)
    pool = rng.permutation(E)[:max(K, min(E, rows))]  # few experts for many rows: repeats
    idx = np.stack([rng.choice(pool, K, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (rows, K)), jnp.float32)
    experts, dense = routed_slots(weights, jnp.asarray(idx), E)
    slot = expert_slots(jnp.asarray(idx), E)[1]
    x = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    ws = [tuple(jnp.asarray(a) for a in stored(fmt, rng, *shape, scale_dtype)) for shape in ((f, d), (f, d), (d, f))]
    return (x, experts, dense, slot, *ws)


CASES = [("fp4", "e8m0"), ("fp8", "e8m0"), ("fp8", "float32"), ("bf16", None)]


def check(fmt, scale_dtype, rows, dtype, interpret, tiles=None, d=D, f=F):
    args = inputs(fmt, rows, seed=rows, dtype=dtype, scale_dtype=scale_dtype, d=d, f=f)
    assert supported(fmt, d, f, rows, tiles)
    run = jax.jit(lambda *a: moe(*a, fmt=fmt, limit=4.0, interpret=interpret, tiles=tiles))
    got = np.asarray(run(*args))
    want = np.asarray(jax.jit(lambda *a: ref_moe(*a, fmt=fmt, limit=4.0))(*args))
    scale = np.abs(want).max()
    assert got.shape == (rows, d) and scale > 0
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: h and each expert's output round to bf16
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)


@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("rows", [1, 6, 64])
def test_kernel_equals_ref_interpret(fmt, scale_dtype, rows):
    check(fmt, scale_dtype, rows, jnp.float32 if rows == 6 else jnp.bfloat16, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("rows,dtype", [(1, jnp.bfloat16), (6, jnp.bfloat16), (17, jnp.bfloat16),
                                        (64, jnp.bfloat16), (6, jnp.float32)], ids=["1", "6", "17", "64", "6-f32"])
def test_kernel_equals_ref_compiled(fmt, scale_dtype, rows, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check(fmt, scale_dtype, rows, dtype, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("gemv_rows", [0, 8], ids=["default", "gemv"])
def test_kernel_rows_do_not_depend_on_the_call(gemv_rows):
    """Batch invariance: a row's output is bitwise the same alone and among 6 rows, with the default
    tiling (one dot form for 1..16 rows) and with the gemv form taking every row count up to 8."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    tiles = dataclasses.replace(TILES, gemv_rows=gemv_rows)
    run = jax.jit(lambda *a: moe(*a, fmt="fp4", limit=4.0, tiles=tiles))
    args = inputs("fp4", 6, seed=3, dtype=jnp.bfloat16)
    x, _, _, _, *ws = args
    full = np.asarray(run(*args))
    rng = np.random.default_rng(3)
    for r in range(6):
        idx = np.asarray(jnp.take(args[1], args[3][r]))[None]
        experts, dense = routed_slots(jnp.asarray(args[2][r][args[3][r]])[None], jnp.asarray(idx), E)
        one = np.asarray(run(x[r:r + 1], experts, dense, expert_slots(jnp.asarray(idx), E)[1], *ws))
        np.testing.assert_array_equal(one[0].view(np.uint32), full[r].view(np.uint32))


@pytest.mark.parametrize("fmt,scale_dtype", CASES[:3], ids=[f"{f}-{s}" for f, s in CASES[:3]])
def test_reference_decoding_matches_the_numpy_decoder(fmt, scale_dtype):
    """ref_moe's own decoding (kernels import nothing from jdspark) against tests/model/dequant_ref."""
    from pallas_kernels.moe import decode
    from tests.model.dequant_ref import decode_fp4, decode_fp8
    arrays = stored(fmt, np.random.default_rng(1), 256, 256, scale_dtype)
    want = decode_fp4(*arrays) if fmt == "fp4" else decode_fp8(*arrays)
    got = np.asarray(jax.jit(lambda *a: decode(fmt, a, jnp.float32))(*arrays))
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


OTHER_TILES = Tiles(out=16, step_bf16=256, num_warps=8, num_stages=3, decode="bits")
SWAP_TILES = Tiles(out=64, num_stages=3, decode="offset", swap=True)
E4M3_TILES = Tiles(out=64, num_stages=3, decode="e4m3", swap=True)


def test_e2m1_decodings_agree_on_every_code():
    from pallas_kernels.moe import E2M1_DECODERS, E2M1_UNIT, _e2m1_pair
    from tests.model.dequant_ref import E2M1
    byte = np.arange(256, dtype=np.uint8)
    b = jnp.asarray(byte.view(np.int8).astype(np.int32))  # sign-extended, as the kernels load them
    for how in E2M1_DECODERS:
        lo, hi = jax.jit(lambda b: _e2m1_pair(b, how))(b)
        for got, code in ((lo, byte & 0xF), (hi, byte >> 4)):
            want = E2M1[code] / np.float32(E2M1_UNIT.get(how, 1.0))
            if how in ("offset", "e4m3"):  # code 8 decodes to -0.0, which sums as +0.0
                want = np.where(code == 8, np.float32(-0.0), want)
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32), err_msg=how)


def test_down_tiled_apart_and_steps_fitted_to_the_model():
    """The down kernel's own tiling (`Tiles.down_out`, `down_step_fp4`) and loop steps cut to a model
    narrower than them (`Tiles.fitted`): the default's 512-input gate/up step runs as 256 at D = 256."""
    tiles = Tiles(out=16, step_fp4=512, down_out=32, down_step_fp4=128, decode="offset")
    assert tiles.fitted(256, 256).step_fp4 == 256 and tiles.fitted(1024, 64).for_down().step_fp4 == 64
    assert tiles.for_down().out == 32 and Tiles(out=16).for_down().out == 16
    check("fp4", "e8m0", 3, jnp.float32, interpret=True, tiles=tiles, d=1024, f=256)
    check("fp4", "e8m0", 3, jnp.float32, interpret=True, tiles=tiles)
    assert not supported("fp4", 1024, 256, 3, dataclasses.replace(tiles, down_out=48))


def test_other_tiling_interpret():
    check("fp4", "e8m0", 5, jnp.bfloat16, interpret=True, tiles=OTHER_TILES)


@pytest.mark.parametrize("fmt,scale_dtype", CASES[:2] + CASES[3:], ids=["fp4", "fp8", "bf16"])
def test_swapped_dot_form_interpret(fmt, scale_dtype):
    check(fmt, scale_dtype, 6, jnp.float32, interpret=True, tiles=SWAP_TILES)
    if fmt == "fp4":
        check(fmt, scale_dtype, 6, jnp.float32, interpret=True, tiles=E4M3_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_other_tiling_compiled(fmt, scale_dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check(fmt, scale_dtype, 6, jnp.bfloat16, interpret=False, tiles=OTHER_TILES)
    check(fmt, scale_dtype, 17, jnp.bfloat16, interpret=False, tiles=SWAP_TILES)
    check(fmt, scale_dtype, 17, jnp.bfloat16, interpret=False, tiles=E4M3_TILES)


GEMV_TILES = Tiles(num_stages=3, gemv_rows=8)


@pytest.mark.parametrize("fmt,scale_dtype,rows", [("fp4", "e8m0", 5), ("fp8", "float32", 2), ("bf16", None, 1)])
def test_gemv_form_interpret(fmt, scale_dtype, rows):
    check(fmt, scale_dtype, rows, jnp.bfloat16, interpret=True, tiles=GEMV_TILES)
    if fmt == "fp4":
        for how in ("offset", "e4m3"):
            tiles = dataclasses.replace(GEMV_TILES, decode=how)
            check(fmt, scale_dtype, rows, jnp.float32, interpret=True, tiles=tiles)
    check(fmt, scale_dtype, rows, jnp.float32, interpret=True, tiles=dataclasses.replace(GEMV_TILES, skip_rows=True))


def test_gemv_form_takes_the_dot_form_above_its_rows():
    check("fp4", "e8m0", 9, jnp.float32, interpret=True, tiles=Tiles(out=16, gemv_rows=8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("rows,dtype", [(1, jnp.bfloat16), (6, jnp.bfloat16), (8, jnp.float32)], ids=["1", "6", "8-f32"])
def test_gemv_form_compiled(fmt, scale_dtype, rows, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check(fmt, scale_dtype, rows, dtype, interpret=False, tiles=GEMV_TILES)
    check(fmt, scale_dtype, rows, dtype, interpret=False, tiles=Tiles(out=64, num_warps=8, gemv_rows=8))
    check(fmt, scale_dtype, rows, dtype, interpret=False, tiles=dataclasses.replace(GEMV_TILES, decode="offset",
                                                                                      skip_rows=True))
    check(fmt, scale_dtype, rows, dtype, interpret=False, tiles=dataclasses.replace(GEMV_TILES, decode="e4m3"))


@pytest.mark.gpu
def test_prmt_decoder_on_every_code_and_scale():
    """The inline-PTX E2M1 decoder (compiled only) against the table: all 256 bytes, each under
    scales from byte 0 (-> 0) through 2^-125 .. 2^125, in one small Triton kernel."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from jax.experimental import pallas as pl
    from pallas_kernels.moe import _fp4_values
    from tests.model.dequant_ref import E2M1
    scales = np.array([0, 2, 100, 120, 127, 128, 200, 252], np.uint8)
    byte = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1)).reshape(len(scales), 16, 16)
    scale = np.broadcast_to(scales[:, None, None], byte.shape[:2] + (1,))

    def kernel(b_ref, s_ref, lo_ref, hi_ref):
        lo, hi = _fp4_values(b_ref[...], s_ref[...], "prmt", jnp.float32)
        lo_ref[...], hi_ref[...] = lo, hi

    out = jax.ShapeDtypeStruct(byte.shape, jnp.float32)
    got = [np.asarray(a) for a in pl.pallas_call(kernel, out_shape=(out, out))(
        jnp.asarray(byte.view(np.int8)), jnp.asarray(np.ascontiguousarray(scale)))]
    value = np.where(scales == 0, 0.0, np.exp2(scales.astype(np.float64) - 127))[:, None, None]
    for g, code in ((got[0], byte & 0xF), (got[1], byte >> 4)):
        want = (E2M1[code] * value).astype(np.float32)
        want = np.where(code == 8, np.float32(-0.0), want)  # -0.0 (sums as +0.0)
        np.testing.assert_array_equal(g.view(np.uint32), want.view(np.uint32))



def check_missing_slots(fmt, scale_dtype, rows, dtype, interpret, tiles=None):
    """Slots whose expert is -1 read nothing and add nothing; the result equals the reference with
    those slots at routing weight 0. The kernel gets their weights left non-zero, so a kernel that
    ran a missing slot (reading any expert in its place) would add to the rows."""
    x, experts, dense, slot, *ws = inputs(fmt, rows, seed=rows + 7, dtype=dtype, scale_dtype=scale_dtype)
    used = np.unique(np.asarray(slot))
    missing = jnp.asarray(used[::2])  # every other used slot, the first among them
    experts = experts.at[missing].set(-1)
    run = jax.jit(lambda *a: moe(*a, fmt=fmt, limit=4.0, interpret=interpret, tiles=tiles))
    got = np.asarray(run(x, experts, dense, slot, *ws))
    want = np.asarray(jax.jit(lambda *a: ref_moe(*a, fmt=fmt, limit=4.0))(
        x, jnp.maximum(experts, 0), dense.at[:, missing].set(0.0), slot, *ws))
    scale = np.abs(want).max()
    assert scale > 0 and len(used) > 1
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)


@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_missing_slots_interpret(fmt, scale_dtype):
    check_missing_slots(fmt, scale_dtype, 6, jnp.float32, interpret=True)
    check_missing_slots(fmt, scale_dtype, 2, jnp.float32, interpret=True, tiles=GEMV_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("rows", [1, 6])
def test_missing_slots_compiled(fmt, scale_dtype, rows):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check_missing_slots(fmt, scale_dtype, rows, jnp.bfloat16, interpret=False)
    check_missing_slots(fmt, scale_dtype, rows, jnp.float32, interpret=False, tiles=GEMV_TILES)


# ---- the grouped form ------------------------------------------------------------------------------

def grouped_inputs(fmt, rows, seed, dtype, scale_dtype="e8m0"):
    """(x, idx, weights, w1, w3, w2) with experts repeated across rows and some pairs dropped (weight 0,
    or expert -1 in `dropped_idx`), and the slot-form arguments of the same call for `ref_moe`."""
    x, _, _, _, *ws = inputs(fmt, rows, seed, dtype, scale_dtype)
    rng = np.random.default_rng(seed + 100)
    pool = rng.permutation(E)[:max(K, min(E, rows))]
    idx = np.stack([rng.choice(pool, K, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (rows, K)).astype(np.float32)
    weights[rng.random((rows, K)) < 0.2] = 0.0
    experts, dense = routed_slots(jnp.asarray(weights), jnp.asarray(idx), E)
    slot_args = (x, experts, dense, expert_slots(jnp.asarray(idx), E)[1], *ws)
    dropped_idx = np.where(weights == 0, -1, idx)
    return (x, jnp.asarray(dropped_idx), jnp.asarray(weights), *ws), slot_args


def check_grouped(fmt, scale_dtype, rows, dtype, interpret):
    from pallas_kernels.moe import grouped_moe
    args, slot_args = grouped_inputs(fmt, rows, seed=rows, dtype=dtype, scale_dtype=scale_dtype)
    got = np.asarray(jax.jit(lambda *a: grouped_moe(*a, fmt=fmt, limit=4.0, interpret=interpret))(*args))
    want = np.asarray(jax.jit(lambda *a: ref_moe(*a, fmt=fmt, limit=4.0))(*slot_args))
    scale = np.abs(want).max()
    assert got.shape == (rows, D) and scale > 0
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)


@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("rows", [1, 40])
def test_grouped_equals_ref_interpret(fmt, scale_dtype, rows):
    check_grouped(fmt, scale_dtype, rows, jnp.float32 if rows == 1 else jnp.bfloat16, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,scale_dtype", CASES, ids=[f"{f}-{s}" for f, s in CASES])
@pytest.mark.parametrize("rows,dtype", [(6, jnp.bfloat16), (100, jnp.bfloat16), (384, jnp.bfloat16),
                                        (40, jnp.float32)], ids=["6", "100", "384", "40-f32"])
def test_grouped_equals_ref_compiled(fmt, scale_dtype, rows, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    check_grouped(fmt, scale_dtype, rows, dtype, interpret=False)


@pytest.mark.gpu
def test_grouped_rows_equal_the_slot_form_bitwise():
    """Batch invariance across the forms: a row's output from the grouped form of a 100-row call is
    bitwise the slot form's for that row alone (both run 16-row tiles of the same kernels)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from pallas_kernels.moe import grouped_moe
    (x, idx, weights, *ws), _ = grouped_inputs("fp4", 100, seed=5, dtype=jnp.bfloat16)
    full = np.asarray(jax.jit(lambda *a: grouped_moe(*a, fmt="fp4", limit=4.0))(x, idx, weights, *ws))
    slot_form = jax.jit(lambda *a: moe(*a, fmt="fp4", limit=4.0))
    for r in (0, 17, 99):
        keep = np.asarray(weights[r]) != 0
        i, w = np.asarray(idx[r])[keep][None], np.asarray(weights[r])[keep][None]
        experts, dense = routed_slots(jnp.asarray(w), jnp.asarray(i), E)
        one = np.asarray(slot_form(x[r:r + 1], experts, dense, expert_slots(jnp.asarray(i), E)[1], *ws))
        np.testing.assert_array_equal(one[0].view(np.uint32), full[r].view(np.uint32))


@pytest.mark.parametrize("rows,k,n_experts,shape", [(7, 3, 10, "random"), (40, 2, 64, "one expert"),
                                                    (34, 1, 2, "17 each"), (5, 4, 300, "distinct")])
def test_pair_blocks_place_every_kept_pair_once_within_the_bound(rows, k, n_experts, shape):
    """Each kept pair sits at one position of a block of its expert, with its row and weight; blocks
    are one expert's; dropped pairs (expert -1, weight 0) sit nowhere; the static block count holds
    even when every expert overflows a block by one pair."""
    from pallas_kernels.moe import BLOCK_ROWS, pair_blocks
    rng = np.random.default_rng(rows)
    if shape == "one expert":
        idx = np.zeros((rows, k), np.int32) + np.arange(k)
    elif shape == "17 each":
        idx = (np.arange(rows * k) % n_experts).reshape(rows, k).astype(np.int32)
    else:
        idx = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (rows, k)).astype(np.float32)
    weights[0, 0] = 0.0
    idx[-1, -1] = -1
    b = jax.jit(pair_blocks, static_argnums=2)(jnp.asarray(idx), jnp.asarray(weights), n_experts)
    experts, prow, pw, at = (np.asarray(a) for a in b)
    size = experts.size * BLOCK_ROWS
    kept = (idx >= 0) & (weights != 0)
    assert (at[~kept] == size).all()
    places = at[kept]
    assert len(set(places.tolist())) == places.size and (places < size).all()
    np.testing.assert_array_equal(experts[places // BLOCK_ROWS], idx[kept])
    np.testing.assert_array_equal(prow[places], np.nonzero(kept)[0])
    np.testing.assert_array_equal(pw[places], weights[kept])
    unused = np.setdiff1d(np.arange(size), places)
    assert (pw[unused] == 0).all()
    used_blocks = np.unique(places // BLOCK_ROWS)
    assert (experts[np.setdiff1d(np.arange(experts.size), used_blocks)] == -1).all()


def flash_stored(fmt):
    """Abstract stored projections (w1, w3, w2) of 256 experts at Flash dims, D 4096 / F 2048."""
    e, d, f = 256, 4096, 2048
    if fmt == "fp4":
        make = lambda o, i: (jax.ShapeDtypeStruct((e, o, i // 2), jnp.int8),
                             jax.ShapeDtypeStruct((e, o, i // 32), jnp.uint8))
    elif fmt == "fp8":
        make = lambda o, i: (jax.ShapeDtypeStruct((e, o, i), jnp.float8_e4m3fn),
                             jax.ShapeDtypeStruct((e, o // 128, i // 128), jnp.uint8))
    else:
        make = lambda o, i: (jax.ShapeDtypeStruct((e, o, i), jnp.bfloat16),)
    return make(f, d), make(f, d), make(d, f)


@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_both_forms_lower_to_triton_ir(fmt):
    """Lowering for CUDA (no GPU needed) builds both forms' Triton IR at Flash dims (the slot form at
    6 rows, missing slots branching around the loop; the grouped form at 384 rows, per-block
    activations): on every CI run, not only on the GPU machine."""
    from pallas_kernels.moe import grouped_moe
    w1, w3, w2 = flash_stored(fmt)
    s = jax.ShapeDtypeStruct
    slot_form = jax.jit(lambda *a: moe(*a, fmt=fmt, limit=10.0, interpret=False)).trace(
        s((6, 4096), jnp.bfloat16), s((36,), jnp.int32), s((6, 36), jnp.float32), s((6, 6), jnp.int32), w1, w3, w2)
    grouped = jax.jit(lambda *a: grouped_moe(*a, fmt=fmt, limit=10.0, interpret=False)).trace(
        s((384, 4096), jnp.bfloat16), s((384, 6), jnp.int32), s((384, 6), jnp.float32), w1, w3, w2)
    for traced in (slot_form, grouped):
        assert traced.lower(lowering_platforms=("cuda",)).as_text().count("xla.gpu.triton") == 2
