"""The checkpoint's side of a model layout (spec §7.2-7.5): which tensors exist, their stored shapes
and dtypes, and which `Storage` a checkpoint uses, detected from its tensor dtypes.

The same `disk_specs` drives reading (what to expect) and writing (`synthetic`), so the two cannot
drift apart.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jdspark.checkpoint.names import Piece, path_to_official
from jdspark.checkpoint.safetensors_io import CheckpointDir, CheckpointError
from jdspark.config import DSV4Config, QuantConfig
from jdspark.model.dequant import FP4_BLOCK, FP8_BLOCK
from jdspark.model.quantized import Storage, is_expert, is_fp8_linear, is_weight_scale

FLOAT = frozenset({"F32", "BF16", "F16"})
INT = frozenset({"I64", "I32"})
_SCALE = {"e8m0": "F8_E8M0", "float32": "F32"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One stored tensor (per expert for a stacked routed-expert parameter)."""

    path: tuple  # parameter path of the stored name (`official_to_path`)
    shape: tuple[int, ...]
    dtype: str  # official storage dtype
    leaf: tuple  # the in-memory parameter it fills
    experts: int | None = None  # E for a stacked routed-expert parameter
    fmt: str | None = None  # "fp8" / "fp4" for a quantized weight and its scale
    dequant: bool = False  # the in-memory parameter is float: dequantized at load

    def name(self, expert: int | None = None) -> str:
        return path_to_official(self.path, expert)

    def accepts(self, stored: str) -> bool:
        """Float dtypes are interchangeable (cast at load), so are integer ones; quantized ones are exact."""
        for family in (FLOAT, INT):
            if self.dtype in family:
                return stored in family
        return stored == self.dtype

    def dtypes(self) -> str:
        """The accepted stored dtype(s), for messages."""
        for family in (FLOAT, INT):
            if self.dtype in family:
                return "/".join(sorted(family))
        return self.dtype

    def describe(self) -> str:
        return f"{self.dtypes()} {list(self.shape)}"


def disk_specs(leaves: dict[tuple, jnp.ndarray], storage: Storage) -> dict[tuple, TensorSpec]:
    """Stored tensors of a model whose in-memory parameters are `leaves` (path -> abstract array)
    in a checkpoint of format `storage`, by stored path."""
    specs = {}
    for path, leaf in leaves.items():
        experts = leaf.shape[0] if is_expert(path) else None
        shape = tuple(leaf.shape[1:] if experts else leaf.shape)
        dtype = jnp.dtype(leaf.dtype)
        if is_weight_scale(path):  # kept as stored
            fmt = "fp4" if is_expert(path) and storage.experts == "fp4" else "fp8"
            specs[path] = TensorSpec(path, shape, "F8_E8M0" if dtype == jnp.uint8 else "F32", path, experts, fmt)
        elif dtype in (jnp.float8_e4m3fn, jnp.int8):  # kept as stored
            fmt = "fp8" if dtype == jnp.float8_e4m3fn else "fp4"
            specs[path] = TensorSpec(path, shape, "F8_E4M3" if fmt == "fp8" else "I8", path, experts, fmt)
        elif jnp.issubdtype(dtype, jnp.floating) and storage.format_of(path):
            specs.update(_dequantized_at_load(path, shape, experts, storage))
        elif jnp.issubdtype(dtype, jnp.integer):
            specs[path] = TensorSpec(path, shape, "I64", path, experts)
        else:
            specs[path] = TensorSpec(path, shape, "F32" if dtype == jnp.float32 else "BF16", path, experts)
    return specs


def _dequantized_at_load(path: tuple, shape: tuple, experts: int | None, storage: Storage) -> dict:
    """Weight and scale specs of a float parameter that the checkpoint stores quantized."""
    n, k = shape
    scale_path = (*path[:-1], "scale")
    fmt = storage.format_of(path)
    if fmt == "fp4":
        weight = TensorSpec(path, (n, k // 2), "I8", path, experts, fmt, True)
        scale = TensorSpec(scale_path, (n, k // FP4_BLOCK), "F8_E8M0", path, experts, fmt, True)
    else:
        weight = TensorSpec(path, shape, "F8_E4M3", path, experts, fmt, True)
        scale = TensorSpec(scale_path, (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)),
                           _SCALE[storage.scale_dtype], path, experts, fmt, True)
    return {path: weight, scale_path: scale}


def detect_storage(ckpt: CheckpointDir, pieces: dict[str, list[Piece]], config: DSV4Config) -> Storage:
    """The checkpoint's format from its tensor dtypes (spec §7.5), checked against what the config
    states: FP8 linears or float; routed experts I8 (ds_fp4), F8_E4M3 or float; FP8 scales F8_E8M0
    or F32 (-Base). Mixed formats and contradictions raise a `CheckpointError` naming a tensor."""
    seen: dict[str, dict[str, str]] = {"linear": {}, "expert": {}, "linear scale": {}, "expert scale": {}}
    for name, parts in pieces.items():
        path = parts[0].path if parts else ()
        kind = "expert" if is_expert(path) else "linear"
        stored = ckpt.dtype_name(name)
        if is_weight_scale(path):
            seen[f"{kind} scale"].setdefault(stored, name)
        elif is_expert(path) or is_fp8_linear(path):  # any float dtype counts as one format here
            seen[kind].setdefault("float" if stored in FLOAT else stored, name)
    linears = _classify(ckpt, seen["linear"], "FP8 linear weights", {"F8_E4M3": "fp8", "float": None})
    experts = _classify(ckpt, seen["expert"], "routed expert weights", {"I8": "fp4", "F8_E4M3": "fp8", "float": None})
    scales = seen["linear scale"] if linears else seen["expert scale"] if experts == "fp8" else {}
    scale_dtype = _classify(ckpt, scales, "FP8 block scales", {"F8_E8M0": "e8m0", "F32": "float32"}) or "e8m0"
    if config.expert_dtype is not None and experts != config.expert_dtype and seen["expert"]:
        name = next(iter(seen["expert"].values()))
        expected = "I8" if config.expert_dtype == "fp4" else "F8_E4M3"
        raise CheckpointError(f"config/weights mismatch: the config says expert_dtype={config.expert_dtype!r}, "
                              f"but routed expert tensor {ckpt.describe(name)} is stored as "
                              f"{ckpt.dtype_name(name)} (expected {expected})")
    if config.quantization is not None and linears is None and seen["linear"]:
        name = next(iter(seen["linear"].values()))
        raise CheckpointError(f"config/weights mismatch: the config declares FP8 quantization, but "
                              f"{ckpt.describe(name)} is stored as {ckpt.dtype_name(name)} (expected F8_E4M3)")
    if linears and experts is None and seen["expert"]:
        raise CheckpointError(f"{ckpt.path}: FP8 linears with float routed experts is not a DeepSeek-V4 format "
                              f"(the reference stores experts as FP4 or FP8 when its linears are FP8)")
    return Storage(linears=linears, experts=experts, scale_dtype=scale_dtype)


def _classify(ckpt: CheckpointDir, seen: dict[str, str], what: str, formats: dict[str, str | None]) -> str | None:
    if len(seen) > 1:
        a, b = list(seen.values())[:2]
        raise CheckpointError(f"mixed storage: {what} must share one format, but {ckpt.describe(a)} is stored as "
                              f"{ckpt.dtype_name(a)} and {ckpt.describe(b)} as {ckpt.dtype_name(b)}")
    for dtype, name in seen.items():
        if dtype not in formats:
            raise CheckpointError(f"tensor {ckpt.describe(name)} is stored as {dtype}; {what} are stored as "
                                  f"{' or '.join(sorted(formats))}")
        return formats[dtype]
    return None


def config_with(config: DSV4Config, storage: Storage) -> DSV4Config:
    """`config` restated to the detected storage, so that `Storage.from_config` gives it back."""
    quant = None
    if storage.linears:
        quant = QuantConfig(scale_dtype=storage.scale_dtype,
                            scale_fmt=(config.quantization or QuantConfig()).scale_fmt
                            if storage.scale_dtype == "e8m0" else None)
    return config.replace(quantization=quant, expert_dtype=storage.experts)
