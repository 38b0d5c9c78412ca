"""Converted checkpoints: the exact in-memory parameters of a loaded `Model`, saved with orbax.

Restoring needs no renaming, expert stacking, casting or dequantizing: orbax reads each array
straight into its device buffer. The directory holds `config.json` (HF vocabulary), `LAYOUT_FILE`
(model dtype and weight storage, which fix the module structure) and `params/` (orbax).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx

from jdspark.checkpoint.safetensors_io import CheckpointError
from jdspark.config import DSV4Config
from jdspark.model.model import Model
from jdspark.model.quantized import Storage, abstract_model

LAYOUT_FILE = "jdspark_layout.json"
FORMAT = "jdspark-orbax-1"


def is_converted(path: Path) -> bool:
    return (path / LAYOUT_FILE).exists()


def save(model: Model, storage: Storage, dst: str | Path) -> Path:
    """Write `model` (whose quantized weights use `storage`) to the new directory `dst`."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst}: exists and is not empty; choose a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp  # only converted checkpoints need orbax
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((dst / "params").absolute(), nnx.to_pure_dict(model.params))
        checkpointer.wait_until_finished()
    (dst / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    layout = {"format": FORMAT, "dtype": model.dtype.name, "storage": dataclasses.asdict(storage)}
    (dst / LAYOUT_FILE).write_text(json.dumps(layout, indent=2))
    return dst


def restore(path: Path, dtype: str, qat_sim: bool = False) -> Model:
    """The `Model` saved by `save`, straight onto the default device (built with the `qat_sim`
    option: it is not part of the saved config)."""
    layout = json.loads((path / LAYOUT_FILE).read_text())
    if layout.get("format") != FORMAT:
        raise CheckpointError(f"{path / LAYOUT_FILE}: format {layout.get('format')!r}, expected {FORMAT!r}")
    if layout["dtype"] != dtype:
        raise CheckpointError(f"{path}: converted for dtype={layout['dtype']!r}, but dtype={dtype!r} was asked; "
                              f"load with dtype={layout['dtype']!r} or convert again with --dtype {dtype}")
    config = DSV4Config.from_json(path / "config.json")
    graphdef, state = abstract_model(config, dtype, Storage(**layout["storage"]), qat_sim=qat_sim)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nnx.to_pure_dict(state))
    import orbax.checkpoint as ocp  # only converted checkpoints need orbax
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            pure = checkpointer.restore((path / "params").absolute(), target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{path / 'params'}: cannot restore the converted parameters "
                              f"(config.json and {LAYOUT_FILE} must match them): {e}") from e
    nnx.replace_by_pure_dict(state, pure)
    return Model(graphdef, state)
