"""The device mesh of a sharded model: axes `expert` (routed experts split over devices, EP) and
`tensor` (attention heads, output groups, vocabulary and expert width split, TP), and placing
host or device arrays onto it (also across processes, where each process holds only its devices'
pieces)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

EXPERT, TENSOR = "expert", "tensor"
AXES = (EXPERT, TENSOR)


def make_mesh(tensor_parallel_size: int = 1, expert_parallel_size: int = 1, devices=None) -> Mesh | None:
    """A (expert, tensor) mesh over the first tp * ep of `devices` (default: every device of every
    process, in jax's global order), or None for 1 x 1 (the unsharded model). Devices of one
    process sit next to each other on the tensor axis, so TP collectives stay within a host when
    tp divides the devices per host."""
    for name, size in (("tensor_parallel_size", tensor_parallel_size), ("expert_parallel_size", expert_parallel_size)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r}: must be an integer >= 1")
    wanted = tensor_parallel_size * expert_parallel_size
    if wanted == 1:
        return None
    devices = jax.devices() if devices is None else list(devices)
    if wanted > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x expert_parallel_size={expert_parallel_size} "
                         f"= {wanted} devices, but only {len(devices)} are present ({devices[0].platform}); ask for "
                         f"at most {len(devices)}, or on the CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{wanted} before jax starts")
    grid = np.array(devices[:wanted], dtype=object).reshape(expert_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`array` (numpy or a jax array; the same value in every process) laid out by `sharding`:
    each of this process's devices gets its piece (`jax.make_array_from_callback`), so a mesh may
    span processes."""
    if isinstance(array, jax.Array) and array.sharding == sharding:
        return array
    host = np.asarray(array)  # copied per piece below: `array` may map a checkpoint file
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.array(host[index]))


def place_tree(tree, mesh: Mesh | None):
    """Every array of `tree` replicated on `mesh` (unchanged without a mesh)."""
    if mesh is None:
        return tree
    sharding = replicated(mesh)
    return jax.tree.map(lambda a: place(a, sharding), tree)
