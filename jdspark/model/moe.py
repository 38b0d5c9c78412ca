"""MoE sublayer (spec §5.4): sqrt-softplus router (bias for selection only, hash layers route by
token id through `tid2eid`), renormalised and scaled weights, SwiGLU experts with the clamp, and one
shared expert. The routing weight multiplies h before w2, as in the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jdspark.config import DSV4Config
from jdspark.model.layers import Keys, Linear
from jdspark.model.quant_sim import fp8_sim
from jdspark.parallel import rules
from jdspark.parallel.mesh import EXPERT, TENSOR
from pallas_kernels import interpret_mode, resolve_implementation
from pallas_kernels import moe as moe_kernels


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32; limit 0 disables the clamp."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


class Gate(nnx.Module):
    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys):
        self.top_k, self.score_func = config.num_experts_per_tok, config.scoring_func
        self.route_scale = config.routed_scaling_factor
        self.hash = config.is_hash_layer(layer_id)
        e = config.n_routed_experts
        self.weight = nnx.Param(rngs.normal((e, config.hidden_size), dtype, config.hidden_size ** -0.5))
        if self.hash:
            self.tid2eid = nnx.Variable(rngs.distinct_choices(config.vocab_size, e, self.top_k))
        else:
            self.bias = nnx.Param(rngs.normal((e,), jnp.float32, 0.1))

    def __call__(self, x: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, D], ids [N] -> (weights [N, K] fp32, expert indices [N, K])."""
        logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        if self.score_func == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        elif self.score_func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jnp.sqrt(jax.nn.softplus(logits))
        if self.hash:
            idx = jnp.take(self.tid2eid[...], ids, axis=0)
        else:
            _, idx = jax.lax.top_k(scores + self.bias[...], self.top_k)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if self.score_func != "softmax":
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * self.route_scale, idx


class ExpertWeights(nnx.Module):
    """One projection of all routed experts, `weight` [E, out, in] in the model dtype. Quantized
    subclasses (`jdspark.model.quantized`) keep the checkpoint's compact storage instead."""

    fmt = "bf16"  # the stored format, as `stored` returns it and a host bank holds it

    def __init__(self, n_experts: int, in_features: int, out_features: int, *, dtype, rngs: Keys):
        self.weight = nnx.Param(rngs.normal((n_experts, out_features, in_features), dtype, in_features ** -0.5))

    def dense(self, dtype) -> jax.Array:
        """[E, out, in] in `dtype`; quantized subclasses dequantize here, inside the jit."""
        return self.weight[...].astype(dtype)

    def take(self, experts: jax.Array, dtype) -> jax.Array:
        """[M, out, in] in `dtype` of the experts `experts` [M]: only their stored arrays are read
        (gathered in the checkpoint's storage, then decoded); quantized subclasses decode here."""
        return jnp.take(self.weight[...], experts, axis=0).astype(dtype)

    def stored(self) -> tuple[str, tuple[jax.Array, ...]]:
        """(format, stored arrays) as the routed-expert kernel reads them (`pallas_kernels.moe`)."""
        return self.fmt, (self.weight[...],)


class Experts(nnx.Module):
    """Routed experts stacked on a leading E axis: w1, w3 [E, F, D], w2 [E, D, F]."""

    def __init__(self, config: DSV4Config, *, dtype, rngs: Keys, qat_sim: bool = False):
        e, f, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.w1 = ExpertWeights(e, d, f, dtype=dtype, rngs=rngs)
        self.w3 = ExpertWeights(e, d, f, dtype=dtype, rngs=rngs)
        self.w2 = ExpertWeights(e, f, d, dtype=dtype, rngs=rngs)
        self.n_experts = e
        self.limit = config.swiglu_limit
        self.qat_sim = qat_sim
        self.mesh = None  # a jax Mesh when the model is sharded (`jdspark.parallel.shard`): the EP path
        # "pallas": the in-place kernel (pallas_kernels.moe) where its sizes fit; "xla": the gather
        # below; "auto": the kernel on the GPU for experts of at least KERNEL_MIN_WEIGHTS weights
        # per projection (measured faster at Flash dims; smaller ones, e.g. the embedded model's,
        # are not measured with it and keep the gather).
        self.implementation = "auto"

    def _kernel(self, fmt: str, rows: int, d: int, f: int) -> bool:
        """Whether this call runs the in-place kernel (`implementation`, sizes, no QAT rounding of h)."""
        if self.qat_sim or resolve_implementation(self.implementation) != "pallas":
            return False
        if self.implementation == "auto" and d * f < KERNEL_MIN_WEIGHTS:
            return False
        return moe_kernels.supported(fmt, d, f, rows, n_experts=self.n_experts)

    def _kernel_runs(self, d: int) -> bool:
        """Whether calls of inputs of width d run the kernel in some form (`_kernel` at one row)."""
        fmt, (w1, *_) = self.w1.stored()
        return self._kernel(fmt, 1, d, w1.shape[1])

    def reads_per_expert(self, d: int) -> bool:
        """Whether calls (of inputs of width d) read only their distinct experts (the kernel's slot or
        grouped form), so that routing rows to fewer experts reads fewer bytes; the XLA gather reads
        its min(N K, E) slots whatever they hold. On a mesh, the kernel runs where each device holds
        whole experts (`_sharded`)."""
        return (self.mesh is None or self.mesh.shape[TENSOR] == 1) and self._kernel_runs(d)

    def _grouped(self, x: jax.Array) -> bool:
        """Whether a call of x [N, D] runs the kernel's grouped form (`pallas_kernels.moe.grouped_moe`):
        where the kernel would run and N >= GROUPED_MIN_ROWS (see there)."""
        if x.shape[0] < GROUPED_MIN_ROWS or not self._kernel_runs(x.shape[-1]):
            return False
        fmt, (w1, *_) = self.w1.stored()
        return moe_kernels.grouped_supported(fmt, x.shape[-1], w1.shape[1], n_experts=self.n_experts)

    def _grouped_call(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """The grouped form over idx [N, K] (-1: no expert) and its routing weights: fp32 [N, D]."""
        (fmt, w1), (_, w3), (_, w2) = self.w1.stored(), self.w3.stored(), self.w2.stored()
        return moe_kernels.grouped_moe(x, idx, weights, w1, w3, w2, fmt=fmt, limit=self.limit,
                                       interpret=interpret_mode())

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """x [N, D], routing weights [N, K] and expert indices [N, K] -> fp32 [N, D].

        Reads only the selected experts, each distinct one once (`expert_slots`: M = min(N*K, E)
        slots, static). Every row is computed against the M gathered experts and weighted by a dense
        [N, M] routing matrix, exactly zero where a row did not select the slot's expert: the same
        arithmetic as running every expert with a dense [N, E] matrix (the test oracle), restricted
        to the experts some row selected. Calls of GROUPED_MIN_ROWS rows or more, where the kernel
        runs, take its grouped form, which computes each row against its own K experts only. On a
        mesh, `_sharded`."""
        if self.mesh is not None:
            return self._sharded(x, weights, idx)
        if self._grouped(x):
            return self._grouped_call(x, weights, idx)
        experts, slot = expert_slots(idx, self.n_experts)
        return self._selected(x, experts, routing_matrix(weights, slot, experts.shape[0]), slot)

    def _selected(self, x: jax.Array, experts: jax.Array, dense: jax.Array, slot: jax.Array) -> jax.Array:
        """The weighted sum of `experts` [M] (bank indices) by dense [N, M]: the MoE kernel where it
        applies, else the gathered einsums."""
        fmt, w1 = self.w1.stored()
        (_, w3), (_, w2) = self.w3.stored(), self.w2.stored()
        if self._kernel(fmt, x.shape[0], x.shape[-1], w1[0].shape[1]):
            return moe_kernels.moe(x, experts, dense, slot, w1, w3, w2, fmt=fmt, limit=self.limit,
                                   interpret=interpret_mode())
        return sum_expert_outputs(self._outputs(x, experts, dense), x.dtype)

    def _outputs(self, x: jax.Array, experts: jax.Array, dense: jax.Array) -> jax.Array:
        """Each gathered expert's weighted output, fp32 [N, M, D] (before the rounding to x.dtype)."""
        dtype = x.dtype
        experts = jnp.maximum(experts, 0)  # a missing slot (-1) has routing weight 0: any expert stands in
        if self.qat_sim:
            x = fp8_sim(x, 128)
        gate = jnp.einsum("nd,efd->nef", x, self.w1.take(experts, dtype), preferred_element_type=jnp.float32)
        up = jnp.einsum("nd,efd->nef", x, self.w3.take(experts, dtype), preferred_element_type=jnp.float32)
        h = (swiglu(gate.astype(dtype), up.astype(dtype), self.limit) * dense[..., None]).astype(dtype)
        if self.qat_sim:
            h = fp8_sim(h, 128)
        return jnp.einsum("nef,edf->ned", h, self.w2.take(experts, dtype), preferred_element_type=jnp.float32)

    def _sharded(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        """Expert parallelism (shard_map): tokens and routing are replicated; each device holds
        E / ep experts (and F / tp of their width) and computes its own experts' part of every row
        (the other devices' experts routed nowhere), then the parts are summed in fp32 over `expert`.
        Whole experts on each device (tp 1) run the in-place kernel as unsharded calls do (the slot
        or grouped form, over the device's distinct experts only); split ones (tp > 1) the gather,
        whose width pieces are summed over `tensor` in fp32 before each expert's rounding to x.dtype,
        as unsharded (the kernel rounds inside)."""
        graphdef, params = nnx.split(self)
        n_local = self.n_experts // self.mesh.shape[EXPERT]
        in_place = self.reads_per_expert(x.shape[-1])

        def local(params, x, weights, idx):
            module = nnx.merge(graphdef, params)
            own = idx - jax.lax.axis_index(EXPERT) * n_local
            mine = (own >= 0) & (own < n_local)
            weights = jnp.where(mine, weights, 0.0)
            if in_place:
                own = jnp.where(mine, own, MISSING)  # another device's expert: no read here
                if module._grouped(x):
                    out = module._grouped_call(x, weights, own)
                else:
                    experts, slot = expert_slots(own, n_local + 1)  # + 1: room for MISSING beside all n_local
                    out = module._selected(x, experts, routing_matrix(weights, slot, experts.shape[0]), slot)
            else:
                experts, slot = expert_slots(jnp.where(mine, own, 0), n_local)
                dense = routing_matrix(weights, slot, experts.shape[0])
                out = sum_expert_outputs(jax.lax.psum(module._outputs(x, experts, dense), TENSOR), x.dtype)
            return jax.lax.psum(out, EXPERT)

        replicated = PartitionSpec()
        return jax.shard_map(local, mesh=self.mesh, in_specs=(rules.specs(params, ("experts",)), replicated,
                                                              replicated, replicated),
                             out_specs=replicated, check_vma=not in_place)(params, x, weights, idx)


def sum_expert_outputs(out: jax.Array, dtype) -> jax.Array:
    """[N, M, D] fp32 -> [N, D]: each expert's output rounded to the model dtype, summed in fp32 (the reference)."""
    return jnp.sum(out.astype(dtype).astype(jnp.float32), axis=1)


# Smallest D x F (routed experts) or N x K (FP8 linears, `quantized.FP8Linear`) for which "auto" picks
# the kernel on the GPU. Measured on the H200 (bench_decode, 2026-12-01) at Flash dims, 8 layers,
# ds_fp4: extend S=1 5.9 ms against 9.3 ms for the gather, S=6 16.1 against 35.2; the FP8 linears:
# docs/BENCHMARKS.md, "Decode at Flash dimensions".
KERNEL_MIN_WEIGHTS = 1 << 20

# Calls of this many rows or more run the kernel's grouped form (`pallas_kernels.moe.grouped_moe`):
# the slot form takes at most 64 rows, and past them the XLA gather decoded up to every expert of the
# layer to bf16 (4 GiB a layer at Flash dims: a verify of 16 x 6 rows, a prefill bucket). Measured on
# the H100 (bench_decode --moe-layer, 2026-12-05, one Flash-dims ds_fp4 layer): the two forms tie at
# 6 and 16 rows (0.65 / 1.06 ms), the grouped one is 1.07x faster at 32 rows and 1.77x at 64 (2.23
# against 3.95 ms). Calls of at most 31 rows keep the slot form, so a 1..6-row verify's rows stay
# bitwise those of one-row decoding (batch invariance).
GROUPED_MIN_ROWS = 32


def expert_slots(idx: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """The distinct experts of a call, with static shapes: idx [N, K] -> (experts [M] int32, for N > 1
    the distinct ones ascending and then the unused slots, slot [N, K] int32 with experts[slot] ==
    idx), M = min(N*K, E).

    Unused slots hold MISSING (-1): no row chooses them, the kernel reads nothing for them and the
    gather takes any expert at routing weight 0. (They had repeated expert E-1, which the kernel
    decoded once per padding slot: a verify block whose rows share experts has many.) jnp.unique
    (a sort, padded past every expert so it stays sorted) and jnp.searchsorted (all pairs
    compared). One row (decode) needs neither: its K choices are distinct already (top-k, or a row
    of the hash table), so they are the slots, in router order (~12 fewer kernels per MoE layer).
    A pairwise count over all choices (5aa3aae) gives the same slots in fewer kernels (standalone on
    the H200: 2 / 5 kernels, 0.10 ms, against 22 / 35 and 0.18 / 0.34 ms at N = 1 / 6), yet made the
    whole step slower there (one run at 57cf0e2, Flash dims, 8 layers, ds_fp4, context 4K): extend
    S=1 7.09 against 5.78 ms with the kernel, 11.33 against 9.20 with the XLA gather; S=6 18.60
    against 16.43 and 39.20 against 36.25."""
    n, k = idx.shape
    if n == 1:
        return idx[0].astype(jnp.int32), jnp.arange(k, dtype=jnp.int32)[None]
    m = min(n * k, n_experts)
    experts = jnp.unique(idx.reshape(-1).astype(jnp.int32), size=m, fill_value=n_experts)
    # compare_all, not the default binary search: that one is a while loop, which XLA runs outside the
    # step's CUDA graph with a device-to-host sync per iteration (~0.15 ms a layer on the H200)
    slot = jnp.searchsorted(experts, idx.astype(jnp.int32), side="left", method="compare_all")
    return jnp.where(experts < n_experts, experts, MISSING), slot.astype(jnp.int32)


MISSING = -1  # an unused slot's expert: read by no one


def routing_matrix(weights: jax.Array, slot: jax.Array, m: int) -> jax.Array:
    """dense [N, M] fp32: each row's routing weight on each slot (0 where it did not choose it)."""
    return jnp.sum(jax.nn.one_hot(slot, m, dtype=jnp.float32) * weights[..., None].astype(jnp.float32), axis=-2)


def routed_slots(weights: jax.Array, idx: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(experts [M], dense [N, M]): `expert_slots` and the `routing_matrix` of weights [N, K]."""
    experts, slot = expert_slots(idx, n_experts)
    return experts, routing_matrix(weights, slot, experts.shape[0])


def route_kept_rows_only(weights: jax.Array, idx: jax.Array, kept: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Routing [N, K] in which a row the call does not keep (kept [N] false: past a slot's n_valid, a
    padding row of a batch bucket) takes the first kept row's experts with weight 0: it adds no
    expert to the call's reads (a verify of mixed widths or a part-full bucket reads the experts of
    its kept rows only, on the device and on the host) and, weighted 0, nothing to any output. The
    kept rows' routing is untouched."""
    first = jnp.argmax(kept)  # 0 when no row is kept: that call's reads do not matter
    return jnp.where(kept[:, None], weights, 0.0), jnp.where(kept[:, None], idx, idx[first][None])


class SharedExpert(nnx.Module):
    def __init__(self, config: DSV4Config, *, dtype, rngs: Keys, qat_sim: bool = False):
        d, f, qat = config.hidden_size, config.moe_intermediate_size, qat_sim
        self.w1 = Linear(d, f, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.w3 = Linear(d, f, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.w2 = Linear(f, d, dtype=dtype, rngs=rngs, fp8_input=qat)
        self.limit = config.swiglu_limit

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).astype(x.dtype))


class MoE(nnx.Module):
    def __init__(self, config: DSV4Config, layer_id: int, *, dtype, rngs: Keys, qat_sim: bool = False):
        self.gate = Gate(config, layer_id, dtype=dtype, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, rngs=rngs, qat_sim=qat_sim)
        self.shared_experts = SharedExpert(config, dtype=dtype, rngs=rngs, qat_sim=qat_sim)

    def __call__(self, x: jax.Array, ids: jax.Array, kept: jax.Array | None = None) -> jax.Array:
        """x [B, S, D] (after ffn_norm), ids [B, S] -> [B, S, D] in x.dtype. kept [B, S] bool: the
        rows the call keeps (None: all); where the experts read per expert, the others read none
        (`route_kept_rows_only`; elsewhere it would only add operations to the step)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx = self.gate(flat, ids.reshape(-1))
        if kept is not None and self.experts.reads_per_expert(shape[-1]):
            weights, idx = route_kept_rows_only(weights, idx, kept.reshape(-1))
        y = self.experts(flat, weights, idx) + self.shared_experts(flat).astype(jnp.float32)
        return y.astype(x.dtype).reshape(shape)
