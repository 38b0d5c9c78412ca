import pathlib

import ml_dtypes
import numpy as np
import pytest

from jdspark.experts.banks import random_bank
from jdspark.experts.cpu_gemv import Plan, host_callback, moe_forward
from tests.experts.reference import reference_forward

FORMATS = [("fp4", "e8m0"), ("fp8", "e8m0"), ("fp8", "float32"), ("bf16", "e8m0")]
try:
    import numba  # noqa: F401
    BACKENDS = [dict(backend="cpp"), dict(backend="cpp", simd=False), dict(backend="numba")]
except ImportError:  # numba is the optional comparison backend
    BACKENDS = [dict(backend="cpp"), dict(backend="cpp", simd=False)]


def _bank(fmt, scale, seed=0, held=None):
    d, f = 256, (160 if fmt != "fp4" else 128)  # 160: an FP8 block of 128 plus a partial one
    return random_bank(fmt, d, f, 12, scale_dtype=scale, seed=seed, expert_ids=held)


def _inputs(rows, k=4, n_experts=12, seed=0, bf16=False):
    rng = np.random.default_rng(seed)
    # few experts for many rows: experts repeat across rows, as in a verify block
    pool = rng.choice(n_experts, 6, replace=False)
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(rows)])
    weights = rng.uniform(0.05, 1.0, (rows, k)).astype(np.float32)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    if bf16:
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x, ids, weights


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("fmt,scale", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6])
def test_float32_matches_reference(fmt, scale, rows):
    bank = _bank(fmt, scale)
    x, ids, w = _inputs(rows, seed=rows)
    ref = reference_forward(bank, x, ids, w, limit=6.0)
    for kw in BACKENDS:
        if kw["backend"] == "numba" and rows not in (1, 6):
            continue  # numba is the slow comparison backend: two row counts suffice
        y = moe_forward(bank, x, ids, w, limit=6.0, **kw)
        assert y.dtype == np.float32 and y.shape == x.shape
        assert _rel(y, ref) <= 1e-5, (kw, _rel(y, ref))


@pytest.mark.parametrize("fmt,scale", FORMATS)
def test_host_subset_and_threads(fmt, scale):
    """A hybrid layer's host bank holds some experts: pairs whose expert is elsewhere add nothing. The
    bits do not depend on the threads (each output is one work item's, however they are scheduled)."""
    held = [0, 2, 3, 7, 8, 11]
    bank = _bank(fmt, scale, seed=3, held=held)
    x, ids, w = _inputs(5, k=6, seed=7)
    ref = reference_forward(bank, x, ids, w, limit=0.0)
    first = moe_forward(bank, x, ids, w, limit=0.0, threads=1)
    assert _rel(first, ref) <= 1e-5
    for threads in (2, 3, 4, 2):
        np.testing.assert_array_equal(moe_forward(bank, x, ids, w, limit=0.0, threads=threads), first)
    none = moe_forward(bank, x, np.full_like(ids, 1), w)
    assert not none.any()


@pytest.mark.parametrize("fmt,scale", FORMATS)
def test_bfloat16_rounding_points(fmt, scale):
    """In a bf16 model the three rounding points (and, for float32 FP8 scales, the weights) are bf16:
    the result agrees with the reference within a bf16 rounding or two, mostly exactly."""
    bank = _bank(fmt, scale, seed=5)
    x, ids, w = _inputs(3, seed=11, bf16=True)
    ref = reference_forward(bank, x, ids, w, limit=6.0, dtype="bfloat16")
    for kw in BACKENDS[:2]:
        y = moe_forward(bank, x, ids, w, limit=6.0, dtype="bfloat16", **kw)
        assert _rel(y, ref) <= 2 ** -6
        assert np.mean(y == ref) > 0.9


def test_plan_reads_each_expert_once():
    bank = _bank("fp4", "e8m0", held=[1, 2, 5, 9])
    ids = np.array([[1, 5, 3], [5, 2, 1], [0, 5, 9]])
    plan = Plan(bank, ids, np.ones((3, 3), np.float32))
    assert list(bank.expert_ids[plan.uniq_slot]) == [1, 2, 5, 9]
    assert list(np.diff(plan.pstart)) == [2, 1, 3, 1]
    assert list(plan.covered) == [1, 1, 0, 1, 1, 1, 0, 1, 1]


def test_errors():
    bank = _bank("fp8", "e8m0")
    x, ids, w = _inputs(2)
    with pytest.raises(ValueError, match=r"expected \[R, 256\]"):
        moe_forward(bank, x[:, :100], ids, w)
    with pytest.raises(ValueError, match="must lie in"):
        moe_forward(bank, x, ids + 100, w)
    with pytest.raises(ValueError, match="dtype="):
        moe_forward(bank, x, ids, w, dtype="float16")


def test_pure_callback():
    """The signature one `jax.pure_callback` per MoE layer calls: (x, ids, weights) -> [R, D] fp32."""
    import jax
    import jax.numpy as jnp

    bank = _bank("fp4", "e8m0")
    x, ids, w = _inputs(4, seed=2)
    call = host_callback(bank, limit=6.0)

    @jax.jit
    def layer(x, ids, w):
        return jax.pure_callback(call, jax.ShapeDtypeStruct(x.shape, jnp.float32), x, ids, w)

    y = np.asarray(layer(jnp.asarray(x), jnp.asarray(ids, jnp.int32), jnp.asarray(w)))
    assert _rel(y, reference_forward(bank, x, ids, w, limit=6.0)) <= 1e-5


@pytest.mark.parametrize("setting, groups", [("0", 0), ("1", 1), ("64", 64), ("-1", None), ("65", None), ("x", None)])
def test_prefetch_setting_is_a_count_of_row_groups(monkeypatch, setting, groups):
    """JDSPARK_CPU_PREFETCH: 0..64 groups of rows; anything else is refused by name before the kernel
    could form addresses before its buffer or overflow an offset."""
    from jdspark.experts import cpu_gemv
    monkeypatch.setenv("JDSPARK_CPU_PREFETCH", setting)
    if groups is None:
        with pytest.raises(ValueError, match=f"JDSPARK_CPU_PREFETCH='{setting}'"):
            cpu_gemv._prefetch_groups()
    else:
        assert cpu_gemv._prefetch_groups() == groups


def test_prefetch_hint_setting_names_a_cache_level(monkeypatch):
    """JDSPARK_CPU_FP4_PREFETCH_HINT: t0 / t1 (default) / t2, refused by name otherwise; a build
    setting, so each keys its own library."""
    from jdspark.experts import cpu_gemv
    monkeypatch.delenv("JDSPARK_CPU_FP4_PREFETCH_HINT", raising=False)
    assert cpu_gemv.fp4_prefetch_hint() == "t1"
    monkeypatch.setenv("JDSPARK_CPU_FP4_PREFETCH_HINT", "l1")
    with pytest.raises(ValueError, match="JDSPARK_CPU_FP4_PREFETCH_HINT='l1': must be one of t0, t1, t2"):
        cpu_gemv.fp4_prefetch_hint()


@pytest.mark.parametrize("dim, inter", [(288, 96), (160, 224)])
def test_fp4_rows_not_a_multiple_of_128(dim, inter):
    """The AVX-512 ds_fp4 decoder reads 128 elements a step and the blocks after the last full group
    one by one: rows of 288 / 160 (groups and a tail) and 96 / 224 elements (a tail alone, groups and
    a tail) match the reference, as does the scalar path."""
    bank = random_bank("fp4", dim, inter, 8, scale_dtype="e8m0", seed=9)
    rng = np.random.default_rng(2)
    ids = np.stack([rng.choice(8, 4, replace=False) for _ in range(3)])
    w = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    x = rng.standard_normal((3, dim)).astype(np.float32)
    ref = reference_forward(bank, x, ids, w, limit=6.0)
    for kw in BACKENDS[:2]:
        assert _rel(moe_forward(bank, x, ids, w, limit=6.0, **kw), ref) <= 1e-5, kw


@pytest.mark.parametrize("dim, inter", [(256, 128), (192, 320)])
def test_fp4_bf16_inputs_every_row_count(dim, inter):
    """A bf16 model's ds_fp4 experts multiply bf16 inputs by vdpbf16ps where the CPU has it (64
    elements a half step: 192 / 320 end on a lone half): rows 1..10 (past a pass of 8), experts
    repeated across rows, equal the reference within the bf16 rounding points, mostly exactly, and
    the scalar path within the same bound."""
    from jdspark.experts.cpu_gemv import kernel
    bank = random_bank("fp4", dim, inter, 8, scale_dtype="e8m0", seed=dim)
    rng = np.random.default_rng(inter)
    for rows in range(1, 11):
        ids = np.stack([rng.choice(8, 4, replace=False) for _ in range(rows)])
        w = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
        x = rng.standard_normal((rows, dim)).astype(ml_dtypes.bfloat16).astype(np.float32)
        ref = reference_forward(bank, x, ids, w, limit=6.0, dtype="bfloat16")
        for kw in BACKENDS[:2]:
            y = moe_forward(bank, x, ids, w, limit=6.0, dtype="bfloat16", **kw)
            assert _rel(y, ref) <= 2 ** -6, (rows, kw)
            assert np.mean(y == ref) > 0.9, (rows, kw)
    cpu_flags = pathlib.Path("/proc/cpuinfo").read_text().split() if pathlib.Path("/proc/cpuinfo").exists() else []
    if "avx512_bf16" in cpu_flags:  # built with -march=native: the vdpbf16ps path is the one tested above
        assert kernel().jds_has_bf16dot() == 1


def test_bfloat16_model_rounds_its_inputs():
    """x of a bf16 model is bf16 values: inputs that are not are rounded first, by every path."""
    bank = _bank("fp4", "e8m0", seed=4)
    x, ids, w = _inputs(2, seed=5)
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    for kw in BACKENDS:
        y = moe_forward(bank, x, ids, w, limit=6.0, dtype="bfloat16", **kw)
        assert np.array_equal(y, moe_forward(bank, rounded, ids, w, limit=6.0, dtype="bfloat16", **kw)), kw
