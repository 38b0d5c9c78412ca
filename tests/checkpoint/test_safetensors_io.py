"""The own safetensors reader/writer: every DSV4 dtype, streamed writes, truncation named per tensor,
pages dropped from the resident set once read."""

import sys

import ml_dtypes
import numpy as np
import pytest

from jdspark.checkpoint.safetensors_io import (
    CheckpointError, SafetensorsFile, ShardWriter, plan_shards, save_file, shard_name)

TENSORS = {
    "bf16": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
    "f32": np.ones(3, np.float32),
    "e4m3": np.array([[0.5, -448.0]], np.float32).astype(ml_dtypes.float8_e4m3fn),
    "e8m0": np.array([127, 130], np.uint8),
    "i8": np.array([-128, 127], np.int8),
    "i64": np.array([[1, 2]], np.int64),
}


def test_every_checkpoint_dtype_round_trips(tmp_path):
    save_file(TENSORS, tmp_path / "a.safetensors", dtype_names={"e8m0": "F8_E8M0"})
    f = SafetensorsFile(tmp_path / "a.safetensors")
    assert [f.dtype_name(n) for n in f.in_file_order()] == ["BF16", "F32", "F8_E4M3", "F8_E8M0", "I8", "I64"]
    for name, value in TENSORS.items():
        got = f.get(name)
        assert got.dtype == value.dtype and got.shape == value.shape and f.nbytes(name) == value.nbytes
        np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8))


def test_the_safetensors_library_reads_our_files(tmp_path):
    from safetensors.numpy import load_file
    save_file({k: v for k, v in TENSORS.items() if k in ("f32", "i8", "i64")}, tmp_path / "b.safetensors")
    loaded = load_file(tmp_path / "b.safetensors")
    np.testing.assert_array_equal(loaded["i64"], TENSORS["i64"])


def test_streamed_writes_follow_the_declaration(tmp_path):
    with pytest.raises(CheckpointError, match="'b' written out of order"):
        with ShardWriter(tmp_path / "c.safetensors", [("a", "F32", (2,)), ("b", "I8", (1,))]) as w:
            w.write("b", np.zeros(1, np.int8))
    with pytest.raises(CheckpointError, match=r"'a' is int8 \[2\], declared F32 \[2\]"):
        with ShardWriter(tmp_path / "c.safetensors", [("a", "F32", (2,))]) as w:
            w.write("a", np.zeros(2, np.int8))
    with pytest.raises(CheckpointError, match="1 declared tensor\\(s\\) unwritten, first 'b'"):
        with ShardWriter(tmp_path / "c.safetensors", [("a", "F32", (2,)), ("b", "I8", (1,))]) as w:
            w.write("a", np.zeros(2, np.float32))


def test_truncated_file_names_the_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(TENSORS, path, dtype_names={"e8m0": "F8_E8M0"})
    path.write_bytes(path.read_bytes()[:-20])  # cuts e8m0 (data bytes 26..28), i8 and i64
    with pytest.raises(CheckpointError, match=r"t.safetensors: truncated: tensor 'e8m0' ends at data byte 28, "
                                              r"but the file holds only 26 data bytes"):
        SafetensorsFile(path)
    path.write_bytes(path.read_bytes()[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        SafetensorsFile(path)


def test_plan_shards_keeps_order_and_the_size_bound():
    sizes = [4, 4, 4, 10, 1, 1]
    shards = plan_shards(sizes, 8)
    assert shards == [[0, 1], [2], [3], [4, 5]]  # the 10-byte tensor gets a shard of its own
    assert [i for shard in shards for i in shard] == list(range(len(sizes)))
    assert plan_shards(sizes, 100) == [list(range(6))]
    assert shard_name(0, 2) == "model-00001-of-00002.safetensors"


def _mapped_resident_bytes(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_dropped_pages_leave_the_resident_set_and_read_back_the_same(tmp_path):
    path = tmp_path / "big.safetensors"
    value = np.random.default_rng(0).integers(0, 255, (4, 1 << 20), dtype=np.uint8)
    save_file({"a": value[:2], "b": value[2:]}, path)
    f = SafetensorsFile(path)
    assert int(f.get("a").sum()) + int(f.get("b").sum()) == int(value.sum())  # both read: resident
    assert _mapped_resident_bytes(path) >= 4 << 20
    f.drop_pages("a")
    assert _mapped_resident_bytes(path) <= (2 << 20) + 8192  # b and at most a shared edge page
    np.testing.assert_array_equal(f.get("a"), value[:2])
