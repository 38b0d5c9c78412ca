"""Hybrid MoE layers: some routed experts on the device, the rest in a host bank.

`HybridExperts` has the contract of `jdspark.model.moe.Experts` (x [N, D], routing weights [N, K],
expert ids [N, K] -> float32 [N, D]) and replaces it in the MoE layers that hold host experts
(`with_host_experts`). It computes:

- the device experts as `Experts` does (the in-place kernel or the XLA gather, the same rounding
  points), over the same M = min(N*K, E) slots of the call's distinct global experts; a slot whose
  expert lives on the host gathers some device expert with routing weight 0, so it adds exact zeros;
- the host experts, each distinct one read once per call, in two shares (the reference's q* split):
  the first round(q * n) of the call's n distinct host experts (in bank order) are read by the GPU
  in place from the pinned bank over PCIe (`MappedExperts`: the same kernel as the device experts,
  so the same values), the rest by the multi-threaded CPU GEMV. q = `pcie_share`, from the two
  measured rates (`jdspark bench bw`: the CPU GEMV and the kernel reading host memory, which run at
  once without slowing each other much); 0 keeps every host expert on the CPU;
- their sum in float32.

How the step reaches the CPU GEMV: `via="ffi"` (the default) is the pair of XLA FFI custom calls of
`host_ffi`: C++ end to end, started before the device experts and the PCIe share and finished after
them (`jax.lax.optimization_barrier` orders the three), so on a GPU the CPU computes while the GPU
does; the thread that launches the step never waits. `via="callback"` is a `jax.pure_callback` into
`cpu_gemv.moe_forward` (Python; it blocks that thread, and the device waits for it), kept to compare
against and for the numba backend; it has no PCIe share.

The host calls are pure (no ordering token): XLA drops them if their result were unused, which a
function of (x, ids, weights) permits. Under `jax.vmap` the batch is broadcast into the rows of one
call (vmap_method="broadcast_all"). Executables holding pure callbacks are not written to JAX's
persistent compilation cache; those holding the custom calls are (a bank is named by a content key).
Splitting a call's host experts between the two shares makes a row's result depend, within float32
rounding, on which other rows share the call.
"""

from __future__ import annotations

import time
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jdspark.experts import host_ffi, mapped
from jdspark.experts.banks import ExpertBank
from jdspark.experts.cpu_gemv import default_threads, host_callback
from jdspark.experts.placement import Placement, plan_placement
from jdspark.model.model import Model
from jdspark.model.moe import MISSING, Experts, ExpertWeights, MoE, expert_slots, routing_matrix


# The GPU's share of a call's host experts where none is given, on a CUDA GPU (0 elsewhere: a CPU has
# no PCIe to read over): q = r_gpu / (r_gpu + r_cpu) from the two rates measured together on the
# H200 machine (2026-12-03, a probe that is now `jdspark bench bw`'s "at once" rows: the kernel
# reading ds_fp4 experts from host memory at ~30 GB/s while the 15-thread CPU GEMV read ~60 GB/s).
CUDA_PCIE_SHARE = 1 / 3


def default_pcie_share() -> float:
    """`CUDA_PCIE_SHARE` where the default device is a CUDA GPU, else 0."""
    return CUDA_PCIE_SHARE if mapped.is_cuda(jax.devices()[0]) else 0.0


class HybridExperts(Experts):
    """The routed experts of one layer split by `host_ids`: the others stay on the device in their
    stored format (`w1`, `w3`, `w2` over the device experts only; None when all are on the host),
    `bank` holds the host ones, `host_mapped` views it for the GPU's PCIe share (None without one).
    `local[e]` is global expert e's device index (for a host expert, a neighbouring device expert's:
    an index in range), `on_host[e]` where it lives, `slot_of[e]` its bank slot or -1."""

    def __init__(self, experts: Experts, host_ids: Sequence[int], *, dtype, threads: int | None = None,
                 bank: ExpertBank | None = None, via: str = "ffi", pcie_share: float = 0.0):
        """dtype: the model's compute dtype (float32 or bfloat16), which the host GEMV rounds to;
        `bank`: the host experts already in a bank (their arrays in `experts` are then never read, and
        may be abstract: a model too large to hold whole before it is split; or `experts`' arrays
        hold the device experts only, in global id order: a placed load); `via`: "ffi" or
        "callback", how the step reaches the host GEMV; `pcie_share`: q in [0, 1], the share of a
        call's host experts the GPU reads over PCIe (module docstring; "ffi" only)."""
        e = experts.n_experts
        host = np.unique(np.asarray(host_ids, np.int64))
        if host.size == 0 or host.min() < 0 or host.max() >= e:
            raise ValueError(f"host expert ids {np.asarray(host_ids).tolist()}: expected a non-empty set of ids "
                             f"in [0, {e})")
        if experts.qat_sim:
            raise ValueError("host experts do not simulate QAT rounding: build the model with qat_sim=False")
        if via not in ("ffi", "callback"):
            raise ValueError(f"via={via!r}: expected 'ffi' (the XLA custom calls) or 'callback' (jax.pure_callback)")
        if not 0.0 <= pcie_share <= 1.0 or (pcie_share and via != "ffi"):
            raise ValueError(f"pcie_share={pcie_share}: expected a share in [0, 1], and 0 with via='callback'")
        on_host = np.zeros(e, bool)
        on_host[host] = True
        device = np.flatnonzero(~on_host)
        fmt = experts.w1.fmt
        self.bank = _bank(experts, fmt, host) if bank is None else _checked(bank, fmt, host, e)
        ranks = np.cumsum(~on_host) - ~on_host  # device experts before e: e's index when it is on the device
        self.local = nnx.Variable(jnp.asarray(np.minimum(ranks, max(len(device) - 1, 0)), jnp.int32))
        self.on_host = nnx.Variable(jnp.asarray(on_host))
        self.slot_of = nnx.Variable(jnp.asarray(self.bank.slot_of, jnp.int32))
        self.w1, self.w3, self.w2 = ((_on_device(getattr(experts, n), device) if len(device) else None)
                                     for n in ("w1", "w3", "w2"))
        self.n_experts, self.limit, self.qat_sim = e, experts.limit, False
        self.implementation = experts.implementation
        self.via, self.threads, self.pcie_share = via, threads or default_threads(), float(pcie_share)
        self.round_bf16 = bool(jnp.dtype(dtype) == jnp.bfloat16)
        self.host_mapped = MappedExperts(experts, self.bank) if pcie_share > 0 else None
        if via == "ffi":
            self.bank_key = host_ffi.register(self.bank)
        else:
            self.host_forward = _Timed(host_callback(self.bank, limit=self.limit, dtype=jnp.dtype(dtype).name,
                                                     threads=self.threads), self.bank)

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """x [N, D], routing weights [N, K], expert ids [N, K] -> float32 [N, D]."""
        host_idx = jnp.where(weights != 0, idx, -1)  # a pair of weight 0 adds nothing: the host skips it
        if self.via == "callback":
            y = jax.pure_callback(self.host_forward, jax.ShapeDtypeStruct(x.shape, jnp.float32), x,
                                  host_idx.astype(jnp.int32), weights.astype(jnp.float32),
                                  vmap_method="broadcast_all")
            return y if self.w1 is None else self._device_part(x, weights, idx) + y
        split = pcie_split(self.slot_of[...], idx, self.pcie_share, len(self.bank.expert_ids)) \
            if self.host_mapped is not None else None
        cpu_idx = host_idx if split is None else jnp.where(split.on_cpu, host_idx, -1)
        pending = None
        if self.pcie_share < 1.0:
            pending = host_ffi.start(self.bank_key, x, cpu_idx, weights, limit=self.limit,
                                     round_bf16=self.round_bf16, threads=self.threads)
            x, pending = jax.lax.optimization_barrier((x, pending))  # the GPU's parts come after the start
        parts = []
        if self.w1 is not None:
            parts.append(self._device_part(x, weights, idx))
        if split is not None:
            parts.append(self._pcie_part(x, weights, idx, split))
        if pending is None:
            return sum(parts)
        if not parts:
            return host_ffi.finish(self.bank_key, pending)
        total, pending = jax.lax.optimization_barrier((sum(parts), pending))  # ... and before the finish
        return total + host_ffi.finish(self.bank_key, pending)

    def _pcie_part(self, x: jax.Array, weights: jax.Array, idx: jax.Array, split: PcieSplit) -> jax.Array:
        """The GPU's PCIe share: the kernel reads its host experts in place (`host_mapped`); a call of
        many rows in the kernel's grouped form, over the share's pairs (bank slots, the rest dropped)."""
        mapped = self.host_mapped
        if mapped._grouped(x):
            return mapped._grouped_call(x, jnp.where(split.on_gpu, weights, 0.0),
                                        jnp.where(split.on_gpu, self.slot_of[...][idx], MISSING))
        dense = routing_matrix(jnp.where(split.on_gpu, weights, 0.0), split.slot, split.experts.shape[0])
        return mapped._selected(x, split.experts, dense, split.slot)

    def reads_per_expert(self, d: int) -> bool:
        """The host pool reads each distinct host expert once a call (and skips pairs of weight 0)."""
        return True

    def _device_part(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """The device experts' part: host experts' slots are missing (-1: the kernel reads nothing for
        them, the gather a device expert at weight 0); in the grouped form their pairs are dropped."""
        if self._grouped(x):
            on_host = self.on_host[...][idx]
            return self._grouped_call(x, jnp.where(on_host, 0.0, weights),
                                      jnp.where(on_host, MISSING, self.local[...][idx]))
        experts, slot = expert_slots(idx, self.n_experts)
        elsewhere = (experts < 0) | self.on_host[...][experts]  # unused slots and host experts: read nothing
        dense = jnp.where(elsewhere[None], 0.0, routing_matrix(weights, slot, experts.shape[0]))
        return self._selected(x, jnp.where(elsewhere, MISSING, self.local[...][experts]), dense, slot)

    def host_stats(self, *, reset: bool = False) -> dict:
        """{"calls", "seconds", "experts"}: the CPU calls of this layer, the seconds inside them (plan +
        GEMV) and the distinct host experts they read, since the start or the last reset."""
        if self.via == "ffi":
            return host_ffi.stats(self.bank, reset=reset)
        return self.host_forward.stats(reset)


class MappedExperts(Experts):
    """A host bank as routed experts the GPU reads in place: w1, w3, w2 over the bank's slots, their
    arrays views of its pinned memory (`jdspark.experts.mapped`; plain copies on a CPU backend). Its
    experts are bank slots; a negative one is a padding slot that reads nothing."""

    def __init__(self, experts: Experts, bank: ExpertBank):
        names = {"w1": ("w1", "s1"), "w3": ("w3", "s3"), "w2": ("w2", "s2")}
        self.w1, self.w3, self.w2 = (_mapped(getattr(experts, n), bank, names[n]) for n in ("w1", "w3", "w2"))
        self.n_experts, self.limit, self.qat_sim = len(bank.expert_ids), experts.limit, False
        self.implementation, self.mesh = experts.implementation, None


class PcieSplit(NamedTuple):
    """One call's PCIe share (`pcie_split`): experts [G + 1] bank slots (-1: none; the last always
    -1), slot [N, K] each pair's index into them (G where the pair is not in the share), on_gpu /
    on_cpu [N, K] which host pairs each share computes."""

    experts: jax.Array
    slot: jax.Array
    on_gpu: jax.Array
    on_cpu: jax.Array


def pcie_split(slot_of: jax.Array, idx: jax.Array, share: float, n_slots: int) -> PcieSplit:
    """The first round(share * n) of the call's n distinct host experts, by bank slot, go to the GPU;
    the rest of the host pairs to the CPU. Up to PAIRWISE_MAX pairs by pairwise comparisons (no sort:
    a few fused kernels, for decode and verify); past that (a prefill) by a sort, where [P, P]
    comparisons would take P^2 bytes (9.7 GB for a 64-row bucket of 256-token chunks)."""
    n, k = idx.shape
    bank_slot = slot_of[idx].reshape(-1)
    held = bank_slot >= 0
    pairs = n * k
    g = int(np.floor(share * min(pairs, n_slots) + 0.5))  # the most distinct experts the share can take
    if pairs <= PAIRWISE_MAX:
        earlier = jnp.tril(jnp.ones((pairs, pairs), bool), -1)
        same = bank_slot[:, None] == bank_slot[None, :]
        first = held & ~jnp.any(same & earlier, axis=1)  # the first pair of each distinct host expert
        rank = jnp.sum(first[None, :] & (bank_slot[None, :] < bank_slot[:, None]), axis=1)
        take = jnp.floor(share * jnp.sum(first) + 0.5).astype(jnp.int32)
        on_gpu = held & (rank < take)
        experts = jnp.full((g + 2,), -1, jnp.int32).at[jnp.where(first & on_gpu, rank, g + 1)].set(bank_slot)[:g + 1]
    else:
        distinct = jnp.unique(jnp.where(held, bank_slot, n_slots), size=min(pairs, n_slots) + 1,
                              fill_value=n_slots)
        rank = jnp.searchsorted(distinct, bank_slot, side="left", method="sort")
        take = jnp.floor(share * jnp.sum(distinct < n_slots) + 0.5).astype(jnp.int32)
        on_gpu = held & (rank < take)
        experts = jnp.where(jnp.arange(g + 1) < take, distinct[:g + 1], -1)
    slot = jnp.where(on_gpu, rank, g).astype(jnp.int32)
    return PcieSplit(experts, slot.reshape(n, k), on_gpu.reshape(n, k), (held & ~on_gpu).reshape(n, k))


PAIRWISE_MAX = 2048  # pairs pcie_split compares pairwise ([P, P] bools: 4 MB at the bound)


class _Timed:
    """A host callback that counts its calls, its seconds and the distinct bank experts it read."""

    def __init__(self, call, bank: ExpertBank):
        self.call, self.bank = call, bank
        self.counts = {"calls": 0, "seconds": 0.0, "experts": 0}

    def __call__(self, x, ids, weights):
        start = time.perf_counter()
        y = self.call(x, ids, weights)
        ids = np.asarray(ids).reshape(-1)
        held = np.where(ids >= 0, self.bank.slot_of[ids], -1)
        self.counts["calls"] += 1
        self.counts["seconds"] += time.perf_counter() - start
        self.counts["experts"] += len(np.unique(held[held >= 0]))
        return y

    def stats(self, reset: bool) -> dict:
        out = dict(self.counts)
        if reset:
            self.counts = {"calls": 0, "seconds": 0.0, "experts": 0}
        return out


_CODE_DTYPES = {"fp4": np.int8, "fp8": ml_dtypes.float8_e4m3fn, "bf16": ml_dtypes.bfloat16}


def _mapped(weights: ExpertWeights, bank: ExpertBank, names: tuple[str, str]) -> ExpertWeights:
    """The ExpertWeights module `weights` over the bank's slots: its `weight` (and `scale`, where the
    format has one) replaced by device views of the bank's tensors `names` (codes in the kernel's
    dtype: int8 ds_fp4 bytes, e4m3, or bf16 for float experts, which a bank holds as bf16 values)."""
    graphdef, state = nnx.split(weights)
    device = jax.devices()[0]
    view = lambda name, dtype: mapped.device_view(bank.view(name).view(dtype), device, bank.data)  # noqa: E731
    pure = {"weight": view(names[0], _CODE_DTYPES[bank.fmt])}
    if "scale" in nnx.to_pure_dict(state):
        pure["scale"] = view(names[1], bank.view(names[1]).dtype)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _on_device(weights, ids: np.ndarray):
    """The same ExpertWeights module over the experts `ids` only, on the device: its arrays as they
    are where they already hold just those experts (len(ids) rows; a layer's arrays have more)."""
    graphdef, state = nnx.split(weights)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a if a.shape[0] == len(ids) else jax.device_put(a[ids]),
                                            state))


def _bank(experts: Experts, fmt: str, host: np.ndarray) -> ExpertBank:
    """A host bank of the experts `host` from their stored arrays (device or host memory)."""
    arrays = []
    for name in ("w1", "w3", "w2"):
        _, stored = getattr(experts, name).stored()
        arrays.append([np.asarray(a[host]) for a in stored])
    if fmt == "bf16":
        weights = [bf16_exact(a[0], name) for a, name in zip(arrays, ("w1", "w3", "w2"))]
        return ExpertBank.from_stacked("bf16", *weights, expert_ids=host, n_experts=experts.n_experts)
    (w1, s1), (w3, s3), (w2, s2) = arrays
    return ExpertBank.from_stacked(fmt, w1, w3, w2, s1, s3, s2, expert_ids=host,
                                   n_experts=experts.n_experts)


def _checked(bank: ExpertBank, fmt: str, host: np.ndarray, n_experts: int) -> ExpertBank:
    """`bank` if it holds exactly the experts `host` of a layer of `n_experts` in format `fmt`."""
    if bank.fmt != fmt or bank.n_experts != n_experts or not np.array_equal(np.sort(bank.expert_ids), host):
        raise ValueError(f"{bank.describe()} does not hold the layer's {len(host)} host experts in {fmt}: build it "
                         f"for those expert ids")
    return bank


def bf16_exact(weight: np.ndarray, name: str) -> np.ndarray:
    """Float experts as bf16 (the host banks' float format); float32 ones must be bf16 values."""
    as_bf16 = weight.astype(ml_dtypes.bfloat16)
    if weight.dtype != ml_dtypes.bfloat16 and not np.array_equal(as_bf16.astype(weight.dtype), weight):
        raise ValueError(f"{name}: float32 routed experts that are not bfloat16 values cannot live in a host bank "
                         "(it holds bf16, ds_fp4 or FP8): load the model in bfloat16 or keep its experts on the GPU")
    return as_bf16


def with_host_experts(model: Model, host: Mapping[int, Sequence[int]], *, threads: int | None = None,
                      banks: Mapping[int, ExpertBank] | None = None, via: str = "ffi",
                      pcie_share: float | None = 0.0) -> Model:
    """`model` with the routed experts host[layer] (main layer ids -> global expert ids) of each
    listed layer moved to host banks (`HybridExperts`); other layers and the parameters of everything
    else are unchanged (shared, not copied). `Placement.host_map()` gives `host` from a plan.
    `banks[layer]`, where given, already holds that layer's host experts (nothing is read from the
    model's arrays for them); `via`: how the step reaches the host GEMV; `pcie_share`: the share of
    a call's host experts the GPU reads over PCIe (`HybridExperts`; None: `default_pcie_share()`)."""
    pcie_share = default_pcie_share() if pcie_share is None else pcie_share
    module = model.module()
    n_layers = len(module.layers)
    for layer, ids in host.items():
        if not 0 <= int(layer) < n_layers:
            raise ValueError(f"layer {layer}: host experts are placed in main layers 0..{n_layers - 1}")
        moe = module.layers[int(layer)].ffn
        if not isinstance(moe, MoE) or type(moe.experts) is not Experts:
            raise ValueError(f"layer {layer}: expected a MoE layer with device experts, found {type(moe.experts)}")
        moe.experts = HybridExperts(moe.experts, ids, dtype=model.dtype, threads=threads,
                                    bank=(banks or {}).get(int(layer)), via=via, pcie_share=pcie_share)
    return Model(*nnx.split(module))


def host_banks(model: Model) -> dict[int, ExpertBank]:
    """main layer id -> the host bank of each hybrid layer of `model`."""
    return {i: layer.ffn.experts.bank for i, layer in enumerate(model.module().layers)
            if isinstance(layer.ffn.experts, HybridExperts)}


def is_main_expert(path: tuple) -> bool:
    """Whether the parameter at `path` is a routed-expert array of a main layer (what can move to the host)."""
    return len(path) >= 5 and path[0] == "layers" and path[2:4] == ("ffn", "experts") and path[4] in ("w1", "w3", "w2")


def plan_for(leaves: Mapping[tuple, jax.ShapeDtypeStruct], gpu_memory: float, *, top_k: int,
             counts=None) -> tuple[Placement, str]:
    """The placement of a model whose parameters are `leaves` (path -> shape) under `gpu_memory`
    bytes of weights on the GPU, and its start-up report. Everything but the main layers' routed
    experts stays on the GPU; the experts get what is left (`plan_placement`)."""
    n_layers = 1 + max((p[1] for p in leaves if is_main_expert(p)), default=-1)
    sizes = np.zeros((n_layers, 0), np.int64)
    other = 0
    for path, leaf in leaves.items():
        nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        if not is_main_expert(path):
            other += nbytes
            continue
        if sizes.shape[1] == 0:
            sizes = np.zeros((n_layers, leaf.shape[0]), np.int64)
        sizes[path[1]] += nbytes // leaf.shape[0]
    if gpu_memory < other:
        raise ValueError(f"gpu_memory={gpu_memory:.4g} bytes is less than the {other / 1e9:.3f} GB of weights that "
                         f"are not routed experts (they stay on the GPU): raise it")
    placement = plan_placement(sizes, gpu_memory - other, counts, top_k=top_k)
    gpu_gb, host_gb = (other + placement.gpu_bytes) / 1e9, placement.host_bytes / 1e9
    report = (f"placement: GPU {gpu_gb:.2f} GB / host {host_gb:.2f} GB, "
              f"host share of routed uses {100 * placement.host_share:.1f}%; {placement.report()}")
    return placement, report
