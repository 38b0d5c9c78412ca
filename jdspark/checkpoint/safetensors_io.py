"""A small safetensors reader/writer that understands every dtype the DeepSeek-V4 files use.

The header is read directly (8-byte little-endian length + JSON) and tensors are memory-mapped, so
dtypes that libraries lack (F8_E8M0) are no obstacle: E8M0 scales come back as raw uint8 exponents.
"""

from __future__ import annotations

import json
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
    """Memory-mapped access to one .safetensors file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.table, data_start = read_header(self.path)
        size = self.path.stat().st_size
        end = max((info["data_offsets"][1] for info in self.table.values()), default=0)
        if data_start + end > size:
            raise CheckpointError(f"{self.path}: truncated: tensors need {data_start + end} bytes, file has {size}")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=data_start, shape=(size - data_start,)) \
            if size > data_start else np.zeros((0,), np.uint8)

    def keys(self):
        return self.table.keys()

    def dtype_name(self, name: str) -> str:
        return self.table[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.table[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.table[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - start != count * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} spans {end - start} bytes, "
                                  f"expected {count * dtype.itemsize} for {info['dtype']} {info['shape']}")
        return self._data[start:end].view(dtype).reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str | Path, dtype_names: dict[str, str] | None = None) -> None:
    """Write tensors to one .safetensors file. `dtype_names` overrides the stored dtype string (F8_E8M0)."""
    dtype_names = dtype_names or {}
    header, offset, arrays = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        dtype = dtype_names.get(name) or _NAMES.get(array.dtype)
        if dtype is None:
            raise CheckpointError(f"cannot store tensor {name!r} of dtype {array.dtype} in safetensors")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())


class CheckpointDir:
    """All tensors of a checkpoint directory: `model.safetensors.index.json` + shards, or one file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
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

    def describe(self, name: str) -> str:
        return f"{name!r} in {self.where[name].path.name}"
