"""Writing a model's parameters as a checkpoint in the official layout (the trained embedded model).

Names come from the one name table (`names.path_to_official`); storage from the config (`Storage.
from_config`): FP8 block-scaled linears and ds_fp4 experts when the config says so, every other
tensor in the dtype the official layout stores it in (the same table the loader checks).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jdspark.checkpoint.names import path_to_official
from jdspark.checkpoint.quantize import quantize_tensors
from jdspark.checkpoint.safetensors_io import DTYPES, plan_shards, save_file, shard_name, write_index
from jdspark.checkpoint.synthetic import tensor_list
from jdspark.config import DSV4Config
from jdspark.model.model import Model
from jdspark.model.quantized import Storage, is_expert


def official_tensors(model: Model) -> dict[str, np.ndarray]:
    """A model's parameters under their official checkpoint names (experts unstacked)."""
    out = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(model.params))[0]:
        path, value = tuple(k.key for k in kp), np.asarray(leaf)
        if is_expert(path):
            for e in range(value.shape[0]):
                out[path_to_official(path, e)] = value[e]
        else:
            out[path_to_official(path)] = value.astype(np.int64) if path[-1] == "tid2eid" else value
    return out


def save_model(model: Model, path: str | Path, config: DSV4Config | None = None, shard_bytes: int = 12 << 20) -> Path:
    """Write `model` (float parameters) to `path` in shards of about `shard_bytes` (one
    model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json) and
    config.json, quantized as `config` (default: the model's) declares."""
    config = config or model.config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, dtype_names = quantize_tensors(official_tensors(model), Storage.from_config(config))
    stored = {name: spec.dtype for name, spec, _ in tensor_list(config)}
    mismatched = sorted(set(stored) ^ set(tensors))  # missing from the model or not in the layout
    if mismatched:
        raise ValueError(f"the model's tensors do not match the config's layout: {mismatched[:5]}")
    for name, value in tensors.items():
        if name not in dtype_names and np.issubdtype(value.dtype, np.floating) and value.dtype.itemsize >= 2:
            tensors[name] = value.astype(DTYPES[stored[name]])
    names = sorted(tensors)
    shards = [[names[i] for i in shard] for shard in plan_shards([tensors[n].nbytes for n in names], shard_bytes)]
    if len(shards) == 1:
        save_file(tensors, path / "model.safetensors", dtype_names)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            filename = shard_name(i, len(shards))
            save_file({n: tensors[n] for n in shard}, path / filename, dtype_names)
            weight_map.update(dict.fromkeys(shard, filename))
        write_index(path, weight_map, sum(t.nbytes for t in tensors.values()))
    (path / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path
