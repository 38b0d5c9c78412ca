"""Routed experts read in place (spec dsv4.md §5.4): R rows x the distinct experts they selected.

`moe(x, experts, dense, w1, w3, w2, ...)` (Pallas: Triton on the GPU, interpret mode on the CPU)
equals `ref_moe` (plain jnp: gather the selected experts' stored arrays, decode them, einsums) up to
float32 summation order. Inputs:
- x [R, D] in the compute dtype (bfloat16 or float32);
- experts [M] int32, the distinct experts of the call (`jdspark.model.moe.routed_slots`: sorted,
  padded with -1, a missing expert that no program reads) and dense [R, M] float32, each row's
  routing weight on each slot (0 where the row did not select it);
- slot [R, K] int32, the slot of each row's k-th choice (for the combine);
- each projection as stored (`fmt`): "bf16" (weight [E, out, in] in any float dtype), "fp8" (e4m3
  [E, out, in] + block scales [E, out/128, in/128], e8m0 bytes or float32) or "fp4" (ds_fp4: int8
  [E, out, in/2] two E2M1 codes per byte, low nibble first, + e8m0 bytes [E, out, in/32]).

Two kernels, each reading every distinct expert once, whatever the number of rows:
1. gate/up: grid (M, F / TF). A program decodes a [TF, BK] tile of w1 and of w3 of expert
   experts[m] per step of a loop over D (in registers: E2M1 codes from nibbles by selects, e8m0
   scales from their bits), accumulates x @ w^T in float32, and writes
   h = swiglu(gate, up, limit) * dense[:, m] in the compute dtype, [M, Rp, F].
2. down: grid (M, D / TD): out_m = h_m @ w2[experts[m]]^T, one [TD, BK] tile of w2 per loop step,
   written in the compute dtype [M, Rp, D] (the reference rounds each expert's output there too).
The combine is each row's K slot outputs summed in float32 in router order, so a row's result does
not depend on the other rows of the call (no reduction over M).

ds_fp4 codes are decoded by nibble: even input elements are low nibbles, odd ones high nibbles, so
the activations are split into even and odd columns outside the kernel (x[:, 0::2], x[:, 1::2]) and
the two halves meet in two dots; nothing is interleaved in registers. The E2M1 decode is chosen by
`Tiles.decode` (`E2M1_DECODERS`, or "prmt": byte permutes in inline PTX, the default on the GPU). The
dot form decodes the bytes in the layout they load in ([out, step/2], each scale repeated over its
16 bytes); the gemv form loads [out, step/32, 16] tiles, one scale group per row. Rows are padded
to a power of two >= 16 (Triton's smallest dot); under `Tiles.swap` each dot is w_tile @ x^T, so an
expert's output features fill the MMA's M side and the few rows its N side. Calls of at most
`Tiles.gemv_rows` rows take a third form, per-row products and sums with no dot (`_moe_gemv`).
Block shapes are powers of two; every dimension must be a multiple of its tile (checked: `supported`).

That slot form runs every row of the call against every distinct expert (R x min(R K, E) row
products for the R K a call needs), so it suits calls of a few rows. `grouped_moe` is the same two
kernels over the (row, choice) pairs sorted by expert into blocks of 16 rows, one expert's per block
(`pair_blocks`, the layout of vLLM's fused MoE and megablox's grouped matmul): a call of many rows (a
verify batch of 64 x 6) then computes about its R K pairs, reading each expert once per block.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

FP4_BLOCK, FP8_BLOCK = 32, 128  # elements per e8m0 scale of ds_fp4; rows / columns per FP8 block scale
FORMATS = ("bf16", "fp8", "fp4")


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tiling of both kernels: `out` output features per program (F for gate/up, D for down), `step`
    input elements per loop step (fp8: 128, one block scale per step), Triton warps and stages."""

    out: int = 32
    step_bf16: int = 128
    step_fp4: int = 256
    num_warps: int = 4
    num_stages: int = 2
    decode: str = "select"  # E2M1 decode (`E2M1_DECODERS`): float selects, float32 bit patterns, offset bits, e4m3 cvt;
    # or "prmt": byte permutes in inline PTX, four bytes at a time (`_E2M1_PRMT`, compiled only)
    gemv_rows: int = 0  # calls of at most this many rows (<= GEMV_MAX_ROWS) take the gemv form, the rest tl.dot
    gemv_out: int = 0  # output features per program in the gemv form (0: `out`)
    swap: bool = False  # the dot form as w_tile @ x^T (weights the MMA's M side, rows its N side) instead of x @ w^T
    skip_rows: bool = False  # the gemv form skips, per expert, the rows that did not select it
    down_out: int = 0  # `out` of the down kernel (0: the same as gate/up's)
    down_step_fp4: int = 0  # `step_fp4` of the down kernel (0: the same as gate/up's)

    def step(self, fmt: str) -> int:
        return {"bf16": self.step_bf16, "fp8": FP8_BLOCK, "fp4": self.step_fp4}[fmt]

    def for_down(self) -> Tiles:
        """The tiling of the down kernel."""
        return dataclasses.replace(self, out=self.down_out or self.out, step_fp4=self.down_step_fp4 or self.step_fp4)

    def fitted(self, d: int, f: int) -> Tiles:
        """Loop steps no longer than the loop (gate/up runs over D, down over F): a model narrower
        than a step runs one step of its width."""
        return dataclasses.replace(self, step_bf16=min(self.step_bf16, d), step_fp4=min(self.step_fp4, d),
                                   down_step_fp4=min(self.down_step_fp4 or self.step_fp4, f))

    def for_rows(self, rows: int) -> Tiles:
        """The tiling a call of `rows` rows runs: the gemv form's (its `gemv_out`) or the dot form's."""
        if rows <= min(self.gemv_rows, GEMV_MAX_ROWS):
            return dataclasses.replace(self, out=self.gemv_out or self.out)
        return dataclasses.replace(self, gemv_rows=0)


# The tiling `moe` uses unless given one: the fastest of scripts/probe_moe_kernel.py on an H100
# (2026-12-06, Flash dims, ds_fp4, one layer, 6 experts a row, device time per kernel) among the
# forms that give a row the same bits whatever the call's row count (1..16: rows are padded to 16):
# E2M1 by byte permutes ("prmt", decoded in the layout the bytes load in), rows on the MMA's M side
# (not swapped). R = 6: gate/up 170 us (out 32, 512 inputs a step; swapped, out 64: 211 us), down
# 81 us (out 64, 256 inputs a step; swapped: 98 us); R = 1: 34.5 + 17.6 us against 53.3 + 20.8.
# One row alone is faster still in the gemv form, but a decode would then round differently from
# the verify of the same row, so greedy speculative decoding would drift from greedy target-only.
TILES = Tiles(out=32, step_fp4=512, num_stages=3, decode="prmt", down_out=64, down_step_fp4=256)
GEMV_MAX_ROWS = 8  # the gemv form unrolls its rows in the kernel
MAX_ELEMENTS = 2 ** 31  # a stored array the kernels index must have int32 offsets


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return gate / (1.0 + jnp.exp(-gate)) * up


def decode(fmt: str, stored: tuple, dtype) -> jax.Array:
    """Stored arrays of some experts -> [..., out, in] in `dtype` (spec §7.3-7.4; the same values as
    `jdspark.model.dequant`, which kernels do not import)."""
    if fmt == "fp4":
        packed, scale = stored
        b = jax.lax.bitcast_convert_type(packed, jnp.uint8).astype(jnp.int32)
        codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
        s = jnp.repeat(scale_f32(scale), FP4_BLOCK, axis=-1)
        return (_e2m1(codes) * s).astype(dtype)
    if fmt == "fp8":
        weight, scale = stored
        n, k = weight.shape[-2:]
        s = jnp.repeat(jnp.repeat(scale_f32(scale), FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n, :k]
        return (weight.astype(jnp.float32) * s).astype(dtype)
    return stored[0].astype(dtype)


def ref_moe(x, experts, dense, slot, w1, w3, w2, *, fmt: str, limit: float, interpret: bool = False) -> jax.Array:
    """Plain jnp: the selected experts' stored arrays gathered and decoded, then
    sum_k (swiglu(x w1^T, x w3^T) * w_k) w2^T of each row's slots. Returns float32 [R, D]."""
    del interpret
    dtype = x.dtype
    experts = jnp.maximum(experts, 0)  # a missing slot (-1) has routing weight 0: any expert stands in
    take = lambda stored: decode(fmt, tuple(jnp.take(a, experts, axis=0) for a in stored), dtype)
    gate = jnp.einsum("nd,efd->nef", x, take(w1), preferred_element_type=jnp.float32)
    up = jnp.einsum("nd,efd->nef", x, take(w3), preferred_element_type=jnp.float32)
    h = (swiglu(gate.astype(dtype), up.astype(dtype), limit) * dense[..., None]).astype(dtype)
    out = jnp.einsum("nef,edf->ned", h, take(w2), preferred_element_type=jnp.float32).astype(dtype)
    return _combine(jnp.swapaxes(out, 0, 1), slot)


def _combine(out: jax.Array, slot: jax.Array) -> jax.Array:
    """out [M, >=R, D] per-slot outputs, slot [R, K] -> sum over k in order, float32 [R, D]."""
    r, k = slot.shape
    rows = jnp.arange(r)
    total = out[slot[:, 0], rows].astype(jnp.float32)
    for j in range(1, k):
        total = total + out[slot[:, j], rows].astype(jnp.float32)
    return total


def supported(fmt: str, d: int, f: int, rows: int, tiles: Tiles | None = None, n_experts: int = 1) -> bool:
    """Whether `moe` handles these sizes (else use `ref_moe`): tiles dividing D and F, at most 64
    rows, and every stored array under 2^31 elements (Triton's int32 offsets; Pro's ds_fp4 experts,
    384 x 3072 x 3584 bytes, are over it)."""
    tiles = (tiles or TILES).fitted(d, f).for_rows(rows)
    if fmt not in FORMATS or n_experts * d * f // (2 if fmt == "fp4" else 1) > MAX_ELEMENTS:
        return False
    down = tiles if tiles.gemv_rows else tiles.for_down()  # the gemv form: one tiling for both kernels
    return rows <= 64 and all(
        n_out % t.out == 0 and n_in % t.step(fmt) == 0 and (fmt != "fp8" or FP8_BLOCK % t.out == 0)
        for t, n_out, n_in in ((tiles, f, d), (down, d, f)))


def moe(x, experts, dense, slot, w1, w3, w2, *, fmt: str, limit: float, interpret: bool = False,
        tiles: Tiles | None = None) -> jax.Array:
    """`ref_moe` as two Pallas kernels reading each distinct expert in place once. float32 [R, D].
    A slot whose expert is negative (a padding slot of `jdspark.model.moe.expert_slots`, a host
    expert the PCIe share does not take) reads nothing and outputs zeros: re-reading an expert in
    its place would cost the decode of its tiles, which bounds the kernel."""
    r, d = x.shape
    m = experts.shape[0]
    f = w1[0].shape[1]
    tiles = (tiles or TILES).fitted(d, f)
    if not supported(fmt, d, f, r, tiles, w1[0].shape[0]):
        raise ValueError(f"moe kernel: unsupported sizes fmt={fmt} D={d} F={f} rows={r}; use ref_moe")
    tiles = tiles.for_rows(r)
    if interpret and tiles.decode == "prmt":  # inline PTX has no interpreter; "offset" gives the same values
        tiles = dataclasses.replace(tiles, decode="offset")
    if tiles.gemv_rows:
        return _combine(_moe_gemv(x, experts, dense, w1, w3, w2, fmt, limit, interpret, tiles), slot)
    rp = max(16, 1 << (r - 1).bit_length())
    xp = jnp.zeros((rp, d), x.dtype).at[:r].set(x)
    dense_t = jnp.zeros((m, rp, 1), jnp.float32).at[:, :r, 0].set(dense.T)
    out = _gate_up_down(xp, experts, dense_t, w1, w3, w2, fmt, limit, interpret, tiles)
    return _combine(out, slot)


def _gate_up_down(act, experts, dense_t, w1, w3, w2, fmt, limit, interpret, tiles) -> jax.Array:
    """The two dot-form kernels over M slots: act [Rp, D] (every slot's rows) or [M, Rp, D] (each
    slot its own rows), dense_t [M, Rp, 1] each row's routing weight on the slot's expert ->
    per-slot outputs [M, Rp, D] in act's dtype."""
    m, rp, d, dtype = experts.shape[0], act.shape[-2], act.shape[-1], act.dtype
    f = w1[0].shape[1]
    params = pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    experts = experts.astype(jnp.int32)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, fmt=fmt, k=d, limit=limit, dtype=dtype, tiles=tiles,
                          per_slot=act.ndim == 3),
        out_shape=jax.ShapeDtypeStruct((m, rp, f), dtype),
        grid=(m, f // tiles.out),
        interpret=interpret, compiler_params=params, name="moe_gate_up",
    )(experts, dense_t, *_activations(fmt, act), *w1, *w3)
    down = tiles.for_down()
    return pl.pallas_call(
        functools.partial(_down_kernel, fmt=fmt, k=f, dtype=dtype, n_w=len(w2), tiles=down),
        out_shape=jax.ShapeDtypeStruct((m, rp, d), dtype),
        grid=(m, d // down.out),
        interpret=interpret, compiler_params=params, name="moe_down",
    )(experts, *_activations(fmt, h), *w2)


# ---- the grouped form: (row, choice) pairs sorted by expert into blocks of BLOCK_ROWS ------------

BLOCK_ROWS = 16  # rows of one block: Triton's smallest dot, the rows the slot form pads 1..16 to


class PairBlocks(NamedTuple):
    """A call's (row, choice) pairs laid out by expert (`pair_blocks`): block b holds up to BLOCK_ROWS
    pairs of expert experts[b] (-1: an empty block), position p = b * BLOCK_ROWS + i holds the pair of
    row rows[p] with routing weight weights[p] (0 in unused positions), and the pair (r, k) sits at
    position at[r, k] (n_blocks * BLOCK_ROWS where it was dropped)."""

    experts: jax.Array  # [n_blocks] int32
    rows: jax.Array  # [n_blocks * BLOCK_ROWS] int32
    weights: jax.Array  # [n_blocks * BLOCK_ROWS] float32
    at: jax.Array  # [R, K] int32


def pair_blocks(idx: jax.Array, weights: jax.Array, n_experts: int) -> PairBlocks:
    """The blocked layout of idx / weights [R, K] (static shapes: at most min(P, (P + U (BLOCK_ROWS - 1))
    // BLOCK_ROWS) blocks for P = R K pairs and U = min(E, P) distinct experts, since expert e takes
    ceil(c_e / BLOCK_ROWS) blocks for its c_e pairs). A pair of expert < 0 or weight 0 adds nothing
    and is dropped (no block row computes it). A stable sort keeps each expert's pairs in row order."""
    r, k = idx.shape
    pairs, bm = r * k, BLOCK_ROWS
    n_blocks = min(pairs, (pairs + min(n_experts, pairs) * (bm - 1)) // bm)
    expert = idx.reshape(-1).astype(jnp.int32)
    weight = weights.reshape(-1).astype(jnp.float32)
    key = jnp.where((expert >= 0) & (weight != 0), expert, n_experts)  # dropped pairs sort last
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    count = jnp.bincount(key, length=n_experts + 1)[:n_experts]
    first_pair = jnp.cumsum(count) - count  # the expert's first pair in sorted order
    first_block = jnp.cumsum((count + bm - 1) // bm) - (count + bm - 1) // bm
    e = jnp.minimum(sorted_key, n_experts - 1)
    place = first_block[e] * bm + jnp.arange(pairs) - first_pair[e]
    place = jnp.where(sorted_key < n_experts, place, n_blocks * bm)  # out of range: dropped
    size = n_blocks * bm
    at = jnp.zeros((pairs,), jnp.int32).at[order].set(place.astype(jnp.int32))
    return PairBlocks(
        experts=jnp.full((n_blocks,), -1, jnp.int32).at[place // bm].set(sorted_key, mode="drop"),
        rows=jnp.zeros((size,), jnp.int32).at[place].set((order // k).astype(jnp.int32), mode="drop"),
        weights=jnp.zeros((size,), jnp.float32).at[place].set(weight[order], mode="drop"),
        at=at.reshape(r, k))


def grouped_supported(fmt: str, d: int, f: int, tiles: Tiles | None = None, n_experts: int = 1) -> bool:
    """Whether `grouped_moe` handles these sizes: `supported`'s rules for the dot form, any row count."""
    return supported(fmt, d, f, BLOCK_ROWS, dataclasses.replace(tiles or TILES, gemv_rows=0), n_experts)


def grouped_moe(x, idx, weights, w1, w3, w2, *, fmt: str, limit: float, interpret: bool = False,
                tiles: Tiles | None = None) -> jax.Array:
    """`ref_moe` for calls of many rows, float32 [R, D]. The slot form (`moe`) runs every row against
    every distinct expert of the call: R x min(R K, E) row products for R K needed, and R <= 64. Here
    each block of BLOCK_ROWS pairs of one expert reads that expert's tiles once for its rows (an
    expert chosen by more than BLOCK_ROWS rows is read once per block), so a call computes about R K
    rows plus under one block per distinct expert. idx / weights [R, K]: each row's experts and
    routing weights (`pair_blocks` drops pairs of expert -1 or weight 0). The same kernels as the
    slot form, always with 16-row tiles: a row's output has the same bits whatever the call's size,
    and the slot form's for calls of up to 16 rows (a `gpu` test). The combine sums each row's K pair
    outputs in router order (as `_combine`)."""
    r, d = x.shape
    tiles = dataclasses.replace(tiles or TILES, gemv_rows=0).fitted(d, w1[0].shape[1])
    if not grouped_supported(fmt, d, w1[0].shape[1], tiles, w1[0].shape[0]):
        raise ValueError(f"grouped moe kernel: unsupported sizes fmt={fmt} D={d} F={w1[0].shape[1]}; use ref_moe")
    if interpret and tiles.decode == "prmt":
        tiles = dataclasses.replace(tiles, decode="offset")
    blocks = pair_blocks(idx, weights, w1[0].shape[0])
    n_blocks = blocks.experts.shape[0]
    act = jnp.take(x, blocks.rows, axis=0).reshape(n_blocks, BLOCK_ROWS, d)
    out = _gate_up_down(act, blocks.experts, blocks.weights.reshape(n_blocks, BLOCK_ROWS, 1), w1, w3, w2,
                        fmt, limit, interpret, tiles).reshape(n_blocks * BLOCK_ROWS, d)
    total = jnp.zeros((r, d), jnp.float32)
    for j in range(idx.shape[1]):  # a dropped pair's position is past the end: it reads 0
        total = total + jnp.take(out, blocks.at[:, j], axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    return total


def _activations(fmt: str, a: jax.Array) -> tuple[jax.Array, ...]:
    """fp4: (even columns, odd columns) of a [..., K]; otherwise (a,)."""
    if fmt == "fp4":
        return a[..., 0::2], a[..., 1::2]
    return (a,)


def _by_group(fmt: str, stored: tuple) -> tuple[jax.Array, ...]:
    """The stored arrays as the gemv form loads them (a free reshape in XLA): fp4 bytes
    [E, out, in/32, 16] + scales [E, out, in/32, 1], one scale group per row of 16 bytes."""
    if fmt == "fp4":
        packed, scale = stored
        e, n, half = packed.shape
        return packed.reshape(e, n, half // 16, 16), scale.reshape(e, n, half // 16, 1)
    return tuple(stored)


def scale_f32(s: jax.Array) -> jax.Array:
    """e8m0 bytes -> 2^(b - 127) from the float32 bit pattern (exact; byte 0 -> 0); float32 as is."""
    if s.dtype == jnp.uint8:
        return jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)
    return s.astype(jnp.float32)


def _e2m1(code: jax.Array) -> jax.Array:
    """E2M1 codes (int32 0..15) -> float32 values; code 8 -> +0.0 as in the official table."""
    exp = (code >> 1) & 3
    mant = (code & 1).astype(jnp.float32)
    mag = jnp.where(exp == 0, 0.5 * mant, jnp.where(exp == 1, 1.0 + 0.5 * mant,
                                                    jnp.where(exp == 2, 2.0 + mant, 4.0 + 2.0 * mant)))
    return jnp.where(code >= 8, 0.0 - mag, mag)


def _e2m1_bits(code: jax.Array) -> jax.Array:
    """`_e2m1` from the float32 bit pattern, with fewer operations: magnitude code em = e e m; em >= 2
    is (1 + m/2) 2^(e-1), whose bits are (em << 22) + bits(0.5); em = 1 is 0.5, em = 0 is 0; the
    sign bit goes to bit 31 except for zero (code 8 -> +0.0)."""
    em = code & 7
    half = 0x3F000000  # bits of 0.5
    bits = jnp.where(em >= 2, (em << 22) + half, em * half)
    bits = jnp.where(em == 0, 0, bits | ((code & 8) << 28))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _e2m1_offset(b: jax.Array, shift: int) -> jax.Array:
    """The E2M1 code in bits shift..shift+3 of b (int32, any bits above) -> float32, with no selects and
    no subnormals: magnitude code em at bits 22-24 plus bits(0.5) is f = 0.5, 0.75, 1, 1.5, 2, 3, 4, 6,
    and f + min(f - 1, 0) turns the first two into 0 and 0.5 (exact); the sign bit goes to bit 31
    (code 8 -> -0.0, which sums as +0.0)."""
    f = jax.lax.bitcast_convert_type(((b << (22 - shift)) & 0x01C00000) + 0x3F000000, jnp.float32)
    mag = jax.lax.bitcast_convert_type(f + jnp.minimum(f - 1.0, 0.0), jnp.int32)
    return jax.lax.bitcast_convert_type(mag | ((b << (28 - shift)) & jnp.int32(-2 ** 31)), jnp.float32)


def _e2m1_e4m3(b: jax.Array, shift: int) -> jax.Array:
    """The E2M1 code in bits shift..shift+3 of b -> its value times 2^-6, through the hardware's e4m3
    conversion: the magnitude bits e e m moved to e4m3 bits 4..2 give exponent field e and mantissa
    m00, i.e. 2^(e-7) (1 + m/2) for e >= 1 and the subnormal 2^-6 (m/2) for e = 0, which is 2^-6
    times the E2M1 value in every case (exact); the sign goes to bit 7 (code 8 -> -0.0). Callers
    multiply the block scale by `E2M1_UNIT["e4m3"]` = 2^6 once per scale group."""
    code = b >> shift if shift else b
    bits = ((code & 7) << 2) | ((code & 8) << 4)
    e4m3 = jax.lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn)
    return e4m3.astype(jnp.float32)


# E2M1 x e8m0 -> bf16 for four bytes at a time, in 32-bit registers (inline PTX, so compiled only;
# the interpreter takes "offset", which gives the same values). Each byte's low (or high) nibble
# indexes byte tables by its magnitude bits (prmt: four lookups an instruction): the high and low
# byte of the bf16 values 0, 0.5, 1, 1.5, 2, 3, 4, 6; the nibble's sign bit goes to the high byte's
# bit 7 (code 8 -> -0.0); the scale byte b becomes the bf16 2^(b - 127) as b << 7 (byte 0 -> 0),
# and one bf16x2 multiply per pair applies it (exact: three significant bits times a power of two).
# $0 $1: the values of bytes 0-1 and 2-3, $2: the bytes, $3: their scale bytes; the outputs are
# written last, as they may share registers with the inputs. One asm per nibble, since Pallas lowers
# one result per asm; ptxas shares the tables and scales between the two. About 3.5 instructions a
# value, against about 10 for "offset" and its scale.
_E2M1_PRMT = """{{
.reg .b32 m, t, sel, h, l, sg, hl, hh, ll, lh, z, s0, s1, o0, o1;
mov.b32 hl, 0x3F3F3F00; mov.b32 hh, 0x40404040; mov.b32 ll, 0xC0800000; mov.b32 lh, 0xC0804000;
mov.b32 z, 0; prmt.b32 s0, $3, z, 0x4140; shl.b32 s0, s0, 7; prmt.b32 s1, $3, z, 0x4342; shl.b32 s1, s1, 7;
{nibble}
shr.b32 t, m, 4; or.b32 t, t, m; prmt.b32 sel, t, z, 0x0020;
prmt.b32 h, hl, hh, sel; prmt.b32 l, ll, lh, sel; or.b32 h, h, sg;
prmt.b32 o0, l, h, 0x5140; prmt.b32 o1, l, h, 0x7362;
mul.rn.bf16x2 $0, o0, s0; mul.rn.bf16x2 $1, o1, s1;
}}"""
_PRMT_NIBBLE = {"low": "and.b32 m, $2, 0x07070707; shl.b32 sg, $2, 4; and.b32 sg, sg, 0x80808080;",
                "high": "shr.b32 m, $2, 4; and.b32 m, m, 0x07070707; and.b32 sg, $2, 0x80808080;"}


def _e2m1_prmt(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """ds_fp4 bytes (int8) and their e8m0 scale bytes (uint8, same shape) -> (low, high nibble)
    values E2M1 x 2^(scale - 127) in bfloat16, inside a compiled Triton kernel (`_E2M1_PRMT`)."""
    out = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
    return tuple(pltriton.elementwise_inline_asm(_E2M1_PRMT.format(nibble=_PRMT_NIBBLE[half]), args=[packed, scale],
                                                 constraints="=r,=r,r,r", pack=4, result_shape_dtypes=[out])[0]
                 for half in ("low", "high"))


def _fp4_values(packed: jax.Array, scale: jax.Array, how: str, dtype) -> tuple[jax.Array, jax.Array]:
    """A tile of ds_fp4 bytes (int8) and their e8m0 scales (uint8, broadcastable to the bytes' shape)
    -> the weights of the low and high nibbles, E2M1 x scale, in `dtype`."""
    if how == "prmt":
        lo, hi = _e2m1_prmt(packed, jnp.broadcast_to(scale, packed.shape))
        return lo.astype(dtype), hi.astype(dtype)
    s = _fp4_scale(scale, how)
    lo, hi = _e2m1_pair(packed.astype(jnp.int32), how)
    return (lo * s).astype(dtype), (hi * s).astype(dtype)


E2M1_DECODERS = ("select", "bits", "offset", "e4m3")  # in jnp; "prmt" (inline PTX) runs compiled only
E2M1_UNIT = {"e4m3": 64.0}  # what a decoder's values are multiplied by to give the E2M1 values (default 1)


def _e2m1_pair(b: jax.Array, how: str) -> tuple[jax.Array, jax.Array]:
    """Bytes b (int32 from int8: the sign extended) -> (low nibble, high nibble) as float32 values,
    each 1 / `E2M1_UNIT[how]` times the E2M1 value."""
    if how == "offset":
        return _e2m1_offset(b, 0), _e2m1_offset(b, 4)
    if how == "e4m3":
        return _e2m1_e4m3(b, 0), _e2m1_e4m3(b, 4)
    e2m1 = _e2m1_bits if how == "bits" else _e2m1
    return e2m1(b & 0xF), e2m1((b >> 4) & 0xF)


def _fp4_scale(scale: jax.Array, how: str) -> jax.Array:
    """e8m0 scale bytes -> float32 block scales times the decoder's unit (a power of two: exact
    unless the scale is within 2^6 of float32's largest, which no checkpoint holds)."""
    return scale_f32(scale) * E2M1_UNIT.get(how, 1.0)


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [Rp, K] @ b[N, K]^T in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _partial(fmt, e, row0, c, act_refs, w_refs, dtype, tiles):
    """x_chunk @ w[e, row0:row0+out, chunk c]^T, float32 [Rp, out], for one loop step. Dynamic
    starts carry `multiple_of` hints, so Triton can vectorise the loads."""
    out = tiles.out
    rows = pl.ds(row0, out)
    step = tiles.step(fmt)
    if fmt == "fp4":
        packed_ref, scale_ref = w_refs
        even_ref, odd_ref = act_refs
        nb = step // FP4_BLOCK
        blocks = pl.ds(pl.multiple_of(c * nb, nb), nb)
        cols = pl.ds(pl.multiple_of(c * (step // 2), step // 2), step // 2)
        # the bytes as stored, [out, step/2], each scale repeated over its 16 bytes: decoding in the
        # loaded layout beat decoding [out, nb, 16] tiles and reshaping the values (R = 6: 0.31 vs 0.40 ms)
        scale = jnp.broadcast_to(scale_ref[e, rows, blocks][..., None], (out, nb, 16)).reshape(out, step // 2)
        lo, hi = _fp4_values(packed_ref[e, rows, cols], scale, tiles.decode, dtype)
        return _tile_dot(even_ref[:, cols], lo, tiles) + _tile_dot(odd_ref[:, cols], hi, tiles)
    cols = pl.ds(pl.multiple_of(c * step, step), step)
    if fmt == "fp8":
        w_ref, scale_ref = w_refs
        s = scale_f32(scale_ref[e, row0 // FP8_BLOCK, c])  # one block scale per tile and step
        w = (w_ref[e, rows, cols].astype(jnp.float32) * s).astype(dtype)
    else:
        w = w_refs[0][e, rows, cols].astype(dtype)
    return _tile_dot(act_refs[0][:, cols], w, tiles)


def _tile_dot(act: jax.Array, w: jax.Array, tiles: Tiles) -> jax.Array:
    """act [Rp, K] . w [out, K] over K: [Rp, out], or [out, Rp] under `tiles.swap`."""
    return _dot_t(w, act) if tiles.swap else _dot_t(act, w)


def _loop_k(e, n: int, body, init):
    """fori_loop(0, n, body, init) over K's steps; a missing expert (e < 0) runs no step and returns
    `init`. A branch around a static loop: Triton's scf.for took no traced bound (its lowering gave
    the bounds different types)."""
    return jax.lax.cond(e >= 0, lambda acc: jax.lax.fori_loop(0, n, body, acc), lambda acc: acc, init)


def _gate_up_kernel(experts_ref, dense_ref, *refs, fmt, k, limit, dtype, tiles, per_slot=False):
    n_act = 2 if fmt == "fp4" else 1
    n_w = (len(refs) - n_act - 1) // 2
    act_refs, w1_refs, w3_refs, h_ref = refs[:n_act], refs[n_act:n_act + n_w], refs[n_act + n_w:-1], refs[-1]
    slot, tile = pl.program_id(0), pl.program_id(1)
    if per_slot:  # [M, Rp, K]: this slot's own rows (the grouped form's block)
        act_refs = [_SlotRef(ref, slot) for ref in act_refs]
    e = experts_ref[slot]
    row0 = pl.multiple_of(tile * tiles.out, tiles.out)
    rp = h_ref.shape[1]

    def step(c, acc):
        gate, up = acc
        return (gate + _partial(fmt, e, row0, c, act_refs, w1_refs, dtype, tiles),
                up + _partial(fmt, e, row0, c, act_refs, w3_refs, dtype, tiles))

    zero = jnp.zeros((tiles.out, rp) if tiles.swap else (rp, tiles.out), jnp.float32)
    gate, up = _loop_k(e, k // tiles.step(fmt), step, (zero, zero))
    if tiles.swap:
        gate, up = gate.T, up.T
    h = swiglu(gate.astype(dtype), up.astype(dtype), limit) * dense_ref[slot, :, :]
    h_ref[slot, :, pl.ds(row0, tiles.out)] = h.astype(dtype)


def _down_kernel(experts_ref, *refs, fmt, k, dtype, n_w, tiles):
    act_refs, w_refs, out_ref = refs[:-n_w - 1], refs[-n_w - 1:-1], refs[-1]
    slot, tile = pl.program_id(0), pl.program_id(1)
    e = experts_ref[slot]
    row0 = pl.multiple_of(tile * tiles.out, tiles.out)
    rp = out_ref.shape[1]
    # the activations of this slot: h [M, Rp, F] (or its even / odd halves), read per loop step
    slot_acts = [_SlotRef(ref, slot) for ref in act_refs]

    def step(c, acc):
        return acc + _partial(fmt, e, row0, c, slot_acts, w_refs, dtype, tiles)

    zero = jnp.zeros((tiles.out, rp) if tiles.swap else (rp, tiles.out), jnp.float32)
    acc = _loop_k(e, k // tiles.step(fmt), step, zero)
    out_ref[slot, :, pl.ds(row0, tiles.out)] = (acc.T if tiles.swap else acc).astype(dtype)


class _SlotRef:
    """ref[slot] as a 2-D [Rp, K] view for `_partial`'s `act[:, cols]` loads."""

    def __init__(self, ref, slot):
        self.ref, self.slot = ref, slot

    def __getitem__(self, index):
        rows, cols = index
        return self.ref[self.slot, rows, cols]


# ---- the gemv form: no tl.dot, no row padding -----------------------------------------------------

def _moe_gemv(x, experts, dense, w1, w3, w2, fmt, limit, interpret, tiles) -> jax.Array:
    """Both kernels as per-row products and sums: each program decodes its weight tile once per
    loop step and multiplies it with each of the R rows (unrolled), so no MMA operand layout and
    no padded rows. Under `tiles.skip_rows`, a row that did not select the program's expert (its
    routing weight 0) is skipped: its h is 0 and its down output is never combined. Per-slot
    outputs [M, R, D] in the compute dtype."""
    r, d = x.shape
    m, f, dtype = experts.shape[0], w1[0].shape[1], x.dtype
    params = pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    experts, dense_t = experts.astype(jnp.int32), dense.T.astype(jnp.float32)
    kernel = functools.partial(_gemv_kernel, fmt=fmt, rows=r, limit=limit, dtype=dtype, tiles=tiles)
    h = pl.pallas_call(
        functools.partial(kernel, k=d, n_w=2 * len(w1), per_slot=False),
        out_shape=jax.ShapeDtypeStruct((m, r, f), dtype), grid=(m, f // tiles.out),
        interpret=interpret, compiler_params=params, name="moe_gate_up",
    )(experts, dense_t, *_gemv_activations(fmt, x), *_by_group(fmt, w1), *_by_group(fmt, w3))
    return pl.pallas_call(
        functools.partial(kernel, k=f, n_w=len(w2), per_slot=True),
        out_shape=jax.ShapeDtypeStruct((m, r, d), dtype), grid=(m, d // tiles.out),
        interpret=interpret, compiler_params=params, name="moe_down",
    )(experts, dense_t, *_gemv_activations(fmt, h), *_by_group(fmt, w2))


def _gemv_activations(fmt: str, a: jax.Array) -> tuple[jax.Array, ...]:
    """fp4: even / odd columns of a [..., K] as [..., K/32, 16] (one scale group per row of 16);
    otherwise (a,)."""
    if fmt == "fp4":
        return tuple(half.reshape(*half.shape[:-1], half.shape[-1] // 16, 16) for half in _activations(fmt, a))
    return (a,)


def _gemv_weights(fmt, e, row0, c, w_refs, dtype, tiles) -> tuple[jax.Array, ...]:
    """One loop step's weight tile of expert e, decoded once for all rows: fp4 (low, high nibble
    values [out, nb, 16], scales [out, nb], or None where the values carry them), otherwise
    (w [out, step] float32,)."""
    out, step = tiles.out, tiles.step(fmt)
    w_rows = pl.ds(row0, out)
    if fmt == "fp4":
        packed_ref, scale_ref = w_refs
        nb = step // FP4_BLOCK
        blocks = pl.ds(pl.multiple_of(c * nb, nb), nb)
        packed, scale = packed_ref[e, w_rows, blocks, :], scale_ref[e, w_rows, blocks, :]  # [out, nb, 16 | 1]
        if tiles.decode == "prmt":  # scaled as it decodes
            return (*(v.astype(jnp.float32) for v in _fp4_values(packed, scale, "prmt", jnp.bfloat16)), None)
        return (*_e2m1_pair(packed.astype(jnp.int32), tiles.decode), _fp4_scale(scale[..., 0], tiles.decode))
    cols = pl.ds(pl.multiple_of(c * step, step), step)
    if fmt == "fp8":
        w_ref, scale_ref = w_refs
        s = scale_f32(scale_ref[e, row0 // FP8_BLOCK, c])
        w = (w_ref[e, w_rows, cols].astype(jnp.float32) * s).astype(dtype)  # rounded as the reference rounds it
        return (w.astype(jnp.float32),)
    return (w_refs[0][e, w_rows, cols].astype(jnp.float32),)


def _gemv_product(fmt, w: tuple, act: tuple) -> jax.Array:
    """One row's chunk (fp4: even, odd [nb, 16]; else [step]) . the decoded tile: float32 [out]
    (fp4: [out, nb], one sum per scale group, summed after the loop)."""
    if fmt == "fp4":
        lo, hi, s = w
        even, odd = (a.astype(jnp.float32)[None] for a in act)
        group_sums = jnp.sum(lo * even + hi * odd, axis=2)
        return group_sums if s is None else group_sums * s
    return jnp.sum(w[0] * act[0].astype(jnp.float32)[None], axis=1)


def _gemv_kernel(experts_ref, dense_ref, *refs, fmt, k, rows, limit, dtype, tiles, n_w, per_slot):
    """gate/up (refs: x, w1, w3; h = swiglu * dense) or down (per_slot: the slot's own rows of h,
    then w2) for one slot and `out` output features; dense [M, R] is each row's routing weight."""
    n_act = 2 if fmt == "fp4" else 1
    act_refs, w_refs, out_ref = refs[:n_act], refs[n_act:n_act + n_w], refs[-1]
    slot, tile = pl.program_id(0), pl.program_id(1)
    e = experts_ref[slot]
    row0 = pl.multiple_of(tile * tiles.out, tiles.out)
    lead = (slot,) if per_slot else ()
    selected = [dense_ref[slot, i] != 0 for i in range(rows)] if tiles.skip_rows else None
    step_k = tiles.step(fmt)

    def act(i, c):
        if fmt == "fp4":
            nb = step_k // FP4_BLOCK
            return tuple(ref[(*lead, i, pl.ds(pl.multiple_of(c * nb, nb), nb), slice(None))] for ref in act_refs)
        return (act_refs[0][(*lead, i, pl.ds(pl.multiple_of(c * step_k, step_k), step_k))],)

    groups = [w_refs[:n_w // 2], w_refs[n_w // 2:]] if not per_slot else [w_refs]

    def step(c, acc):
        tiles_w = [_gemv_weights(fmt, e, row0, c, ws, dtype, tiles) for ws in groups]
        new = []
        for j, w in enumerate(tiles_w):
            for i in range(rows):
                add = lambda a, w=w, i=i: a + _gemv_product(fmt, w, act(i, c))
                a = acc[j * rows + i]
                new.append(jax.lax.cond(selected[i], add, lambda a: a, a) if tiles.skip_rows else add(a))
        return tuple(new)

    shape = (tiles.out, step_k // FP4_BLOCK) if fmt == "fp4" else (tiles.out,)
    acc = _loop_k(e, k // step_k, step, tuple(jnp.zeros(shape, jnp.float32) for _ in range(rows * len(groups))))
    sums = [jnp.sum(a, axis=1) if fmt == "fp4" else a for a in acc]
    cols = pl.ds(row0, tiles.out)
    for i in range(rows):
        if per_slot:
            out_ref[slot, i, cols] = sums[i].astype(dtype)
        else:
            h = swiglu(sums[i].astype(dtype), sums[rows + i].astype(dtype), limit) * dense_ref[slot, i]
            out_ref[slot, i, cols] = h.astype(dtype)
