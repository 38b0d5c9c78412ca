"""Model parameters as a few device buffers, for the engine's executables.

Every argument buffer of an executable call costs the runtime some host time, and a DeepSeek-V4
checkpoint has hundreds of small tensors (norms, mHC weights, quantization scales, biases): the
embedded model has 318: on the H200 a call of its draft or verify executable spent 2.1 ms in
`Compiled.__call__` with them as arguments and 1.0 ms packed (docs/BENCHMARKS.md, "Where a step's
time goes"). So every small, fully replicated tensor travels inside one flat
buffer per (dtype, sharding) and is sliced back out inside the executable, where the slice fuses
into its consumer; large or sharded tensors stay arguments of their own (packing them would copy
them), and so do views of host memory (`jdspark.experts.mapped`: a packed copy would move them to
the GPU). The packed copy costs at most `small_bytes` per tensor of extra device memory. The engine
packs on the GPU only: on the CPU a call's arguments cost little and the slices lengthen
compilation by ~30% (docs/BENCHMARKS.md). The block scales the FP8 linear kernel reads stay
arguments of their own too (`kernel_scales`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jdspark.experts import mapped
from jdspark.model.quantized import is_fp8_linear, kernel_may_read

SMALL_BYTES = 1 << 20


class PackedParams:
    """`arrays`: the buffers to pass to an executable; `unpack(arrays)` (inside it) rebuilds the
    parameter pytree with the original shapes, dtypes and values."""

    def __init__(self, params, small_bytes: int | None = SMALL_BYTES, apart: Callable[[tuple], bool] | None = None):
        """small_bytes=None packs nothing: every tensor is an argument of its own. apart(path) True
        keeps that tensor an argument of its own too (path: the pytree keys as plain names), e.g.
        one a Pallas kernel reads whole: sliced out of a packed buffer, XLA copies it into a buffer
        of its own before every kernel call."""
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        arrays, groups = [], {}
        self._layout: list[tuple[int, int | None, tuple[int, ...]]] = []  # (array, offset or None: whole, shape)
        for key_path, leaf in with_paths:
            names = key_names(key_path)
            if (small_bytes is None or leaf.nbytes > small_bytes or not leaf.sharding.is_fully_replicated
                    or mapped.is_mapped(names) or (apart is not None and apart(names))):
                self._layout.append((len(arrays), None, leaf.shape))
                arrays.append(leaf)
                continue
            group = groups.setdefault((leaf.dtype, leaf.sharding), [])
            self._layout.append(((leaf.dtype, leaf.sharding), sum(x.size for x in group), leaf.shape))
            group.append(leaf)
        index = {}
        for key, group in groups.items():
            index[key] = len(arrays)
            arrays.append(jnp.concatenate([x.reshape(-1) for x in group]))
        self._layout = [(index[where] if offset is not None else where, offset, shape)
                        for where, offset, shape in self._layout]
        self.arrays = tuple(arrays)

    def unpack(self, arrays):
        leaves = []
        for where, offset, shape in self._layout:
            array = arrays[where]
            if offset is not None:
                array = jax.lax.slice(array, (offset,), (offset + math.prod(shape),)).reshape(shape)
            leaves.append(array)
        return jax.tree.unflatten(self.treedef, leaves)

    def layout_key(self) -> str:
        """The unpacking (every tensor's buffer, offset and shape: the buffers' dtypes are the
        executables' argument types), which a trace depends on."""
        return repr((str(self.treedef), self._layout))


def kernel_scales(params, implementation: str) -> Callable[[tuple], bool]:
    """`PackedParams`' apart(path) for the engine: True for the block scale of an FP8 linear whose weight
    `FP8Linear.project` reads through the Pallas kernel (`quantized.kernel_may_read`). A Pallas call reads
    its operands whole, so a scale sliced out of a packed buffer was copied before every kernel call: at
    Flash dims (8 layers) 67 copies a call, on the H200 82 us of an S = 1 call's kernels; as arguments of
    their own, queued calls took 2.619 -> 2.489 ms at S = 1 and 4.494 -> 4.332 at S = 6 (H100,
    scripts/bench_decode.py; docs/BENCHMARKS.md). Under "auto" the embedded model's linears are below
    KERNEL_MIN_WEIGHTS and keep the XLA form, so its calls pass no more arguments."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    sizes = {key_names(key_path): leaf.size for key_path, leaf in with_paths}

    def apart(path: tuple) -> bool:
        weight = (*path[:-1], "weight")
        return (path[-1:] == ("scale",) and is_fp8_linear(weight) and weight in sizes
                and kernel_may_read(sizes[weight], implementation))
    return apart


def key_names(key_path) -> tuple:
    """A parameter's pytree key path as the checkpoint's names, e.g. ('layers', 0, 'attn', 'wq_a',
    'scale') (an nnx.State path's trailing 'value', the Variable's field, dropped)."""
    names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in key_path)
    return names[:-1] if names[-1:] == ("value",) else names
