"""Writing test checkpoints: a model's parameters under official names, sharded safetensors + config."""

import json
from pathlib import Path

import numpy as np

from jdspark.checkpoint.safetensors_io import save_file
from jdspark.config import DSV4Config


def write(path: Path, tensors: dict[str, np.ndarray], config: DSV4Config, shards: int = 1,
          dtype_names: dict[str, str] | None = None) -> Path:
    """One `model.safetensors`, or `shards` files + `model.safetensors.index.json`; `config.json`."""
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", dtype_names)
    else:
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in names[i::shards]}, path / shard, dtype_names)
            weight_map.update({n: shard for n in names[i::shards]})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path
