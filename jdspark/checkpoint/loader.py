"""`load_model`: a checkpoint directory in the official layout -> `Model`.

Every tensor is checked (name, shape, dtype) before anything is placed on the device, so a bad
checkpoint raises one clear `CheckpointError` and never yields a half-loaded model. This stage reads
float (F32 / BF16 / F16) weights; the quantized FP8 / FP4 formats come with the checkpoint-format work.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.model.layers import Keys

from jdspark.checkpoint.names import is_duplicate, official_to_path, path_to_official
from jdspark.checkpoint.safetensors_io import CheckpointDir, CheckpointError
from jdspark.config import DSV4Config
from jdspark.model.dsv4 import DSV4
from jdspark.model.model import Model

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_FLOAT = {"F32", "BF16", "F16"}
_INT = {"I64", "I32"}


def read_config(path: str | Path) -> DSV4Config:
    """config.json (HF vocabulary) or, failing that, inference/config.json (official vocabulary)."""
    path = Path(path)
    for candidate in (path / "config.json", path / "inference" / "config.json"):
        if candidate.exists():
            return DSV4Config.from_json(candidate)
    raise CheckpointError(f"{path}: no config.json or inference/config.json")


def load_model(path: str | Path, dtype: str = "bfloat16", qat_sim: bool = False) -> Model:
    """Load a DeepSeek-V4 checkpoint directory. dtype: "bfloat16" (serving) or "float32" (parity)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    config = read_config(path).replace(qat_sim=qat_sim)
    abstract = nnx.eval_shape(lambda: DSV4(config, dtype=DTYPES[dtype], rngs=Keys(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    expected = {tuple(k.key for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(pure)[0]}
    values = _read_tensors(CheckpointDir(path), expected, config)
    _set_leaves(pure, values)
    nnx.replace_by_pure_dict(state, pure)
    return Model(graphdef, state)


def _read_tensors(ckpt: CheckpointDir, expected: dict, config: DSV4Config) -> dict:
    values: dict[tuple, np.ndarray] = {}
    experts_seen: dict[tuple, set] = {}
    for name in ckpt.names():
        if is_duplicate(name):
            continue
        path, expert = official_to_path(name)
        if path not in expected:
            raise CheckpointError(f"unexpected tensor {ckpt.describe(name)}: the config (num_hidden_layers="
                                  f"{config.num_hidden_layers}, compress_ratios={list(config.compress_ratios)}, "
                                  f"num_hash_layers={config.num_hash_layers}) has no such parameter")
        want = expected[path]
        shape = want.shape[1:] if expert is not None else want.shape
        if ckpt.shape(name) != tuple(shape):
            raise CheckpointError(f"tensor {ckpt.describe(name)} has shape {list(ckpt.shape(name))}, "
                                  f"expected {list(shape)} from the config")
        stored = ckpt.where[name].dtype_name(name)
        allowed = _INT if jnp.issubdtype(want.dtype, jnp.integer) else _FLOAT
        if stored not in allowed:
            raise CheckpointError(f"tensor {ckpt.describe(name)} is stored as {stored}; this loader reads "
                                  f"{sorted(allowed)} (quantized FP8/FP4 checkpoints need the quantized loader)")
        array = np.asarray(ckpt.get(name)).astype(want.dtype)
        if expert is None:
            values[path] = array
        else:
            if path not in values:
                values[path] = np.zeros(want.shape, want.dtype)
                experts_seen[path] = set()
            values[path][expert] = array
            experts_seen[path].add(expert)
    missing = [path_to_official(p) for p in expected if p not in values]
    missing += [path_to_official(p, e) for p, seen in experts_seen.items()
                for e in range(expected[p].shape[0]) if e not in seen]
    if missing:
        raise CheckpointError(f"{ckpt.path}: missing {len(missing)} tensor(s), first {missing[:3]}")
    for path, array in values.items():
        if path[-1] == "tid2eid" and (array.min() < 0 or array.max() >= config.n_routed_experts):
            raise CheckpointError(f"{path_to_official(path)}: expert ids must lie in "
                                  f"[0, {config.n_routed_experts}), found {array.min()}..{array.max()}")
    return values


def _set_leaves(tree: dict, values: dict) -> None:
    for path, array in values.items():
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = jnp.asarray(array)
