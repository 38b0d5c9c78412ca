"""Compact in-memory storage of the checkpoint-quantized weights, dequantized inside the jit.

`Storage` says how the FP8-stored linears and the routed experts live in device memory; `build`
makes a DSV4 with that layout. Parameters keep the checkpoint's names (`weight`, `scale`), so the
name table of `jdspark.checkpoint.names` covers every layout. Bytes per parameter: FP8 linears
1 + 1/128^2 (e8m0 scales) or 1 + 4/128^2 (float32 scales); ds_fp4 experts 0.5 + 1/32 = 0.53125.

Which linears are FP8 on disk follows the official model: every `Linear` built with the default
(FP8) dtype there, i.e. all except the compressors' wkv / wgate, the indexer's weights_proj and the
head. `wo_a` is FP8 on disk and the reference applies it as a bfloat16 einsum of the decoded weight
(its converter dequantizes it): it stays FP8 here (half the bytes of bfloat16) and its grouped
product decodes it exactly (e4m3 values are bfloat16 values), with float32 accumulation as the
reference's einsum.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import DSV4Config
from jdspark.model.dequant import FP4_BLOCK, FP8_BLOCK, fp4_dequant, fp8_block_dequant, fp8_block_matmul
from jdspark.model.dsv4 import DSV4
from jdspark.model.layers import Keys, Linear
from jdspark.model.moe import KERNEL_MIN_WEIGHTS, ExpertWeights
from pallas_kernels import fp8_linear as fp8_kernels
from pallas_kernels import interpret_mode, resolve_implementation

FP8_LINEARS = frozenset({"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3", "e_proj", "h_proj", "main_proj"})
_SCALE_DTYPES = {"e8m0": jnp.uint8, "float32": jnp.float32}


def is_fp8_linear(path: tuple) -> bool:
    """Whether the parameter at `path` is an FP8 block-quantized linear weight in a quantized checkpoint."""
    return (len(path) >= 3 and path[-1] == "weight" and path[-2] in FP8_LINEARS
            and path[-3] not in ("compressor", "experts"))


def kernel_may_read(weight_size: int, implementation: str) -> bool:
    """Whether `FP8Linear` reads a weight of this many elements through `pallas_kernels.fp8_linear` under
    `implementation` (in calls of the kernel's sizes, unsharded): where it resolves to "pallas", and under
    "auto" only weights of at least KERNEL_MIN_WEIGHTS."""
    if resolve_implementation(implementation) != "pallas":
        return False
    return implementation != "auto" or weight_size >= KERNEL_MIN_WEIGHTS


def is_weight_scale(path: tuple) -> bool:
    """Whether `path` is the block scale of an FP8 linear or of a routed-expert weight."""
    return path[-1:] == ("scale",) and (is_expert(path) or is_fp8_linear((*path[:-1], "weight")))


def is_expert(path: tuple) -> bool:
    """Whether `path` is a stacked routed-expert parameter ([E, ...])."""
    return len(path) >= 3 and path[-3] == "experts"


@dataclasses.dataclass(frozen=True)
class Storage:
    """Format of the quantized weights: linears "fp8" or None (model dtype); experts "fp4", "fp8"
    or None; FP8 scales "e8m0" (uint8 bytes) or "float32" (the -Base variants)."""

    linears: str | None = None
    experts: str | None = None
    scale_dtype: str = "e8m0"

    def __post_init__(self):
        if self.linears not in (None, "fp8") or self.experts not in (None, "fp4", "fp8"):
            raise ValueError(f"unknown storage {self}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r}: expected one of {sorted(_SCALE_DTYPES)}")

    @classmethod
    def from_config(cls, config: DSV4Config) -> "Storage":
        """The reference's reading: `quantization` makes FP8 the default linear format, and routed
        experts follow `expert_dtype`, else the default format."""
        q = config.quantization
        return cls(linears="fp8" if q else None, experts=config.expert_dtype or ("fp8" if q else None),
                   scale_dtype=q.scale_dtype if q else "e8m0")

    def format_of(self, path: tuple) -> str | None:
        """The checkpoint format ("fp8", "fp4" or None) of the float parameter at `path`."""
        if is_expert(path) and path[-1] == "weight":
            return self.experts
        return self.linears if is_fp8_linear(path) else None


class FP8Linear(Linear):
    """A linear kept as e4m3 `weight` [out, in] + block `scale` [ceil(out/128), ceil(in/128)]."""

    def __init__(self, in_features: int, out_features: int, *, scale_dtype: str, fp8_input: bool = False,
                 compute_dtype=None):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.float8_e4m3fn))
        self.scale = nnx.Param(jnp.zeros(_block_shape(out_features, in_features), _SCALE_DTYPES[scale_dtype]))
        self.fp8_input = fp8_input
        self.compute_dtype = compute_dtype
        self.implementation = "auto"  # the FP8 linear kernel's choice; set with `hyper.with_implementation`
        self.sharded = False  # split over a mesh (`jdspark.parallel.shard`): the XLA form, which XLA partitions

    def dense_weight(self, dtype) -> jax.Array:
        return fp8_block_dequant(self.weight[...], self.scale[...], dtype)

    def project(self, x: jax.Array, dtype) -> jax.Array:
        """Calls of at most `fp8_kernels.MAX_ROWS` rows (decode, verify) of an unsharded weight read
        the e4m3 weight in place through the kernel (`pallas_kernels.fp8_linear`) where
        `implementation` resolves to "pallas" (the GPU by default); other accelerator calls use
        `fp8_block_matmul`. On the CPU the weight is decoded: the block form's extra products cost
        more there (tiny model, S=6 extend, a loaded 2-core machine: 97 against 34 ms), and the model
        then equals its dequantized-at-load copy bit for bit (the block form sums in another order)."""
        weight, scale = self.weight[...], self.scale[...]
        rows = math.prod(x.shape[:-1])
        if self._kernel(rows):
            y = fp8_kernels.fp8_linear(x.reshape(rows, -1).astype(dtype), weight, scale,
                                       interpret=interpret_mode())
            return y.reshape(*x.shape[:-1], weight.shape[0])
        if jax.default_backend() == "cpu":
            return super().project(x, dtype)
        return fp8_block_matmul(x, weight, scale, dtype)

    def grouped(self, x: jax.Array) -> jax.Array:
        """`Linear.grouped` with the e4m3 weight read in place by the kernel where `project` would
        use it (x [..., G, in], at most `fp8_kernels.MAX_ROWS` rows), else on the decoded weight."""
        weight, scale = self.weight[...], self.scale[...]
        lead, groups = x.shape[:-2], x.shape[-2]
        rows = math.prod(lead)
        if self._kernel(rows, groups):
            y = fp8_kernels.fp8_linear(x.reshape(rows, groups, -1), weight, scale, interpret=interpret_mode())
            return y.reshape(*lead, groups, -1).astype(x.dtype)
        return super().grouped(x)

    def _kernel(self, rows: int, groups: int = 1) -> bool:
        """Whether a call of `rows` rows takes `pallas_kernels.fp8_linear` (see `project`): "auto" takes
        it for weights of at least KERNEL_MIN_WEIGHTS (measured at Flash dims; the embedded model's
        small linears keep the XLA form they were measured with)."""
        weight = self.weight
        if self.sharded or not kernel_may_read(weight.size, self.implementation):
            return False
        return (fp8_kernels.supported(*weight.shape, rows, groups=groups)
                and self.scale.shape == _block_shape(*weight.shape))


class FP8ExpertWeights(ExpertWeights):
    """Routed experts as e4m3 `weight` [E, out, in] + block `scale` [E, ceil(out/128), ceil(in/128)]."""

    fmt = "fp8"

    def __init__(self, n_experts: int, in_features: int, out_features: int, *, scale_dtype: str):
        self.weight = nnx.Param(jnp.zeros((n_experts, out_features, in_features), jnp.float8_e4m3fn))
        self.scale = nnx.Param(jnp.zeros((n_experts, *_block_shape(out_features, in_features)),
                                         _SCALE_DTYPES[scale_dtype]))

    def dense(self, dtype) -> jax.Array:
        return fp8_block_dequant(self.weight[...], self.scale[...], dtype)

    def take(self, experts: jax.Array, dtype) -> jax.Array:
        return fp8_block_dequant(jnp.take(self.weight[...], experts, axis=0),
                                 jnp.take(self.scale[...], experts, axis=0), dtype)

    def stored(self) -> tuple[str, tuple[jax.Array, ...]]:
        return self.fmt, (self.weight[...], self.scale[...])


class FP4ExpertWeights(ExpertWeights):
    """Routed experts packed as ds_fp4: `weight` int8 [E, out, in/2] + e8m0 `scale` [E, out, in/32]."""

    fmt = "fp4"

    def __init__(self, n_experts: int, in_features: int, out_features: int):
        if in_features % FP4_BLOCK:
            raise ValueError(f"FP4 experts need in_features % {FP4_BLOCK} == 0, got {in_features}")
        self.weight = nnx.Param(jnp.zeros((n_experts, out_features, in_features // 2), jnp.int8))
        self.scale = nnx.Param(jnp.zeros((n_experts, out_features, in_features // FP4_BLOCK), jnp.uint8))

    def dense(self, dtype) -> jax.Array:
        return fp4_dequant(self.weight[...], self.scale[...], dtype)

    def take(self, experts: jax.Array, dtype) -> jax.Array:
        return fp4_dequant(jnp.take(self.weight[...], experts, axis=0),
                           jnp.take(self.scale[...], experts, axis=0), dtype)

    def stored(self) -> tuple[str, tuple[jax.Array, ...]]:
        return self.fmt, (self.weight[...], self.scale[...])


def _block_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK)


def build(config: DSV4Config, dtype, storage: Storage, rngs: Keys, qat_sim: bool = False) -> DSV4:
    """A DSV4 whose quantized weights use `storage` (zero-initialised: a checkpoint fills them).
    Cheap under `nnx.eval_shape`, which is how the loader and the shape tests use it."""
    model = DSV4(config, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
    swaps = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and storage.linears and is_fp8_linear((*path, "weight")):
            out_features, in_features = node.weight.shape
            swaps.append((path, FP8Linear(in_features, out_features, scale_dtype=storage.scale_dtype,
                                          fp8_input=node.fp8_input, compute_dtype=node.compute_dtype)))
        elif isinstance(node, ExpertWeights) and storage.experts:
            e, out_features, in_features = node.weight.shape
            swaps.append((path, FP4ExpertWeights(e, in_features, out_features) if storage.experts == "fp4"
                          else FP8ExpertWeights(e, in_features, out_features, scale_dtype=storage.scale_dtype)))
    for path, module in swaps:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        setattr(parent, path[-1], module)
    return model


def abstract_model(config: DSV4Config, dtype, storage: Storage,
                   qat_sim: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph and shape-only parameters of `build`, allocating nothing (full-size configs are fine)."""
    return nnx.split(nnx.eval_shape(lambda: build(config, dtype, storage, Keys(0), qat_sim=qat_sim)))
