"""A small safetensors reader/writer that understands every dtype the DeepSeek-V4 files use.

The header is read directly (8-byte little-endian length + JSON) and tensors are memory-mapped, so
dtypes that libraries lack (F8_E8M0) are no obstacle: E8M0 scales come back as raw uint8 exponents.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E8M0": np.dtype(np.uint8),  # raw biased exponent: value = 2 ** (byte - 127)
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items() if k != "F8_E8M0"}


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or holds an unexpected tensor; the message names it."""


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor table without __metadata__, byte offset of the data section)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", raw)
            header = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    if len(header) < n:
        raise CheckpointError(f"{path}: truncated safetensors header ({len(header)} of {n} bytes)")
    try:
        table = json.loads(header)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    table.pop("__metadata__", None)
    return table, 8 + n


class SafetensorsFile:
    """Memory-mapped access to one .safetensors file; every tensor's dtype and byte span are
    checked when the file is opened, so a truncated file fails before anything is read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.table, data_start = read_header(self.path)
        size = self.path.stat().st_size
        for name in self.in_file_order():  # the first tensor cut off is named
            self._check(name, self.table[name], size - data_start)
        self._start = data_start
        self._map: mmap.mmap | None = None

    def _check(self, name: str, info: dict, data_size: int) -> None:
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']} "
                                  f"(known: {sorted(DTYPES)})")
        start, end = info["data_offsets"]
        nbytes = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
        if end - start != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} spans {end - start} bytes, "
                                  f"expected {nbytes} for {info['dtype']} {info['shape']}")
        if end > data_size:
            raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at data byte {end}, "
                                  f"but the file holds only {max(data_size, 0)} data bytes")

    def keys(self):
        return self.table.keys()

    def in_file_order(self) -> list[str]:
        """Tensor names by position in the file (sequential reads)."""
        return sorted(self.table, key=lambda name: self.table[name]["data_offsets"][0])

    def dtype_name(self, name: str) -> str:
        return self.table[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.table[name]["shape"])

    def nbytes(self, name: str) -> int:
        start, end = self.table[name]["data_offsets"]
        return end - start

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the mapped file (F8_E8M0 as raw uint8 exponents); the
        file is mapped on first use."""
        info = self.table[name]
        start, end = info["data_offsets"]
        if end == start:
            return np.zeros(info["shape"], DTYPES[info["dtype"]])
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(self._map, np.uint8, count=end - start, offset=self._start + start)
        return data.view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def drop_pages(self, name: str) -> None:
        """Tell the kernel this process is done with tensor `name`'s pages: they leave its resident
        set but stay in the page cache, and a later read (of a neighbour sharing an edge page, or of
        a view still held) faults the same bytes back in. So reading a checkpoint holds its shards in
        the page cache, not in the loader's memory."""
        start, end = (self._start + offset for offset in self.table[name]["data_offsets"])
        if self._map is not None and end > start and hasattr(mmap, "MADV_DONTNEED"):
            first = start // mmap.PAGESIZE * mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)


class ShardWriter:
    """Streams one .safetensors file: the header first (from the declared tensors), then each tensor
    in declaration order, so a shard never has to be held in memory as a whole."""

    def __init__(self, path: str | Path, tensors: list[tuple[str, str, tuple[int, ...]]]):
        """tensors: (name, safetensors dtype string, shape) in the order they will be written."""
        self.path = Path(path)
        self.pending = list(tensors)
        header, offset = {}, 0
        for name, dtype, shape in tensors:
            if dtype not in DTYPES:
                raise CheckpointError(f"cannot store tensor {name!r} as {dtype} (known: {sorted(DTYPES)})")
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(blob)))
        self.file.write(blob)

    def write(self, name: str, array: np.ndarray) -> None:
        if not self.pending or self.pending[0][0] != name:
            raise CheckpointError(f"{self.path}: tensor {name!r} written out of order "
                                  f"(next declared: {self.pending[0][0] if self.pending else None!r})")
        _, dtype, shape = self.pending.pop(0)
        if array.dtype != DTYPES[dtype] or tuple(array.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} is {array.dtype} {list(array.shape)}, "
                                  f"declared {dtype} {list(shape)}")
        self.file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)

    def close(self) -> None:
        self.file.close()
        if self.pending:
            raise CheckpointError(f"{self.path}: closed with {len(self.pending)} declared tensor(s) unwritten, "
                                  f"first {self.pending[0][0]!r}")

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.file.close()


def save_file(tensors: dict[str, np.ndarray], path: str | Path, dtype_names: dict[str, str] | None = None) -> None:
    """Write tensors to one .safetensors file. `dtype_names` overrides the stored dtype string (F8_E8M0)."""
    dtype_names = dtype_names or {}
    declared = []
    for name, array in tensors.items():
        dtype = dtype_names.get(name) or _NAMES.get(np.dtype(array.dtype))
        if dtype is None:
            raise CheckpointError(f"cannot store tensor {name!r} of dtype {array.dtype} in safetensors")
        declared.append((name, dtype, tuple(array.shape)))
    with ShardWriter(path, declared) as writer:
        for name, array in tensors.items():
            writer.write(name, np.asarray(array))


def plan_shards(sizes: list[int], shard_bytes: int) -> list[list[int]]:
    """Consecutive groups of tensor indices, each up to about `shard_bytes` (a tensor larger than
    that gets a shard of its own)."""
    shards, size = [[]], 0
    for i, nbytes in enumerate(sizes):
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def shard_name(i: int, count: int) -> str:
    """The official file name of shard i (0-based) of count."""
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def write_index(path: Path, weight_map: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json: which shard holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


class CheckpointDir:
    """All tensors of a checkpoint directory: `model.safetensors.index.json` + shards, or one file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (no valid weight_map): {e}") from None
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.path}: no model.safetensors.index.json and no *.safetensors files")
            weight_map = None
        self.files = {name: SafetensorsFile(self.path / name) for name in shards}
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for key in f.keys():
                if key in self.where:
                    raise CheckpointError(f"{self.path}: tensor {key!r} is in both {self.where[key].path.name} "
                                          f"and {f.path.name}")
                self.where[key] = f
        if weight_map is not None:
            missing = [k for k, shard in weight_map.items() if k not in self.files[shard].table]
            if missing:
                raise CheckpointError(f"{index}: tensor {missing[0]!r} is listed in {weight_map[missing[0]]} "
                                      f"but that file does not hold it ({len(missing)} such tensors)")

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> np.ndarray:
        return self.where[name].get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(name)

    def dtype_name(self, name: str) -> str:
        return self.where[name].dtype_name(name)

    def describe(self, name: str) -> str:
        return f"{name!r} in {self.where[name].path.name}"
