import numpy as np
import pytest

from jdspark.checkpoint.quantize import quantize_fp4, quantize_fp8
from jdspark.experts.banks import ExpertBank, layout, random_bank, weight_bytes


def test_flash_sizes():
    # spec §7.6: one Flash expert in ds_fp4 is 3 * (2048*4096/2 + 2048*4096/32) bytes
    assert weight_bytes("fp4", 4096, 2048) == 13_369_344
    assert weight_bytes("fp8", 4096, 2048) == 3 * 4096 * 2048 + 3 * 32 * 16
    assert weight_bytes("fp8", 4096, 2048, "float32") == 3 * 4096 * 2048 + 3 * 32 * 16 * 4
    assert weight_bytes("bf16", 4096, 2048) == 3 * 4096 * 2048 * 2
    offsets, strides, total = layout("fp4", 4096, 2048, 3)
    assert sum(strides.values()) == 13_369_344 and total % 4096 == 0 and total >= 3 * 13_369_344
    assert all(v % 4096 == 0 for v in offsets.values())


@pytest.mark.parametrize("fmt,scale", [("fp4", "e8m0"), ("fp8", "e8m0"), ("fp8", "float32")])
def test_from_stacked_roundtrip(fmt, scale):
    rng = np.random.default_rng(0)
    e, d, f = 4, 256, 160 if fmt == "fp8" else 128
    w1, w3 = rng.standard_normal((2, e, f, d), np.float32)
    w2 = rng.standard_normal((e, d, f), np.float32)
    q = (lambda w: quantize_fp4(w)) if fmt == "fp4" else (lambda w: quantize_fp8(w, scale))
    (c1, s1), (c3, s3), (c2, s2) = q(w1), q(w3), q(w2)
    bank = ExpertBank.from_stacked(fmt, c1, c3, c2, s1, s3, s2, expert_ids=[1, 3, 4, 6], n_experts=8)
    assert bank.scale_dtype == scale and bank.data.ctypes.data % 4096 == 0
    assert list(bank.slot_of) == [-1, 0, -1, 1, 2, -1, 3, -1]
    for slot, eid in enumerate([1, 3, 4, 6]):
        t = bank.expert(eid)
        np.testing.assert_array_equal(t["w1"], c1[slot].view(np.uint8))
        np.testing.assert_array_equal(t["w2"], c2[slot].view(np.uint8))
        np.testing.assert_array_equal(t["s3"], s3[slot])
    # each tensor of every slot is one dense page-aligned array inside the bank (what the GPU reads in place)
    lo, hi = bank.data.ctypes.data, bank.data.ctypes.data + bank.data.nbytes
    ends = []
    for name in bank.offsets:
        v = bank.view(name)
        assert v.flags.c_contiguous and v.ctypes.data % 4096 == 0 and lo <= v.ctypes.data and v.ctypes.data + v.nbytes <= hi
        ends.append((v.ctypes.data, v.ctypes.data + v.nbytes))
    assert all(a[1] <= b[0] for a, b in zip(sorted(ends), sorted(ends)[1:]))  # no two regions overlap
    with pytest.raises(KeyError, match="not in this host bank"):
        bank.expert(0)


def test_bf16_from_stacked_and_describe():
    import ml_dtypes
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 2, 64, 96), np.float32).astype(ml_dtypes.bfloat16)
    w2 = rng.standard_normal((2, 96, 64), np.float32).astype(ml_dtypes.bfloat16)
    bank = ExpertBank.from_stacked("bf16", w[0], w[1], w2)
    np.testing.assert_array_equal(bank.view("w2").view(ml_dtypes.bfloat16), w2)
    assert "bf16" in bank.describe() and "2/2 experts" in bank.describe()


def test_errors():
    with pytest.raises(ValueError, match="divisible by 32"):
        ExpertBank.empty("fp4", 100, 64, 2)
    with pytest.raises(ValueError, match="expert format"):
        ExpertBank.empty("int4", 128, 64, 2)
    with pytest.raises(ValueError, match="distinct ids"):
        ExpertBank.empty("fp8", 128, 64, 4, expert_ids=[1, 1])
    bank = random_bank("fp4", 64, 32, 2)
    bank.view("s2")[0, 0, 0] = 0
    with pytest.raises(ValueError, match="e8m0 byte 0"):
        bank.check_scales()
