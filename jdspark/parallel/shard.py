"""A `Model` on a mesh: its parameters laid out by the partition rules (`rules`), and its routed
experts switched to the expert-parallel path (`Experts.mesh`). Everything else (attention heads,
the output groups, the vocabulary) is partitioned by XLA from the parameters' shardings."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jdspark.model.model import Model
from jdspark.model.moe import Experts
from jdspark.model.quantized import FP8Linear
from jdspark.parallel import rules
from jdspark.parallel.mesh import TENSOR, make_mesh, place

QAT_BLOCK = 128  # the FP8 activation blocks of `Experts` under qat_sim, computed per device in shard_map


def shard_model(model: Model, tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
                devices=None) -> Model:
    """`model` over tensor_parallel_size x expert_parallel_size devices (`make_mesh`); the model
    itself for 1 x 1. ValueError, naming the size and what it must divide, when a split is not
    possible (heads, groups, experts, vocabulary, quantization blocks)."""
    mesh = make_mesh(tensor_parallel_size, expert_parallel_size, devices)
    return model if mesh is None else on_mesh(model, mesh)


def on_mesh(model: Model, mesh: Mesh) -> Model:
    """`model`'s parameters placed on `mesh` by the partition rules."""
    if model.mesh is not None:
        raise ValueError("the model is already sharded; shard the unsharded model once")
    rules.check_config(model.config, mesh)
    width = model.config.moe_intermediate_size // mesh.shape[TENSOR]
    if model.qat_sim and width % QAT_BLOCK:
        raise ValueError(f"qat_sim rounds the expert activations in blocks of {QAT_BLOCK}, but tensor_parallel_size="
                         f"{mesh.shape[TENSOR]} leaves {width} of moe_intermediate_size="
                         f"{model.config.moe_intermediate_size} per device; use a tensor_parallel_size that leaves "
                         f"a multiple of {QAT_BLOCK}")
    params = jax.tree.map(place, model.params, rules.shardings(model.params, mesh))
    return Model(with_mesh(model.graphdef, params, mesh), params, mesh=mesh)


def with_mesh(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh) -> nnx.GraphDef:
    """The graph with `mesh` set in every routed-expert module (a static field, like the kernel
    choice of `hyper.with_implementation`): traced calls then take the expert-parallel path. FP8
    linears split over `tensor` are marked sharded: they take their XLA form, which XLA partitions
    from the weights' shardings (the linear kernel is a custom call, which XLA would run on whole
    operands, gathering the weight's pieces). Replicated ones (the K=V head, compressors, indexer,
    `wq_a`; every linear at TP 1) keep the kernel: each device computes them whole anyway."""
    module = nnx.merge(graphdef, params)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Experts):
            node.mesh = mesh
        elif isinstance(node, FP8Linear):
            node.sharded = not node.weight[...].sharding.is_fully_replicated
    return nnx.split(module)[0]
