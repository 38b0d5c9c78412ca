"""Decode and verify at real dimensions: ms per `extend` call against the bytes a call must read.

Builds a DSV4 of any dimensions (presets tiny / flash / pro, `--layers`, `--experts`) in the
checkpoint's storage (`--storage fp8+fp4`: FP8 linears + ds_fp4 experts; `bf16`: everything in
bfloat16) with random weights drawn on the device (no checkpoint on disk), sets every slot of a decode
state to `--context` tokens (the caches hold zeros: attention reads them all the same), and times the
target's `extend` at S = 1..6 rows for batch B (median of `--runs` calls after warm-up, each call
rolled back by `commit(0)` so the context stays fixed).

Per row it prints ms per call, the bytes the call must read, the achieved GB/s and that as a share of
the copy bandwidth measured in the same run ("bandwidth achieved", as gpt-fast prints it), and the
share of the floor (bytes / copy bandwidth); then the same for calls queued back to back ("queued":
issued without waiting for the one before, synced once, each appending to the state the one before
left, as an overlapped engine steps), where the host's dispatch hides behind the device's work.
`--profile` also prints how long an empty program with the call's argument buffers takes to return
(the host's per-argument cost). The bytes are:
- every non-routed parameter once (attention, compressor, indexer, shared expert, router, mHC, norms,
  head), the embedding rows of the call's tokens only;
- the distinct routed experts of the call, per layer: E * (1 - (1 - K/E)^(B*S)), the expected count
  when each row picks K distinct experts uniformly (what random routing does);
- the KV the rows attend to: the window ring, per CSA layer the indexer's compressed keys (all
  visible entries) and the top-k selected entries, per HCA layer every visible entry.

`--variants` compares implementations in one run: `current` (the code as it is: on the GPU the routed
experts and the FP8 linears take their kernels at real dims), `fp8_xla` (the FP8 linears but `wo_a`
through XLA's block-scaled partial dots, `fp8_block_matmul`; `wo_a`'s grouped product keeps the
kernel), `xla` (the routed experts through the XLA gather), `ref_moe` (the former routed-expert path:
every expert decoded and run on every row), `dequant_linear` (FP8 linears but `wo_a` decoding a
bfloat16 weight per call), `fp8_scaled_x` (FP8 linears but `wo_a` of <= 16 rows as one batched dot
with the block scales applied to x: `jdspark.model.dequant.fp8_scaled_x_matmul`), `before` (the
former MoE and linears), `pallas` (the routed experts through the in-place kernel
`pallas_kernels.moe`), `swapped_tiles` (that kernel's tiling before ceec0a2), `fp8_rows_first` (the FP8
linear kernel with the rows on the MMA's M side), `grouped` (the routed-expert kernel's grouped form at
every row count: the model takes it from `moe.GROUPED_MIN_ROWS` rows), `padding_read` (the kernel's unused slots re-reading
expert E-1, as before they were missing), `pallas_gemv` (that kernel with one row in its gemv form, the former default:
faster alone, but a decode then rounds differently from the verify of the same row), `per_layer`
(every block traced and lowered on its own, not once per kind: `block.shared_extend`; compile time
and run time beside `current`).
`--kept 1 3` also times each S-row call with every row keeping only that many tokens (n_valid): a
narrower verify run in a wider executable (per-request widths), through the same compiled program;
its dropped rows read no routed expert, so this measures what per-width executables still save.
`--params packed separate` times both ways of passing the parameters (packed: as the engine does on
the GPU). `--fp8-linears 1 6` and `--moe-layer 1 2 6 --sweep` first time the kernels alone, in
device time (the kernels of a `jax.profiler` trace). JSON with every row: `--json PATH`.

    PYTHONPATH=$PWD python scripts/bench_decode.py --preset flash --layers 8 --experts 256 \
        --storage fp8+fp4 --rows 1 6 --context 4096 --json /tmp/bench_decode.json
    PYTHONPATH=$PWD python scripts/bench_decode.py --preset tiny --rows 1 2 --runs 3   # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.config import CSA_RATIO, EngineConfig, QuantConfig, flash_config, pro_config, tiny_config
from jdspark.engine.packed import SMALL_BYTES, PackedParams, kernel_scales
from jdspark.model import dsv4
from jdspark.model import moe as moe_module
from jdspark.model import state as state_lib
from jdspark.model.dequant import (E2M1_VALUES, FP4_BLOCK, FP8_BLOCK, fp8_block_dequant, fp8_block_matmul,
                                   fp8_scaled_x_matmul)
from jdspark.model.moe import Experts, expert_slots, routed_slots, swiglu
from jdspark.model.quant_sim import fp8_sim
from jdspark.model.quantized import FP8Linear, Storage, abstract_model, is_expert, is_weight_scale
from jdspark.profile import gpu_kernel_events, host_summary
from pallas_kernels import fp8_linear as fp8_kernels
from pallas_kernels import moe as moe_kernels

WARM_S = 0.5  # copies before the copy bandwidth is timed (clocks up)

PRESETS = {"tiny": tiny_config, "flash": flash_config, "pro": pro_config}
STORAGES = {"bf16": Storage(), "fp8+fp4": Storage(linears="fp8", experts="fp4", scale_dtype="e8m0"),
            "fp8": Storage(linears="fp8", experts="fp8", scale_dtype="e8m0")}
E4M3_SPREAD = 64.0  # random e4m3 codes ~ N(0, 64^2), as jdspark.checkpoint.synthetic writes them
_E2M1_RMS = float(np.sqrt(np.mean(E2M1_VALUES ** 2)))


def make_config(preset: str, layers: int | None, experts: int | None, storage: str):
    base = PRESETS[preset]()
    n_layers = min(layers or base.num_hidden_layers, base.num_hidden_layers)
    over = dict(num_hidden_layers=n_layers, num_nextn_predict_layers=0,
                compress_ratios=tuple(base.compress_ratios[:n_layers]),
                num_hash_layers=min(base.num_hash_layers, n_layers))
    if experts:
        over.update(n_routed_experts=experts, num_experts_per_tok=min(base.num_experts_per_tok, experts))
    if storage == "bf16":
        over.update(expert_dtype=None, quantization=None)
    else:
        over.update(expert_dtype="fp4" if storage == "fp8+fp4" else "fp8", quantization=QuantConfig())
    return PRESETS[preset](**over)


# ---- random parameters in the checkpoint's storage, drawn on the device -------------------------

def _scale_byte(fan_in: int, fp4: bool) -> int:
    scale = fan_in ** -0.5 / (_E2M1_RMS if fp4 else E4M3_SPREAD)
    return round(math.log2(scale)) + 127


def random_params(config, dtype, storage: Storage, seed: int = 0, skip=None):
    """(graphdef, params) of `config` in `storage`, every array drawn on the default device except
    those whose path `skip(path)` names: they stay abstract (jax.ShapeDtypeStruct), for what will live
    elsewhere (scripts/bench_flash.py: host experts)."""
    graphdef, abstract = abstract_model(config, dtype, storage)
    pure = nnx.to_pure_dict(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    key = jax.random.key(seed)
    out = []
    for i, (kp, leaf) in enumerate(leaves):
        path = tuple(k.key for k in kp)
        if skip is not None and skip(path):
            out.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            continue
        out.append(_random_leaf(jax.random.fold_in(key, i), path, tuple(leaf.shape), jnp.dtype(leaf.dtype),
                                config, storage))
    nnx.replace_by_pure_dict(abstract, jax.tree_util.tree_unflatten(treedef, out))
    return graphdef, abstract


def _random_leaf(key, path, shape, dtype, config, storage):
    fp4 = is_expert(path) and storage.experts == "fp4"
    if path[-1] == "scale":
        fan_in = shape[-1] * (FP4_BLOCK if fp4 else FP8_BLOCK)
        if dtype == jnp.uint8:
            return jnp.full(shape, _scale_byte(fan_in, fp4), jnp.uint8)
        return jnp.full(shape, 2.0 ** (_scale_byte(fan_in, fp4) - 127), dtype)
    return _draw(key, shape, dtype.name, config.n_routed_experts)


def _draw(key, shape, dtype_name, n_experts):
    return _draw_jit(key, shape=shape, dtype_name=dtype_name, n_experts=n_experts)


@jax.jit
def _copy(x):
    return x * 2


@partial(jax.jit, static_argnames=("shape", "dtype_name", "n_experts"))
def _draw_jit(key, *, shape, dtype_name, n_experts):
    dtype = jnp.dtype(dtype_name)
    if dtype == jnp.int8:  # two random E2M1 codes per byte
        return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8), jnp.int8)
    if dtype == jnp.float8_e4m3fn:
        return jnp.clip(jax.random.normal(key, shape, jnp.float32) * E4M3_SPREAD, -448, 448).astype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):  # tid2eid [vocab, K]: distinct experts per token
        rows, k = shape
        return jnp.argsort(jax.random.uniform(key, (rows, n_experts)), axis=-1)[:, :k].astype(dtype)
    if len(shape) >= 2:
        return (jax.random.normal(key, shape, jnp.float32) * shape[-1] ** -0.5).astype(dtype)
    return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# ---- the bytes a call must read ------------------------------------------------------------------

def nbytes(x) -> int:
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def param_bytes(params) -> dict[str, float]:
    """Bytes of the routed experts per layer per expert, and of everything else (embed excluded)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
    experts, other, embed = 0, 0, 0
    for kp, x in leaves:
        path = tuple(k.key for k in kp)
        if is_expert(path):
            experts += nbytes(x)
        elif path[0] == "embed":
            embed += nbytes(x)
        else:
            other += nbytes(x)
    return {"experts": experts, "other": other, "embed": embed}


def kv_bytes(config, context: int, batch: int, rows: int, dtype) -> int:
    """KV a call attends to: window ring, CSA indexer keys + top-k entries, HCA entries (per slot)."""
    item = jnp.dtype(dtype).itemsize
    total = 0
    ctx = context + rows
    for layer in range(config.num_hidden_layers):
        ratio = config.layer_ratio(layer)
        total += min(ctx, config.sliding_window) * config.head_dim * item
        if ratio == CSA_RATIO:
            entries = ctx // ratio
            total += entries * config.index_head_dim * item + min(entries, config.index_topk) * config.head_dim * item
        elif ratio:
            total += ctx // ratio * config.head_dim * item
    return total * batch


def call_bytes(config, sizes, context, batch, rows, dtype) -> dict[str, float]:
    e, k, tokens = config.n_routed_experts, config.num_experts_per_tok, batch * rows
    distinct = e * (1 - (1 - k / e) ** tokens)
    per_expert = sizes["experts"] / (config.num_hidden_layers * e)
    out = {"weights": sizes["other"] + tokens * config.hidden_size * jnp.dtype(dtype).itemsize,
           "experts": distinct * per_expert * config.num_hidden_layers,
           "kv": kv_bytes(config, context, batch, rows, dtype), "distinct_experts_per_layer": distinct}
    out["total"] = out["weights"] + out["experts"] + out["kv"]
    return out


def copy_bandwidth(n_bytes: int, runs: int = 20, queued: int = 10) -> float:
    """Bytes/s of an elementwise bf16 read + write through XLA: the fastest of `runs` samples of `queued`
    copies issued back to back and synced once, after WARM_S of copies (clocks up). Timed one copy at a
    time, first thing in the process, it had read 2154 and 2581 GB/s on one H200 in two runs of one
    session (2734-2856 in earlier ones), and every floor moved with it."""
    if runs < 1 or queued < 1:
        raise ValueError(f"runs={runs}, queued={queued}: each must be >= 1")
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    _copy(x).block_until_ready()  # compiled outside the warm-up
    start = time.perf_counter()
    while time.perf_counter() - start < WARM_S:
        _copy(x).block_until_ready()
    best = float("inf")
    for _ in range(runs):
        begin = time.perf_counter()
        for _ in range(queued):
            y = _copy(x)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - begin) / queued)
    del x, y
    return 2 * n_bytes / best


# ---- implementations compared ----------------------------------------------------------------------

def _ref_experts(self, x, weights, idx):
    """The former routed-expert path: every expert decoded and run on every row."""
    dense = jnp.sum(jax.nn.one_hot(idx, self.n_experts, dtype=jnp.float32) * weights[..., None], axis=-2)
    dtype = x.dtype
    if self.qat_sim:
        x = fp8_sim(x, 128)
    gate = jnp.einsum("nd,efd->nef", x, self.w1.dense(dtype), preferred_element_type=jnp.float32)
    up = jnp.einsum("nd,efd->nef", x, self.w3.dense(dtype), preferred_element_type=jnp.float32)
    h = (swiglu(gate.astype(dtype), up.astype(dtype), self.limit) * dense[..., None]).astype(dtype)
    if self.qat_sim:
        h = fp8_sim(h, 128)
    out = jnp.einsum("nef,edf->ned", h, self.w2.dense(dtype), preferred_element_type=jnp.float32)
    return jnp.sum(out.astype(dtype).astype(jnp.float32), axis=1)


def _dequant_project(self, x, dtype):
    """The former FP8 linear: decode a weight copy in `dtype`, then one dot."""
    return jnp.einsum("...i,oi->...o", x, fp8_block_dequant(self.weight[...], self.scale[...], dtype),
                      preferred_element_type=jnp.float32)


def _scaled_x_project(self, x, dtype):
    """FP8 linears as one batched dot over output blocks with the scales on x (few rows only)."""
    rows = math.prod(x.shape[:-1])
    if rows > 16 or self.weight.shape[0] % 128:
        return fp8_block_matmul(x, self.weight[...], self.scale[...], dtype)
    return fp8_scaled_x_matmul(x, self.weight[...], self.scale[...], dtype)


def _xla_block_project(self, x, dtype):
    """FP8 linears through XLA's block-scaled partial dots (the accelerator path before the kernel)."""
    return fp8_block_matmul(x, self.weight[...], self.scale[...], dtype)


PATCHES = {"current": [], "ref_moe": [(Experts, "__call__", _ref_experts)],
           "fp8_xla": [(FP8Linear, "project", _xla_block_project)],
           "fp8_scaled_x": [(FP8Linear, "project", _scaled_x_project)],
           "dequant_linear": [(FP8Linear, "project", _dequant_project)]}
PATCHES["before"] = PATCHES["ref_moe"] + PATCHES["dequant_linear"]
# Variants that set the routed experts' `implementation` in the graph ("pallas": pallas_kernels.moe).
EXPERTS_IMPLEMENTATION = {"pallas": "pallas", "xla": "xla", "ref_moe": "xla", "before": "xla"}
PATCHES["pallas"] = PATCHES["xla"] = []
# "pallas_gemv": one row in the kernel's gemv form (faster alone, not batch-invariant with the dot form).
PATCHES["pallas_gemv"] = [(moe_kernels, "TILES", dataclasses.replace(moe_kernels.TILES, gemv_rows=1, gemv_out=16))]
EXPERTS_IMPLEMENTATION["pallas_gemv"] = "pallas"
# "fp8_rows_first": the FP8 linear kernel with the rows on the MMA's M side (x @ w_tile^T).
PATCHES["fp8_rows_first"] = [(fp8_kernels, "TILES", dataclasses.replace(fp8_kernels.TILES, swap=False))]
# "swapped_tiles": the kernel's tiling before ceec0a2 (weights on the MMA's M side, 64 outputs x 256 inputs a step).
PATCHES["swapped_tiles"] = [(moe_kernels, "TILES", moe_kernels.Tiles(out=64, num_stages=3, decode="prmt", swap=True))]


def _slots_padded_with_last_expert(idx, n_experts):
    """`expert_slots` before unused slots were missing (-1): they repeated expert E-1, which the
    kernel decoded once per unused slot."""
    experts, slot = _EXPERT_SLOTS(idx, n_experts)
    return jnp.where(experts >= 0, experts, n_experts - 1), slot


_EXPERT_SLOTS = moe_module.expert_slots
# "padding_read": the routed experts' unused slots re-read expert E-1 (the kernel before this session).
PATCHES["padding_read"] = [(moe_module, "expert_slots", _slots_padded_with_last_expert)]
# "grouped": the kernel's grouped form at every row count (the model takes it from GROUPED_MIN_ROWS rows).
PATCHES["grouped"] = [(moe_module, "GROUPED_MIN_ROWS", 1)]
EXPERTS_IMPLEMENTATION["grouped"] = "pallas"


def with_experts_implementation(graphdef, params, name: str):
    """graphdef with every `Experts.implementation` set for variant `name` (others: as built)."""
    if name not in EXPERTS_IMPLEMENTATION:
        return graphdef
    module = nnx.merge(graphdef, params)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, Experts):
            node.implementation = EXPERTS_IMPLEMENTATION[name]
    return nnx.split(module)[0]


def per_layer_extend():
    """Each block traced and lowered on its own (before `block.shared_extend` shared one trace per kind)."""
    return lambda block, *args: block.extend(*args)


PATCHES["per_layer"] = [(dsv4, "shared_extend", per_layer_extend)]


def register_variant(name: str, patches: list) -> None:
    """Add an implementation to compare (a list of (class, attribute, function) swaps)."""
    PATCHES[name] = patches


@contextlib.contextmanager
def variant(name: str):
    saved = [(cls, attr, cls.__dict__[attr]) for cls, attr, _ in PATCHES[name]]
    try:
        for cls, attr, fn in PATCHES[name]:
            setattr(cls, attr, fn)
        yield
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)


# ---- timing ----------------------------------------------------------------------------------------

class Stepper:
    """One decode or verify call of the engine's shape: extend at [batch, rows] after `context` tokens
    (the state donated and returned, as the engine runs it), then `commit(0)` so the context stays
    fixed. packed: the parameters travel as the engine passes them on the GPU (`jdspark.engine.packed`:
    the small tensors in a few flat buffers), else one argument per tensor."""

    def __init__(self, graphdef, params, config, engine, dtype, batch, rows, context, mode="packed"):
        donated = mode == "donated"
        apart = is_weight_scale if mode == "scales-apart" else None if mode == "all-packed" else \
            kernel_scales(params, "auto")  # the engine's packing
        pack = PackedParams(params, None if mode == "separate" else SMALL_BYTES, apart=apart)

        def extend(arrays, decode, ids, n_valid, out):
            logits, _, new = nnx.merge(graphdef, pack.unpack(arrays)).extend(ids, decode, n_valid)
            return logits, new

        decode = jax.tree.map(jnp.zeros_like, state_lib.init_state(config, engine, dtype))  # finite pooled entries
        self.decode = decode.replace(length=jnp.full((batch,), context, jnp.int32))
        self.room = engine.max_seq_len - context  # tokens the calls may append
        self.ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, rows)), jnp.int32)
        self.n_valid, self.zero = jnp.full((batch,), rows, jnp.int32), jnp.zeros((batch,), jnp.int32)
        self.context = context
        self.params = pack.arrays
        # donated: the logits are written into the previous call's logits (a donated argument of their shape), so
        # every buffer the call's CUDA graph touches keeps its address. keep_unused: extend reads neither that
        # argument nor the state's `written`; dropped from the program, their outputs would move every call
        logits = jax.eval_shape(extend, self.params, self.decode, self.ids, self.n_valid, None)[0]
        self.out = jnp.zeros(logits.shape, logits.dtype) if donated else None
        start = time.perf_counter()
        self.compiled = jax.jit(extend, donate_argnums=(1, 4) if donated else 1, keep_unused=True).lower(
            self.params, self.decode, self.ids, self.n_valid, self.out).compile()
        self.compile_s = time.perf_counter() - start
        self.commit = jax.jit(state_lib.commit, donate_argnums=0)
        self.dispatch_s: list[float] = []  # per call: until the call returned (enqueued), before the sync
        self.addresses: list[tuple[int, ...]] = []  # per call: the state's device buffer addresses

    def keep(self, kept: int) -> None:
        """From now on every row keeps `kept` of its tokens (n_valid: a narrower verify in this call's
        executable), from the starting context again (`queued` leaves it grown)."""
        self.n_valid = jnp.full_like(self.n_valid, kept)
        self.decode = self.decode.replace(length=jnp.full_like(self.decode.length, self.context))

    def __call__(self) -> float:
        """Seconds of one extend call (dispatch to logits ready); the rollback after it is not timed."""
        self.addresses.append(buffer_addresses(self.decode))
        start = time.perf_counter()
        logits, self.decode = self.compiled(self.params, self.decode, self.ids, self.n_valid, self.out)
        self.dispatch_s.append(time.perf_counter() - start)
        logits.block_until_ready()
        if self.out is not None:
            self.out = logits
        seconds = time.perf_counter() - start
        self.decode = self.commit(self.decode, self.zero)
        return seconds

    def queued(self, calls: int) -> float:
        """Seconds a call when `calls` calls are issued back to back and synced once at the end: the
        rate of a decode loop that issues a call before the one before it finished, so the host's
        dispatch overlaps the device's work (`__call__` serializes them). The calls append, as decoding
        does (no rollback between them: its own small launches would sit between the graphs), so the
        context grows by rows a call; the Stepper is spent afterwards."""
        calls = min(calls, self.room // self.ids.shape[1] - 1)  # the appended tokens fit the cache
        # a first call (its dispatch not timed, as a loop's first would be)
        logits, self.decode = self.compiled(self.params, self.decode, self.ids, self.n_valid, self.out)
        self.out = logits if self.out is not None else None
        jax.block_until_ready(self.decode)
        start = time.perf_counter()
        for _ in range(calls):
            logits, self.decode = self.compiled(self.params, self.decode, self.ids, self.n_valid, self.out)
            self.out = logits if self.out is not None else None
        jax.block_until_ready((logits, self.decode))
        return (time.perf_counter() - start) / calls

    def empty_dispatch_s(self, calls: int = 20) -> float:
        """Median seconds until an empty program with this call's arguments returns (same donation):
        what JAX and the runtime cost per call before any of the model's work is launched."""
        logits = self.compiled.out_info[0]
        empty = jax.jit(lambda arrays, decode, ids, n_valid, out: (jnp.zeros(logits.shape, logits.dtype), decode),
                        donate_argnums=1, keep_unused=True)
        times = []
        for _ in range(calls + 3):
            start = time.perf_counter()
            out, self.decode = empty(self.params, self.decode, self.ids, self.n_valid, self.out)
            times.append(time.perf_counter() - start)
            jax.block_until_ready((out, self.decode))
        return statistics.median(times[3:])


def buffer_addresses(tree) -> tuple[int, ...]:
    """Device addresses of a pytree's buffers (an address that changes between calls makes XLA update
    the call's CUDA graph)."""
    return tuple(x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree))


def time_extend(graphdef, params, config, engine, dtype, batch, rows, context, runs, warmup=2, mode="packed",
                kept=(None,)) -> list[tuple[float, float, float]]:
    """[(median ms, queued ms, compile s)] of extend at [batch, rows] after `context` tokens, rolled back
    each time: one call at a time (dispatch to logits ready), and the rate of calls issued back to back;
    one entry per `kept` (n_valid of every row; None: all `rows`), all through one compiled executable."""
    step = Stepper(graphdef, params, config, engine, dtype, batch, rows, context, mode)
    out = []
    for k in kept:
        step.keep(rows if k is None else k)
        times = [step() for _ in range(warmup + runs)][warmup:]
        out.append((statistics.median(times) * 1e3, step.queued(runs) * 1e3, step.compile_s))
    return out


def moe_layer_rows(config, storage, dtype, rows_list, runs, bandwidth) -> list[dict]:
    """One routed-expert layer alone (layer 0 of a 1-layer `config`), per implementation:
    ms per call of Experts(x [R, D], weights, idx) with R rows choosing K experts at random.
    "pallas" is what the model runs (the kernel's slot form, its grouped form from GROUPED_MIN_ROWS
    rows), "grouped" the grouped form below that too."""
    graphdef, params = random_params(config, dtype, storage)
    experts = nnx.merge(graphdef, params).layers[0].ffn.experts
    per_expert = sum(nbytes(a) for a in jax.tree.leaves(nnx.state(experts))) / config.n_routed_experts
    out = []
    for rows in rows_list:
        rng = np.random.default_rng(rows)
        idx = jnp.asarray(np.stack([rng.permutation(config.n_routed_experts)[:config.num_experts_per_tok]
                                    for _ in range(rows)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1, idx.shape), jnp.float32)
        x = jnp.asarray(rng.standard_normal((rows, config.hidden_size)), dtype)
        distinct = len(np.unique(np.asarray(idx)))
        for impl in ("xla", "pallas", "grouped", "every_expert"):
            if impl == "grouped" and rows >= moe_module.GROUPED_MIN_ROWS:
                continue  # "pallas" is the grouped form already
            experts.implementation = {"every_expert": "xla", "grouped": "pallas"}.get(impl, impl)
            fn = _ref_experts if impl == "every_expert" else (lambda m, x, w, i: m(x, w, i))
            try:
                start = time.perf_counter()
                with variant("grouped" if impl == "grouped" else "current"):
                    compiled = jax.jit(fn).lower(experts, x, w, idx).compile()
                compile_s = time.perf_counter() - start
                for _ in range(3):
                    compiled(experts, x, w, idx).block_until_ready()
                times = []
                for _ in range(runs):
                    start = time.perf_counter()
                    compiled(experts, x, w, idx).block_until_ready()
                    times.append(time.perf_counter() - start)
                ms = statistics.median(times) * 1e3
                floor = distinct * per_expert / bandwidth * 1e3
                row = {"impl": impl, "rows": rows, "ms": ms, "distinct": distinct, "floor_ms": floor,
                       "bandwidth_achieved": floor / ms, "compile_s": compile_s}
                print(f"  moe layer {impl:>12} R={rows:>2} {ms:8.3f} ms  floor {floor:6.3f} ms  "
                      f"bandwidth achieved {floor / ms:6.1%}  compile {compile_s:5.1f} s", flush=True)
            except Exception as err:
                row = {"impl": impl, "rows": rows, "error": f"{type(err).__name__}: {err}"[:2000]}
                print(f"  moe layer {impl:>12} R={rows:>2} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
            out.append(row)
    return out, experts


_T = moe_kernels.Tiles
_G16 = dict(out=16, num_stages=3, decode="prmt", gemv_rows=moe_kernels.GEMV_MAX_ROWS)  # the R = 1 winner
_S64 = dict(out=64, num_stages=3, decode="prmt", swap=True)  # the R = 6 winner until ceec0a2
SWEEP = [moe_kernels.TILES, _T(**_G16), _T(**{**_G16, "out": 8}), _T(**_S64), _T(**{**_S64, "step_fp4": 512}),
         _T(**{**_S64, "out": 32}), _T(**{**_S64, "num_stages": 2}), _T(**{**_S64, "num_warps": 2})]


def traced_kernels(fn, args, runs, python: bool = True) -> list[dict]:
    """The GPU kernels of a `jax.profiler` trace of `runs` calls of fn(*args), after 3 untraced ones."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))

    def calls():
        for _ in range(runs):
            out = fn(*args)
        jax.block_until_ready(out)
    return gpu_kernel_events(calls, python=python)


def device_ms(fn, args, runs) -> float:
    """Device time of one call: the kernels' durations in a trace of `runs` calls (`traced_kernels`),
    summed and divided by `runs`. Launch gaps and dispatch do not count, so kernels compare on what
    they cost the GPU."""
    return sum(k["dur"] for k in traced_kernels(fn, args, runs)) / runs / 1e3


def _median_ms(fn, args, runs) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_sweep(experts, rows_list, runs, bandwidth) -> list[dict]:
    """pallas_kernels.moe alone (routing precomputed) for each tiling of SWEEP (the first: the
    default): device ms (`device_ms`), error against ref_moe, the fastest per row count; plus the
    XLA glue around it (routed_slots, wall ms)."""
    fmt, w1 = experts.w1.stored()
    (_, w3), (_, w2) = experts.w3.stored(), experts.w2.stored()
    per_expert = sum(nbytes(a) for a in jax.tree.leaves(nnx.state(experts))) / experts.n_experts
    out = []
    for rows in rows_list:
        best = (float("inf"), None)
        rng = np.random.default_rng(100 + rows)
        k = 6 if experts.n_experts >= 6 else experts.n_experts
        idx = jnp.asarray(np.stack([rng.permutation(experts.n_experts)[:k] for _ in range(rows)]), jnp.int32)
        w = jnp.asarray(rng.uniform(0.1, 1, idx.shape), jnp.float32)
        x = jnp.asarray(rng.standard_normal((rows, w1[0].shape[-1] * (2 if fmt == "fp4" else 1))), jnp.bfloat16)
        slots = jax.jit(lambda w, i: routed_slots(w, i, experts.n_experts))
        e_, dense = slots(w, idx)
        slot = expert_slots(idx, experts.n_experts)[1]
        glue = _median_ms(slots, (w, idx), runs)
        want = jax.jit(partial(moe_kernels.ref_moe, fmt=fmt, limit=experts.limit))(x, e_, dense, slot, w1, w3, w2)
        floor = len(np.unique(np.asarray(idx))) * per_expert / bandwidth * 1e3
        print(f"  routed_slots R={rows}: {glue:.3f} ms", flush=True)
        for i, tiles in enumerate(SWEEP):
            try:
                fn = jax.jit(partial(moe_kernels.moe, fmt=fmt, limit=experts.limit, tiles=tiles,
                                     interpret=jax.default_backend() == "cpu"))
                got = fn(x, e_, dense, slot, w1, w3, w2)
                err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
                ms = device_ms(fn, (x, e_, dense, slot, w1, w3, w2), runs)
                best = min(best, (ms, i))
                row = {"tiles": dataclasses.asdict(tiles), "rows": rows, "ms": ms, "rel_err": err,
                       "bandwidth_achieved": floor / ms}
                print(f"  kernel {i} {tiles} R={rows:>2}: {ms:7.3f} ms, {floor / ms:6.1%} of floor, "
                      f"max err {err:.1e}", flush=True)
            except Exception as exc:
                row = {"tiles": dataclasses.asdict(tiles), "rows": rows, "error": f"{type(exc).__name__}: {exc}"[:1500]}
                print(f"  kernel {i} {tiles} R={rows:>2}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            out.append(row)
        print(f"  fastest at R={rows}: kernel {best[1]}, {best[0]:.3f} ms", flush=True)
    return out


# FP8 linears of DeepSeek-V4-Flash, [N, K]: attention wq_a, wq_b, wkv, wo_b; indexer wq_b; shared expert w1 / w2.
FP8_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
              "index_wq_b": (8192, 1024), "shared_w1": (2048, 4096), "shared_w2": (4096, 2048)}
_F8 = fp8_kernels.Tiles
FP8_SWEEP = [fp8_kernels.TILES, _F8(swap=False), _F8(swap=False, out=32), _F8(swap=False, out=128), _F8(out=32)]


def fp8_sweep(rows_list, runs, bandwidth) -> list[dict]:
    """The FP8 linears of Flash alone: device ms of the XLA forms (`fp8_block_matmul`,
    `fp8_scaled_x_matmul`) and of `pallas_kernels.fp8_linear` for each tiling of FP8_SWEEP, with the
    error against `ref_fp8_linear` and the bandwidth achieved on the weight's bytes."""
    out = []
    rng = np.random.default_rng(0)
    for name, (n, k) in FP8_SHAPES.items():
        raw = rng.integers(0, 256, (n, k), dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0
        w = jnp.asarray(raw).view(jnp.float8_e4m3fn)
        s = jnp.asarray(rng.integers(114, 120, (n // 128, k // 128)), jnp.uint8)
        floor = (n * k + s.size) / bandwidth * 1e3
        for rows in rows_list:
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
            want = jax.jit(fp8_kernels.ref_fp8_linear)(x, w, s)
            forms = [("xla_block", jax.jit(partial(fp8_block_matmul, dtype=jnp.bfloat16))),
                     ("xla_scaled_x", jax.jit(partial(fp8_scaled_x_matmul, dtype=jnp.bfloat16)))]
            forms += [(f"kernel {i}", jax.jit(partial(fp8_kernels.fp8_linear, tiles=t)))
                      for i, t in enumerate(FP8_SWEEP)]
            for form, fn in forms:
                try:
                    err = float(jnp.abs(fn(x, w, s) - want).max() / jnp.abs(want).max())
                    ms = device_ms(fn, (x, w, s), runs)
                    row = {"linear": name, "rows": rows, "form": form, "ms": ms, "rel_err": err,
                           "bandwidth_achieved": floor / ms}
                    print(f"  fp8 {name:>10} R={rows:>2} {form:>12}: {ms * 1e3:7.1f} us, {floor / ms:6.1%} of floor, "
                          f"err {err:.1e}", flush=True)
                except Exception as exc:
                    row = {"linear": name, "rows": rows, "form": form, "error": f"{type(exc).__name__}: {exc}"[:1500]}
                    print(f"  fp8 {name:>10} R={rows:>2} {form:>12}: failed {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                out.append(row)
    print("  FP8_SWEEP: " + "; ".join(f"kernel {i} {t}" for i, t in enumerate(FP8_SWEEP)), flush=True)
    return out


# Sublayer of each traced kernel: jax.named_scope around these methods (put on for --profile only), read
# back from the optimized HLO's op_name metadata; the first scope of SCOPE_ORDER in a kernel's op_name wins.
SCOPES = [("jdspark.model.compressor", "Compressor", "extend", "compressor"),
          ("jdspark.model.indexer", "Indexer", "scores", "indexer"), ("jdspark.model.indexer", "Indexer", "select", "indexer"),
          ("jdspark.model.moe", "Experts", "__call__", "routed_moe"), ("jdspark.model.moe", "Gate", "__call__", "router"),
          ("jdspark.model.moe", "SharedExpert", "__call__", "shared_expert"),
          ("jdspark.model.attention", "Attention", "query", "attn_q"),
          ("jdspark.model.attention", "Attention", "window_kv", "attn_kv"),
          ("jdspark.model.attention", None, "sink_attention", "attn_core"),
          ("jdspark.model.attention", None, "sink_attention_selected", "attn_core"),
          ("jdspark.model.attention", "Attention", "output", "attn_out"),
          ("jdspark.model.attention", "Attention", "extend", "attention"),
          ("jdspark.model.hyper", "HyperConnection", "pre", "mhc"), ("jdspark.model.hyper", "HyperConnection", "post", "mhc"),
          ("jdspark.model.dsv4", "DSV4", "logits_from_streams", "head"), ("jdspark.model.dsv4", "DSV4", "embed_streams", "embed")]
SCOPE_ORDER = ["compressor", "indexer", "routed_moe", "router", "shared_expert", "attn_q", "attn_kv", "attn_core",
               "attn_out", "attention", "mhc", "head", "embed"]
KERNEL_SCOPES = {"moe_gate_up": "routed_moe", "moe_down": "routed_moe", "mhc_sinkhorn": "mhc",
                 "fp8_linear": "fp8_linears"}


@contextlib.contextmanager
def named_scopes():
    """Every SCOPES method traced under its jax.named_scope (restored after)."""
    import importlib
    saved = []
    for module_name, cls_name, attr, scope in SCOPES:
        owner = importlib.import_module(module_name)
        owner = getattr(owner, cls_name) if cls_name else owner
        raw = owner.__dict__[attr]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        def scoped(*a, _fn=fn, _scope=scope, **k):
            with jax.named_scope(_scope):
                return _fn(*a, **k)
        saved.append((owner, attr, raw))
        setattr(owner, attr, staticmethod(scoped) if isinstance(raw, staticmethod) else scoped)
    try:
        yield
    finally:
        for owner, attr, raw in reversed(saved):
            setattr(owner, attr, raw)


_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name="([^"]*)"')


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name (and its kernel-name spelling, '.' / '-' as '_') -> sublayer, from op_name."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        parts = m.group(2).split("/")
        scope = next((s for s in SCOPE_ORDER if s in parts), "other")
        out[m.group(1)] = scope
        out.setdefault(re.sub(r"[.\-]", "_", m.group(1)), scope)
    return out


def kernel_scope(kernel: dict, scopes: dict[str, str]) -> str:
    args = kernel["args"]
    for key in ("hlo_op", "long_name", "name"):
        if isinstance(args.get(key), str) and args[key] in scopes:
            return scopes[args[key]]
    name = kernel["name"]
    for prefix, scope in KERNEL_SCOPES.items():
        if scope and name.startswith(prefix):
            return scope
    trimmed = name
    while trimmed:
        if trimmed in scopes:
            return scopes[trimmed]
        trimmed = trimmed.rpartition("_")[0]
    return "unmapped"


def sublayer_split(kernels: list[dict], scopes: dict[str, str], wall_ms: float) -> dict:
    """us and kernel count per sublayer, the device-busy time, and what could not be mapped."""
    from jdspark.profile import busy_us, gap_lines, idle_gaps
    split, unmapped = {}, {}
    for k in kernels:
        scope = kernel_scope(k, scopes)
        us, count = split.get(scope, (0.0, 0))
        split[scope] = (us + k["dur"], count + 1)
        if scope == "unmapped":
            unmapped[k["name"][:80]] = unmapped.get(k["name"][:80], 0.0) + k["dur"]
    busy = busy_us([(k["ts"], k["dur"], k["name"]) for k in kernels]) / 1e3
    gaps = idle_gaps(kernels)
    print(f"  {len(kernels)} kernels, busy {busy:.3f} ms of {wall_ms:.3f} ms wall")
    for line in gap_lines(gaps):
        print("  " + line)
    print("  by sublayer (ms, kernels):")
    for scope, (us, count) in sorted(split.items(), key=lambda kv: -kv[1][0]):
        print(f"    {scope:>14} {us / 1e3:7.3f} ms {count:>5}")
    for name, us in sorted(unmapped.items(), key=lambda kv: -kv[1])[:6]:
        print(f"      unmapped {us:8.1f} us  {name}")
    return {"busy_ms": busy, "kernels": len(kernels), "wall_ms": wall_ms, "gaps": gaps,
            "split": {s: {"ms": us / 1e3, "kernels": c} for s, (us, c) in split.items()},
            "unmapped": dict(sorted(unmapped.items(), key=lambda kv: -kv[1])[:20]),
            "sample_args": [k["args"] for k in kernels[:5]]}


def profile_row(graphdef, params, config, engine, dtype, batch, rows, context, mode="packed") -> dict:
    """The top kernels and the per-sublayer split of one extend call at [batch, rows] after `context`
    (the timed call itself: state donated and written, then rolled back)."""
    with named_scopes():
        step = Stepper(graphdef, params, config, engine, dtype, batch, rows, context, mode)
    wall_ms = statistics.median([step() for _ in range(13)][3:]) * 1e3
    dispatch_ms = statistics.median(step.dispatch_s[3:]) * 1e3
    print(f"  wall {wall_ms:.3f} ms a call, of which {dispatch_ms:.3f} ms until the call returned (host dispatch)")
    arguments = len(jax.tree.leaves((step.params, step.decode, step.ids, step.n_valid, step.out)))
    empty_ms = step.empty_dispatch_s() * 1e3
    print(f"  an empty program with the call's {arguments} argument buffers: {empty_ms:.3f} ms until it returned")
    moved = sum(a != b for a, b in zip(step.addresses[-2], step.addresses[-1]))
    print(f"  state buffers at another address than in the call before: {moved} of {len(step.addresses[-1])}")
    host: list[dict] = []
    kernels = gpu_kernel_events(step, host)
    print("  host events (total us, count):")
    events = host_summary(host, 60)
    for i, event in enumerate(events):  # the outer frames, then what the command buffer thunk did
        if i < 15 or event["name"].startswith(("command_buffer::", "cuGraph")):
            print(f"    {event['us']:9.1f} us {event['count']:>5} x  {event['name']}")
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_name.setdefault(k["name"], []).append(k["dur"])
    top = sorted(({"name": n, "us": sum(v), "count": len(v)} for n, v in by_name.items()), key=lambda r: -r["us"])
    for r in top[:8]:
        print(f"    {r['us']:9.1f} us {r['count']:>4} x  {r['name'][:90]}")
    return {"top": top[:40], "host": events[:40], "dispatch_ms": dispatch_ms, "arguments": arguments,
            "empty_dispatch_ms": empty_ms,
            "state_buffers_moved": moved, **sublayer_split(kernels, hlo_scopes(step.compiled.as_text()), wall_ms)}


def model_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options that choose the random model (also read by scripts/bench_hybrid.py)."""
    ap.add_argument("--preset", choices=sorted(PRESETS), default="flash")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--storage", choices=sorted(STORAGES), default="fp8+fp4")
    ap.add_argument("--dtype", default="bfloat16")
    return ap


def _seq_len(context: int) -> int:
    return -(-(context + 128) // 128) * 128


def time_row(graphdef, params, config, sizes, dtype, bandwidth, label, mode, context, batch, rows, args,
             kept=(None,)) -> list[dict]:
    """The timed rows of (variant, params mode, context, batch, rows), one per `kept` (n_valid of every
    row; None: all, the floor counting the kept rows), printed; a failure is recorded."""
    engine = EngineConfig(max_seq_len=_seq_len(context), max_batch=batch)
    keys = [{"variant": label, "params": mode, "context": context, "batch": batch, "rows": rows, "kept": k or rows}
            for k in kept]
    try:
        timed = time_extend(graphdef, params, config, engine, dtype, batch, rows, context, args.runs, mode=mode,
                            kept=kept)
    except Exception as err:  # a variant that fails to build: recorded, the rest still run
        print(f"{label:>14} {context:>6} {batch:>3} {rows:>2} failed: {type(err).__name__}: {str(err)[:300]}",
              flush=True)
        return [{**keys[0], "error": f"{type(err).__name__}: {err}"[:2000]}]
    out = []
    for key, (ms, queued_ms, compile_s) in zip(keys, timed):
        moved = call_bytes(config, sizes, context, batch, key["kept"], dtype)
        floor_ms = moved["total"] / bandwidth * 1e3
        gbps = moved["total"] / (ms / 1e3) / 1e9
        row = {**key, "ms": ms, "bytes": moved, "floor_ms": floor_ms, "GBps": gbps,
               "bandwidth_achieved": gbps * 1e9 / bandwidth, "queued_ms": queued_ms,
               "queued_bandwidth_achieved": floor_ms / queued_ms, "compile_s": compile_s}
        name = label if key["kept"] == rows else f"{label} kept {key['kept']}"
        print(f"{name:>14} {context:>6} {batch:>3} {rows:>2} {ms:>9.3f} {moved['total'] / 1e6:>9.1f} "
              f"{floor_ms:>8.3f} {gbps:>7.1f} {row['bandwidth_achieved']:>17.1%} {queued_ms:>9.3f} "
              f"{row['queued_bandwidth_achieved']:>9.1%} {compile_s:>9.1f}", flush=True)
        out.append(row)
    return out


def main(argv=None) -> dict:
    ap = model_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, nargs="+", default=[4096])
    ap.add_argument("--variants", nargs="+", default=["current"])
    ap.add_argument("--kept", type=int, nargs="*", default=[],
                    help="also time each S-row call keeping only this many rows a slot (n_valid): a narrower verify "
                         "run in a wider executable, whose dropped rows read no routed expert")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--params", nargs="+", choices=["packed", "all-packed", "separate", "donated", "scales-apart"],
                    default=["packed"],
                    help="how the parameters travel: packed as the engine passes them on the GPU (the scales the FP8 "
                         "kernel reads apart, `packed.kernel_scales`), or one argument each; all-packed: every small "
                         "tensor packed (the engine before 2026-12-07); donated: packed, and the logits written into a "
                         "donated buffer (stable addresses); scales-apart: packed but every FP8 block scale (routed "
                         "experts' too), each an argument of its own")
    ap.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth array size (default 2048 GPU, 64 CPU)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sweep", action="store_true", help="with --moe-layer: time the kernel's tilings (GPU)")
    ap.add_argument("--profile", action="store_true",
                    help="per row of the first variant: the top GPU kernels of one call (GPU)")
    ap.add_argument("--fp8-linears", type=int, nargs="*", default=None,
                    help="first time Flash's FP8 linears alone at these row counts (XLA forms, kernel tilings; GPU)")
    ap.add_argument("--moe-layer", type=int, nargs="*", default=None,
                    help="first time one routed-expert layer alone at these row counts (xla, pallas, every expert)")
    args = ap.parse_args(argv)
    for name in args.variants:
        if name not in PATCHES:
            ap.error(f"--variants {name}: expected one of {sorted(PATCHES)}")

    dtype = jnp.dtype(args.dtype)
    config = make_config(args.preset, args.layers, args.experts, args.storage)
    storage = STORAGES[args.storage]
    gpu = jax.default_backend() != "cpu"
    copy_mib = args.copy_mib or (2048 if gpu else 64)
    bandwidth = copy_bandwidth(copy_mib << 20)
    start = time.perf_counter()
    graphdef, params = random_params(config, dtype, storage)
    jax.block_until_ready(params)
    sizes = param_bytes(params)
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "preset": args.preset,
              "layers": config.num_hidden_layers, "experts": config.n_routed_experts, "storage": args.storage,
              "dtype": dtype.name, "copy_bandwidth_GBps": bandwidth / 1e9, "param_bytes": sizes,
              "init_s": time.perf_counter() - start, "rows": []}
    print(f"# {report['device']} jax {jax.__version__}: {args.preset} dims, {config.num_hidden_layers} layers, "
          f"{config.n_routed_experts} experts, {args.storage}; params {sum(sizes.values()) / 1e9:.2f} GB "
          f"(routed experts {sizes['experts'] / 1e9:.2f}); copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if args.fp8_linears and gpu:
        report["fp8_sweep"] = fp8_sweep(args.fp8_linears, args.runs, bandwidth)
        report["fp8_tiles"] = dataclasses.asdict(fp8_kernels.TILES)
    if args.moe_layer:
        one_layer = make_config(args.preset, 1, args.experts, args.storage)
        report["moe_layer"], experts = moe_layer_rows(one_layer, storage, dtype, args.moe_layer, args.runs, bandwidth)
        if args.sweep and gpu:
            report["kernel_sweep"] = kernel_sweep(experts, args.moe_layer, args.runs, bandwidth)
        report["tiles"] = dataclasses.asdict(moe_kernels.TILES)
        del experts
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    header = (f"{'variant':>14} {'ctx':>6} {'B':>3} {'S':>2} {'ms':>9} {'MB moved':>9} {'floor ms':>8} "
              f"{'GB/s':>7} {'bandwidth achieved':>18} {'queued ms':>9} {'achieved':>9} {'compile s':>9}")
    print(header)
    for name in args.variants:
        graphdef_v = with_experts_implementation(graphdef, params, name)
        with variant(name):
            for mode in args.params:
                label = name if mode == "packed" else f"{name}/{mode}"
                for context in args.context:
                    for batch in args.batch:
                        for rows in args.rows:
                            timed = time_row(graphdef_v, params, config, sizes, dtype, bandwidth, label, mode,
                                             context, batch, rows, args, (None, *(k for k in args.kept if k < rows)))
                            report["rows"] += timed
                            row = timed[0]
                            if args.profile and gpu and name == args.variants[0] and "error" not in row:
                                engine = EngineConfig(max_seq_len=_seq_len(context), max_batch=batch)
                                row["profile"] = profile_row(graphdef_v, params, config, engine, dtype, batch, rows,
                                                             context, mode)
                            if args.json:  # after every row: a run cut short keeps what it measured
                                args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
