"""`load_model`: a checkpoint directory -> `Model`.

Safetensors in the official layout or transformers' names, float or quantized (FP8 block-scaled
linears, ds_fp4 or FP8 experts, e8m0 or float32 scales, detected from the tensor dtypes), or a
directory written by `jdspark convert` (restored directly, `orbax_io`).

Every tensor is checked (name, shape, dtype) and the set checked complete from the headers alone,
before anything is read; then the shards are read in file order through the memory map, each
parameter placed on the device as soon as its pieces (all experts; weight and scale) are in. A bad
checkpoint raises one clear `CheckpointError` and never yields a half-loaded model.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from jdspark.checkpoint import orbax_io
from jdspark.checkpoint.formats import TensorSpec, config_with, detect_storage, disk_specs
from jdspark.checkpoint.names import Piece, locate
from jdspark.checkpoint.placed import SplitLayer
from jdspark.checkpoint.safetensors_io import CheckpointDir, CheckpointError
from jdspark.config import DSV4Config
from jdspark.experts import hybrid
from jdspark.model.dequant import fp4_dequant, fp8_block_dequant
from jdspark.model.model import Model
from jdspark.model.quantized import Storage, abstract_model
from jdspark.parallel import rules
from jdspark.parallel.mesh import place
from jdspark.parallel.shard import on_mesh

log = logging.getLogger(__name__)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_DEQUANT = {"fp4": jax.jit(fp4_dequant, static_argnums=2), "fp8": jax.jit(fp8_block_dequant, static_argnums=2)}


def read_config(path: str | Path) -> DSV4Config:
    """config.json (HF vocabulary) or, failing that, inference/config.json (official vocabulary)."""
    path = Path(path)
    for candidate in (path / "config.json", path / "inference" / "config.json"):
        if candidate.exists():
            return DSV4Config.from_json(candidate)
    raise CheckpointError(f"{path}: no config.json or inference/config.json")


def load_model(path: str | Path, dtype: str = "bfloat16", qat_sim: bool = False, dequantize: bool = False,
               progress: bool = True, mesh: Mesh | None = None, gpu_memory: float | None = None,
               routing_counts=None, pcie_share: float | None = None) -> Model:
    """Load a DeepSeek-V4 checkpoint directory. dtype: "bfloat16" (serving) or "float32" (parity).
    Quantized weights stay compact on the device and are dequantized inside the jitted forward;
    `dequantize=True` expands them to `dtype` at load instead (debugging). `qat_sim=True` builds the
    model with the reference's FP8 / FP4 QAT rounding simulated (spec §5.8; `Model.qat_sim`).
    `mesh` (`jdspark.parallel.mesh.make_mesh`): each parameter goes straight to its shards
    (`jdspark.parallel.rules`), so no device ever holds the whole model.
    `gpu_memory` (bytes of weights on the one GPU): the routed experts beyond it live in host banks
    (`jdspark.experts.hybrid`, `pcie_share`; `routing_counts` [layers, experts] keep the hottest on
    the GPU, else routing is uniform); the placement is logged. Each routed expert is read straight
    into its place (`placed.SplitLayer`): host experts into their banks, never held twice."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    path = Path(path)
    if orbax_io.is_converted(path):
        if dequantize:
            raise CheckpointError(f"{path}: a converted checkpoint restores its stored layout; "
                                  f"convert again with --dequantize instead")
        if gpu_memory is not None:
            raise CheckpointError(f"{path}: gpu_memory places experts while reading a safetensors checkpoint; "
                                  "load the original checkpoint instead of the converted one")
        model = orbax_io.restore(path, dtype=dtype, qat_sim=qat_sim)
        return model if mesh is None else on_mesh(model, mesh)
    config = read_config(path)
    ckpt = CheckpointDir(path)
    pieces = {name: locate(name, ckpt.shape(name)) for name in ckpt.names()}
    storage = detect_storage(ckpt, pieces, config)
    config = config_with(config, storage)
    graphdef, state = abstract_model(config, DTYPES[dtype], Storage() if dequantize else storage, qat_sim=qat_sim)
    pure = nnx.to_pure_dict(state)
    leaves = {tuple(k.key for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(pure)[0]}
    specs = disk_specs(leaves, storage)
    plan = _plan(ckpt, pieces, specs, config)
    placement = {}
    if mesh is not None:
        rules.check_config(config, mesh)
        rules.check(state, mesh)
        placement = {leaf: NamedSharding(mesh, rules.spec_of(leaf)) for leaf in leaves}
    splits = {} if gpu_memory is None else _splits(leaves, config, gpu_memory, routing_counts, progress,
                                                     mesh is not None, dequantize)
    values = _read(ckpt, plan, specs, leaves, config, progress, placement, splits)
    for leaf, array in values.items():
        node = pure
        for key in leaf[:-1]:
            node = node[key]
        node[leaf[-1]] = array
    nnx.replace_by_pure_dict(state, pure)
    if splits:
        banks = {layer: split.finish() for layer, split in splits.items()}
        return hybrid.with_host_experts(Model(graphdef, state), {layer: bank.expert_ids for layer, bank in banks.items()},
                                        banks=banks, pcie_share=pcie_share)
    return Model(graphdef, state) if mesh is None else on_mesh(Model(graphdef, state), mesh)


# On a CPU backend the quantized weights decoded inside every call cost the embedded model's extend
# 1.4-2.5x a copy decoded at load (bf16, B 1 / 16, S 1 / 6; docs/BENCHMARKS.md, "The embedded model on
# the CPU"): the faces decode safetensors checkpoints up to this size on disk at load (at most
# ~7.5x it decoded, ds_fp4 to float32).
CPU_DECODE_AT_LOAD_MAX_BYTES = 1 << 30


def decode_at_load_by_default(path: str | Path, mesh: Mesh | None = None, gpu_memory: float | None = None) -> bool:
    """Whether `Generator.from_pretrained` decodes quantized weights at load when not told: on a CPU
    backend, for a safetensors checkpoint of at most CPU_DECODE_AT_LOAD_MAX_BYTES, unsharded and with
    no host experts (a GPU reads them in place through its kernels)."""
    path = Path(path)
    if jax.default_backend() != "cpu" or mesh is not None or gpu_memory is not None or orbax_io.is_converted(path):
        return False
    return sum(f.stat().st_size for f in path.rglob("*.safetensors")) <= CPU_DECODE_AT_LOAD_MAX_BYTES


def _splits(leaves: dict, config: DSV4Config, gpu_memory: float, routing_counts, progress: bool, meshed: bool,
            dequantize: bool) -> dict[int, SplitLayer]:
    """The placement under `gpu_memory` (logged) as a `SplitLayer` per layer with host experts."""
    if meshed:
        raise ValueError("gpu_memory (host experts next to one GPU) and mesh (sharding) do not combine: give one")
    if dequantize:
        raise ValueError("dequantize=True expands the experts, but host banks hold the checkpoint's storage: "
                         "drop dequantize or gpu_memory")
    hosted, report = hybrid.plan_for(leaves, gpu_memory, top_k=config.num_experts_per_tok, counts=routing_counts)
    log.info(report)
    if progress:
        tqdm.write(report)
    return {layer: SplitLayer(leaves, layer, ids) for layer, ids in hosted.host_map().items()}


def _plan(ckpt: CheckpointDir, pieces: dict[str, list[Piece]], specs: dict[tuple, TensorSpec],
          config: DSV4Config) -> dict[str, list[tuple[Piece, TensorSpec]]]:
    """Check every tensor against the expected layout and that nothing is missing or repeated."""
    plan: dict[str, list[tuple[Piece, TensorSpec]]] = {}
    covered: dict[tuple, dict[int | None, str]] = {path: {} for path in specs}
    for name, parts in pieces.items():
        for piece in parts:
            spec = specs.get(piece.path)
            if spec is None or (piece.expert is not None and spec.experts is None):
                raise CheckpointError(
                    f"unexpected tensor {ckpt.describe(name)}: the config (num_hidden_layers="
                    f"{config.num_hidden_layers}, compress_ratios={list(config.compress_ratios)}, "
                    f"num_hash_layers={config.num_hash_layers}) has no such parameter")
            stored = ckpt.dtype_name(name)
            if not spec.accepts(stored):
                raise CheckpointError(f"tensor {ckpt.describe(name)} is stored as {stored}, expected {spec.describe()} "
                                      f"(the checkpoint's format: {_storage_words(specs)})")
            whole = spec.experts is not None and piece.expert is None
            want = (spec.experts, *spec.shape) if whole else spec.shape
            shape = np.broadcast_to(np.empty((), np.uint8), ckpt.shape(name))[piece.index].shape
            if shape != tuple(want):
                raise CheckpointError(f"tensor {ckpt.describe(name)} has shape {list(shape)}, expected "
                                      f"{list(want)} ({spec.dtypes()}) from the config")
            if piece.expert is not None and not 0 <= piece.expert < spec.experts:
                raise CheckpointError(f"tensor {ckpt.describe(name)}: expert {piece.expert} is outside "
                                      f"[0, {spec.experts}) (n_routed_experts={config.n_routed_experts})")
            slots = range(spec.experts) if whole else [piece.expert]
            for slot in slots:
                if slot in covered[spec.path]:
                    raise CheckpointError(f"tensor {ckpt.describe(name)} repeats {spec.name(slot)!r}, already "
                                          f"given by {ckpt.describe(covered[spec.path][slot])}")
                covered[spec.path][slot] = name
            plan.setdefault(name, []).append((piece, spec))
    missing = [(spec, e) for path, spec in specs.items()
               for e in (range(spec.experts) if spec.experts else [None]) if e not in covered[path]]
    if missing:
        listed = ", ".join(f"{spec.name(e)!r} ({spec.describe()})" for spec, e in missing[:3])
        raise CheckpointError(f"{ckpt.path}: missing {len(missing)} tensor(s), first {listed}")
    return plan


def _storage_words(specs: dict[tuple, TensorSpec]) -> str:
    formats = {spec.dtype for spec in specs.values()} - {"BF16", "F32", "I64"}
    return "float" if not formats else "quantized " + "/".join(sorted(formats))


class _Staging:
    """The pieces of one parameter on the host until all have arrived (experts are stacked here)."""

    def __init__(self, specs: list[TensorSpec], leaf):
        self.leaf, self.specs = leaf, {spec.path: spec for spec in specs}
        self.parts: dict[tuple, np.ndarray] = {}
        self.left = {spec.path: spec.experts or 1 for spec in specs}

    def put(self, spec: TensorSpec, piece: Piece, array: np.ndarray) -> None:
        if spec.experts is None:
            self.left[spec.path] = 0
            # a part that waits for the others is copied: the mapped file's pages are dropped once read
            self.parts[spec.path] = array if self.done() else np.array(array)
            return
        if spec.path not in self.parts:
            cast = not spec.dequant and jnp.issubdtype(self.leaf.dtype, jnp.floating)
            self.parts[spec.path] = np.empty((spec.experts, *spec.shape), self.leaf.dtype if cast else array.dtype)
        if piece.expert is None:
            self.parts[spec.path][...] = array
            self.left[spec.path] = 0
        else:
            self.parts[spec.path][piece.expert] = array
            self.left[spec.path] -= 1

    def done(self) -> bool:
        return not any(self.left.values())

    def finish(self, leaf_path: tuple, config: DSV4Config, sharding=None) -> jax.Array:
        """The parameter on the device, or laid out by `sharding` (its pieces only on their devices)."""
        spec = self.specs[leaf_path]
        if spec.dequant:
            scale = self.parts[(*leaf_path[:-1], "scale")]
            array = _DEQUANT[spec.fmt](self.parts[leaf_path], scale, self.leaf.dtype)
            return array if sharding is None else place(array, sharding)
        array = np.asarray(self.parts[leaf_path])
        if leaf_path[-1] == "tid2eid" and (array.min() < 0 or array.max() >= config.n_routed_experts):
            raise CheckpointError(f"{spec.name()}: expert ids must lie in [0, {config.n_routed_experts}), "
                                  f"found {array.min()}..{array.max()}")
        array = array.astype(self.leaf.dtype, copy=False)
        if sharding is not None:
            return place(array, sharding)
        # device_put copies (jnp.asarray may alias host memory on the CPU: here, the mapped file)
        return jax.device_put(array)


def _read(ckpt: CheckpointDir, plan: dict[str, list[tuple[Piece, TensorSpec]]], specs: dict[tuple, TensorSpec],
          leaves: dict, config: DSV4Config, progress: bool, placement: dict,
          splits: dict[int, SplitLayer]) -> dict[tuple, jax.Array]:
    """Read shard by shard in file order; each parameter goes to the device once complete, the
    routed experts of `splits`' layers to their bank or device part as they come. Each tensor's
    pages leave this process's resident set once what was made from it is on the device (`_Reclaim`)."""
    by_leaf: dict[tuple, list[TensorSpec]] = {}
    for spec in specs.values():
        by_leaf.setdefault(spec.leaf, []).append(spec)
    staging: dict[tuple, _Staging] = {}
    values: dict[tuple, jax.Array] = {}
    reclaim = _Reclaim()
    total = sum(ckpt.where[name].nbytes(name) for name in plan)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"loading {ckpt.path.name}",
              disable=not progress) as bar:
        for f in ckpt.files.values():
            for name in f.in_file_order():
                if name not in plan:
                    continue
                array = f.get(name)
                made = []
                for piece, spec in plan[name]:
                    split = splits.get(spec.leaf[1]) if hybrid.is_main_expert(spec.leaf) else None
                    value = None
                    if split is not None:
                        value = split.put(spec.leaf, piece.expert, array[piece.index])
                    else:
                        stage = staging.setdefault(spec.leaf, _Staging(by_leaf[spec.leaf], leaves[spec.leaf]))
                        stage.put(spec, piece, array[piece.index])
                        if stage.done():
                            value = staging.pop(spec.leaf).finish(spec.leaf, config, placement.get(spec.leaf))
                    if value is not None:
                        values[spec.leaf] = value
                        made.append(value)
                reclaim.read(f, name, made)
                bar.update(f.nbytes(name))
    reclaim.flush()
    return values


class _Reclaim:
    """Drops each tensor's pages of the mapped file (`SafetensorsFile.drop_pages`) once the arrays
    made from it are on their devices: a device_put may copy later, from those pages. It lags the
    reading by a few tensors, so waiting for a copy rarely stalls it."""

    def __init__(self, lag: int = 8):
        self.lag, self.pending = lag, collections.deque()

    def read(self, f, name: str, made: list) -> None:
        self.pending.append((f, name, made))
        while len(self.pending) > self.lag:
            self._drop()

    def flush(self) -> None:
        while self.pending:
            self._drop()

    def _drop(self) -> None:
        f, name, made = self.pending.popleft()
        jax.block_until_ready(made)
        f.drop_pages(name)


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", dequantize: bool = False,
            progress: bool = True) -> Path:
    """`jdspark convert`: load `src` and save its exact in-memory layout to `dst` (orbax), which
    `load_model(dst, dtype)` then restores directly."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst}: exists and is not empty; choose a new directory")
    model = load_model(src, dtype=dtype, dequantize=dequantize, progress=progress)
    return orbax_io.save(model, Storage() if dequantize else Storage.from_config(model.config), dst)
