"""Random checkpoints of any config, in the official layout and storage dtypes (tests, benchmarks).

The tensor list comes from the same `disk_specs` the loader checks against. Tensors are drawn and
written one at a time, shard by shard, so a checkpoint of any size is written with the memory of
its largest tensor. The values make a numerically sane model, not the training distribution:
matrices ~ N(0, 1/fan_in) (quantized ones as random codes with a matching power-of-two scale),
vectors ~ 1 + N(0, 0.01), `tid2eid` distinct random experts per token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from jdspark.checkpoint.formats import TensorSpec, disk_specs
from jdspark.checkpoint.safetensors_io import DTYPES, ShardWriter, plan_shards, shard_name, write_index
from jdspark.config import DSV4Config
from jdspark.model.dequant import E2M1_VALUES, FP4_BLOCK, FP8_BLOCK
from jdspark.model.quantized import Storage, abstract_model

E4M3_SPREAD = 64.0  # random e4m3 codes ~ N(0, 64^2): well inside the +-448 range, many exponents
_E2M1_RMS = float(np.sqrt(np.mean(E2M1_VALUES ** 2)))  # of uniformly random codes


def tensor_list(config: DSV4Config) -> list[tuple[str, TensorSpec, int | None]]:
    """(name, spec, expert) of every stored tensor of `config` (format `Storage.from_config`), in the
    order they are written: parameter by parameter, a weight next to its scale, expert by expert."""
    storage = Storage.from_config(config)
    _, state = abstract_model(config, "bfloat16", storage)
    pure = nnx.to_pure_dict(state)
    leaves = {tuple(k.key for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(pure)[0]}
    by_leaf: dict[tuple, list[TensorSpec]] = {}
    for spec in disk_specs(leaves, storage).values():
        by_leaf.setdefault(spec.leaf, []).append(spec)
    out = []
    for specs in by_leaf.values():
        for expert in range(specs[0].experts) if specs[0].experts else [None]:
            out += [(spec.name(expert), spec, expert) for spec in specs]
    return out


def write_checkpoint(config: DSV4Config, path: str | Path, seed: int = 0, shard_bytes: int = 4 << 30,
                     progress: bool = True) -> Path:
    """Write a random checkpoint of `config` to the directory `path` (shards of about `shard_bytes`,
    `model.safetensors.index.json`, `config.json`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = tensor_list(config)
    sizes = [math.prod(spec.shape) * DTYPES[spec.dtype].itemsize for _, spec, _ in tensors]
    shards = [[tensors[i] for i in shard] for shard in plan_shards(sizes, shard_bytes)]
    rng = np.random.default_rng(seed)
    weight_map = {}
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, unit_divisor=1024, desc=f"writing {path.name}",
              disable=not progress) as bar:
        for i, shard in enumerate(shards):
            filename = shard_name(i, len(shards))
            with ShardWriter(path / filename, [(name, spec.dtype, spec.shape) for name, spec, _ in shard]) as writer:
                for name, spec, _ in shard:
                    array = random_tensor(spec, config, rng)
                    writer.write(name, array)
                    weight_map[name] = filename
                    bar.update(array.nbytes)
    write_index(path, weight_map, sum(sizes))
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path


def random_tensor(spec: TensorSpec, config: DSV4Config, rng: np.random.Generator) -> np.ndarray:
    """One stored tensor of `spec` with random values."""
    if spec.dtype == "I8":  # two random E2M1 codes per byte
        return np.frombuffer(rng.bytes(math.prod(spec.shape)), np.int8).reshape(spec.shape)
    if spec.dtype == "F8_E4M3":
        codes = rng.standard_normal(spec.shape, np.float32) * np.float32(E4M3_SPREAD)
        return np.clip(codes, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    if spec.path[-1] == "scale":  # scale the random codes to rms 1/sqrt(fan_in)
        fan_in = spec.shape[-1] * (FP4_BLOCK if spec.fmt == "fp4" else FP8_BLOCK)  # FP8: blocks round up
        scale = 2.0 ** round(math.log2(fan_in ** -0.5 / (_E2M1_RMS if spec.fmt == "fp4" else E4M3_SPREAD)))
        if spec.dtype == "F8_E8M0":
            return np.full(spec.shape, round(math.log2(scale)) + 127, np.uint8)
        return np.full(spec.shape, scale, np.float32)
    if spec.dtype in ("I64", "I32"):  # tid2eid: distinct experts per token
        rows, k = spec.shape
        return np.argsort(rng.random((rows, config.n_routed_experts), np.float32), axis=-1)[:, :k].astype(np.int64)
    if len(spec.shape) >= 2:
        values = rng.standard_normal(spec.shape, np.float32) * np.float32(spec.shape[-1] ** -0.5)
    else:
        values = 1.0 + 0.1 * rng.standard_normal(spec.shape, np.float32)
    return values.astype(DTYPES[spec.dtype])

