"""Routed experts read straight into their GPU / host placement (`load_model(gpu_memory=...)`).

`SplitLayer` stages the routed experts of one layer that holds host experts. Each expert's tensors
go, as the shards are read, either into the layer's host bank (their final home: never copied again)
or into a staging array of the layer's device experts only, which goes to the device as soon as every
expert of that tensor is in, and is then dropped. So no host expert is held twice, and besides the
banks the host holds at most the device experts of the tensors being read.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdspark.experts.banks import ExpertBank, as_stored
from jdspark.experts.hybrid import bf16_exact

# (projection, array) of a layer's routed-expert parameter -> the bank tensor that holds it
_BANK_TENSOR = {("w1", "weight"): "w1", ("w3", "weight"): "w3", ("w2", "weight"): "w2",
                ("w1", "scale"): "s1", ("w3", "scale"): "s3", ("w2", "scale"): "s2"}


def _bank_format(leaves: Mapping[tuple, jax.ShapeDtypeStruct], layer: int) -> tuple[str, str]:
    """(format, scale dtype) of the host bank of main layer `layer`, from its abstract parameters."""
    weight = jnp.dtype(leaves[("layers", layer, "ffn", "experts", "w1", "weight")].dtype)
    fmt = "fp4" if weight == jnp.int8 else "fp8" if weight == jnp.float8_e4m3fn else "bf16"
    scale = leaves.get(("layers", layer, "ffn", "experts", "w1", "scale"))
    return fmt, "float32" if scale is not None and jnp.dtype(scale.dtype) == jnp.float32 else "e8m0"


class SplitLayer:
    """The routed experts of one main layer, split as they are read: `host_ids` into `bank`, the
    others into per-tensor staging arrays of the device experts only (in global id order)."""

    def __init__(self, leaves: Mapping[tuple, jax.ShapeDtypeStruct], layer: int, host_ids: Sequence[int]):
        prefix = ("layers", layer, "ffn", "experts")
        self.leaves = {path: leaf for path, leaf in leaves.items() if path[:4] == prefix}
        w1 = self.leaves[(*prefix, "w1", "weight")]
        n_experts, inter, dim = w1.shape
        fmt, scale_dtype = _bank_format(leaves, layer)
        self.bank = ExpertBank.empty(fmt, dim * (2 if fmt == "fp4" else 1), inter, n_experts, host_ids, scale_dtype)
        on_host = np.zeros(n_experts, bool)
        on_host[self.bank.expert_ids] = True
        self.device_slot = np.cumsum(~on_host) - 1  # global id -> its row among the device experts
        self.on_host = on_host
        self.staged = {path: np.empty((int((~on_host).sum()), *leaf.shape[1:]), leaf.dtype)
                       for path, leaf in self.leaves.items()}
        self.left = dict.fromkeys(self.leaves, n_experts)

    def put(self, path: tuple, expert: int | None, array: np.ndarray) -> jax.Array | None:
        """File expert `expert` (None: all experts, `array` stacked) of parameter `path`; returns the
        parameter's device experts on the device once all experts of it are in, else None."""
        ids = np.arange(len(self.on_host)) if expert is None else np.array([expert])
        rows = array if expert is None else array[None]
        host = self.on_host[ids]
        if host.any():
            self._to_bank(path, ids[host], rows[host])
        if (~host).any():
            self.staged[path][self.device_slot[ids[~host]]] = rows[~host].astype(self.staged[path].dtype, copy=False)
        self.left[path] -= len(ids)
        if self.left[path]:
            return None
        return jax.device_put(self.staged.pop(path))  # copies: the staging array is dropped here

    def _to_bank(self, path: tuple, ids: np.ndarray, rows: np.ndarray) -> None:
        view = self.bank.view(_BANK_TENSOR[path[-2:]])
        if self.bank.fmt == "bf16":
            rows = bf16_exact(rows.astype(self.leaves[path].dtype, copy=False), "/".join(map(str, path)))
        view[self.bank.slot_of[ids]] = as_stored(rows, view.dtype)

    def finish(self) -> ExpertBank:
        """The filled bank (every parameter must have been put whole)."""
        if any(self.left.values()):
            raise RuntimeError(f"layer split incomplete: {self.left}")
        self.bank.check_scales()
        return self.bank
