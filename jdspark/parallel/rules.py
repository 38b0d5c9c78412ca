"""Partition rules: parameter path -> `PartitionSpec` over the (expert, tensor) mesh.

Megatron-style tensor parallelism, with the DSV4 specifics:
- query heads (`wq_b` rows, `attn_sink`) and the grouped low-rank output (`wo_a` rows = groups)
  over `tensor`; `wo_b` is row-parallel, so its partial sums meet in one all-reduce per layer;
- the one shared K=V head (`wkv`), the compressors and the indexer stay replicated: every query
  head reads the same K=V rows, so the decode state is replicated too, and the indexer's top-k and
  the router's top-k stay exact (a split score sum could flip a selection);
- routed experts: the expert axis over `expert` (EP) and their width F over `tensor`; the shared
  expert's width over `tensor`;
- the embedding, the head and the Markov head's two [V, r] tables are vocabulary-parallel.

A quantized weight's block scale takes its weight's spec, and a split must fall on block
boundaries (FP8: 128 x 128 blocks; ds_fp4: 16 stored bytes = 32 values along the input): `check`
raises, naming the parameter, the block count and the fix, instead of splitting a block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdspark.model.dequant import FP4_BLOCK, FP8_BLOCK
from jdspark.parallel.mesh import EXPERT, TENSOR

P = PartitionSpec
# (module path suffix, spec of its weight / scale / parameter, why); the first match wins, and a
# parameter no rule names is replicated.
RULES: tuple[tuple[tuple[str, ...], PartitionSpec, str], ...] = (
    (("embed",), P(TENSOR, None), "vocabulary-parallel embedding (also markov_head.embed)"),
    (("head",), P(TENSOR, None), "vocabulary-parallel head (also markov_head.head)"),
    (("attn", "wq_b"), P(TENSOR, None), "query heads"),
    (("attn", "attn_sink"), P(TENSOR), "query heads"),
    (("attn", "wo_a"), P(TENSOR, None), "output groups"),
    (("attn", "wo_b"), P(None, TENSOR), "row-parallel over the groups' outputs (all-reduce)"),
    (("experts", "w1"), P(EXPERT, TENSOR, None), "experts over expert, width over tensor"),
    (("experts", "w3"), P(EXPERT, TENSOR, None), "experts over expert, width over tensor"),
    (("experts", "w2"), P(EXPERT, None, TENSOR), "experts over expert, width over tensor (all-reduce)"),
    (("shared_experts", "w1"), P(TENSOR, None), "width"),
    (("shared_experts", "w3"), P(TENSOR, None), "width"),
    (("shared_experts", "w2"), P(None, TENSOR), "width, row-parallel (all-reduce)"),
)
_FLAGS = {TENSOR: "tensor_parallel_size", EXPERT: "expert_parallel_size"}


def leaf_path(keypath) -> tuple:
    """The parameter path (module names, layer numbers, parameter name) of an nnx State leaf."""
    return tuple(k.key for k in keypath if isinstance(k, jax.tree_util.DictKey))


def spec_of(path: tuple) -> PartitionSpec:
    """The rule for one parameter path, e.g. ("layers", 2, "attn", "wq_b", "scale")."""
    module = path[:-1] if path[-1] in ("weight", "scale") else path
    for suffix, spec, _ in RULES:
        if module[-len(suffix):] == suffix:
            return spec
    return P()


def specs(params, prefix: tuple = ()):
    """The PartitionSpec of every leaf of `params` (an nnx State; `prefix`: the path above it)."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: spec_of((*prefix, *leaf_path(kp))), params)


def shardings(params, mesh: Mesh):
    """The NamedSharding of every leaf of `params` on `mesh`, after `check`."""
    check(params, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs(params),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def check(params, mesh: Mesh) -> None:
    """ValueError unless every sharded dimension splits evenly, and on block boundaries for quantized storage."""
    leaves = {leaf_path(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    for path, leaf in leaves.items():
        scale = leaves.get((*path[:-1], "scale")) if path[-1] == "weight" else None
        for dim, axis in enumerate(spec_of(path)):
            if axis is not None and mesh.shape[axis] > 1:
                _check_dim(path, leaf, scale, dim, axis, mesh.shape[axis])


def _check_dim(path, leaf, scale, dim: int, axis: str, n: int) -> None:
    name, size = ".".join(map(str, path)), leaf.shape[dim]
    if size % n and path[-1] == "scale":
        raise ValueError(f"{name} {list(leaf.shape)}: {size} quantization block(s) along dimension {dim}; {axis}={n} "
                         f"would split a block; use a {_FLAGS[axis]} that divides {size}, or load the checkpoint "
                         f"with dequantize=True")
    if size % n:
        raise ValueError(f"{name} {list(leaf.shape)}: dimension {dim} ({size}) does not split over {axis}={n}; "
                         f"use a {_FLAGS[axis]} that divides {size}")
    if scale is None:
        return
    block, blocks = _block(leaf, dim), scale.shape[dim]
    if size != blocks * block or blocks % n:
        raise ValueError(f"{name} {list(leaf.shape)} is stored in {blocks} quantization block(s) of {block} along "
                         f"dimension {dim}; {axis}={n} would split a block; use a {_FLAGS[axis]} that divides "
                         f"{blocks}, or load the checkpoint with dequantize=True")


def _block(weight, dim: int) -> int:
    """Stored elements per scale along `dim`: stacked experts 1 along E; FP8 128; ds_fp4 (int8
    pairs) 16 along the input, 1 along rows."""
    if dim == 0 and len(weight.shape) == 3:
        return 1
    if weight.dtype == jnp.int8:
        return FP4_BLOCK // 2 if dim == len(weight.shape) - 1 else 1
    return FP8_BLOCK


def check_config(config, mesh: Mesh) -> None:
    """The structural conditions, named by config field: ValueError before anything is placed."""
    tp, ep = mesh.shape[TENSOR], mesh.shape[EXPERT]
    needs = [("num_attention_heads", config.num_attention_heads, tp, "query heads are split over tensor"),
             ("o_groups", config.o_groups, tp, "the grouped output projection is split by group"),
             ("vocab_size", config.vocab_size, tp, "the embedding and head are vocabulary-parallel"),
             ("moe_intermediate_size", config.moe_intermediate_size, tp, "expert width is split over tensor"),
             ("n_routed_experts", config.n_routed_experts, ep, "routed experts are split over expert")]
    for field, value, n, why in needs:
        if value % n:
            flag = "expert_parallel_size" if field == "n_routed_experts" else "tensor_parallel_size"
            raise ValueError(f"{flag}={n} does not divide {field}={value} ({why}); use a {flag} that divides {value}")
