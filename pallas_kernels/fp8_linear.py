"""FP8 block-scaled linears read in place (spec dsv4.md §7.3): y = x @ dequant(W)^T for few rows.

`fp8_linear(x, weight, scale)` (Pallas: Triton on the GPU, interpret mode on the CPU) equals
`ref_fp8_linear` (plain jnp: the weight decoded to float32, one float32 product) up to float32
summation order. Inputs: x [R, K] in the compute dtype (bfloat16 or float32), R <= 64; weight e4m3
[N, K]; scale [N/128, K/128], e8m0 bytes or float32 (the -Base variants). Output float32 [R, N].
A grouped linear (the attention's `wo_a`: G groups, each its own input) takes x [R, G, K]: output
features [g * N/G, (g+1) * N/G) read group g.

Why a kernel: decode and verify multiply 1..6 rows by each weight, so a linear costs the bytes of
its weight. The XLA formulations either write a decoded copy of the weight per call, or do one
product per (row, K block) (`jdspark.model.dequant.fp8_block_matmul`: 2.5x the kernel's device
time at 6 rows on the H200), or scale x per output block (`fp8_scaled_x_matmul`: faster than this
kernel alone, but more kernels per linear); in the model this kernel made the 6-row verify 11-16%
faster (docs/BENCHMARKS.md, "Decode at Flash dimensions"). Here one program owns `out` output
features and a chunk of K: it loads each [out, 128] e4m3 tile once, converts it exactly to the
compute dtype (e4m3 has fewer mantissa bits than bf16), multiplies it with the rows (w @ x^T: the
weights on the MMA's M side, the rows padded to 16 on its N side) and adds the float32 partial
times the tile's block scale. Chunks of K run in separate programs when the output features alone
give too few programs to fill the GPU; their float32 partials are summed after the call in a fixed
order: element by element, part 0 first. (A `jnp.sum` over the parts, fused with the row slice, was
the one step whose shape depended on the call's row count, and on the H100 a row's bits then
differed between calls of 1 and 6 rows: XLA may reduce in another order for another shape.)

Batch invariance: rows are padded to 16 for every call of at most 16 rows, so such calls run the
same compiled kernel and a row's output does not depend on the other rows (the MMA computes each
output element from its own row), bit for bit (a `gpu` test checks rows 1..6).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.moe import FP8_BLOCK, decode, scale_f32

BLOCK = FP8_BLOCK  # rows and columns per scale
MAX_ROWS = 64
MAX_ELEMENTS = 2 ** 31  # Triton's int32 offsets
TARGET_PROGRAMS = 256  # enough programs to keep every multiprocessor of an H200 (132) busy


@dataclasses.dataclass(frozen=True)
class Tiles:
    """`out` output features per program (divides 128: one block scale per tile and step); `split`
    K chunks in separate programs (0: as many as make about TARGET_PROGRAMS programs); Triton warps
    and pipeline stages; `swap`: each product as w_tile @ x^T (the weights on the MMA's M side),
    else x @ w_tile^T (the rows on it)."""

    out: int = 64
    split: int = 0
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True

    def splits(self, n: int, k: int) -> int:
        """K chunks for an [N, K] weight: a power of two dividing K / 128."""
        blocks = k // BLOCK
        want = self.split or max(1, TARGET_PROGRAMS // max(1, n // self.out))
        split = 1
        while split * 2 <= min(want, blocks) and blocks % (split * 2) == 0:
            split *= 2
        return split


TILES = Tiles()


def ref_fp8_linear(x: jax.Array, weight: jax.Array, scale: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Plain jnp: x [R, K] (or [R, G, K]: group g feeds output rows g*N/G...) @ (e4m3 weight [N, K]
    times its block scales)^T in float32, [R, N]."""
    del interpret
    n, k = weight.shape
    w = decode("fp8", (weight, scale), jnp.float32)
    xg = x.reshape(x.shape[0], -1, k).astype(jnp.float32)
    y = jnp.einsum("rgk,gnk->rgn", xg, w.reshape(xg.shape[1], -1, k), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape[0], n)


def supported(n: int, k: int, rows: int, tiles: Tiles | None = None, groups: int = 1) -> bool:
    """Whether `fp8_linear` takes these sizes (else use the reference or an XLA form)."""
    tiles = tiles or TILES
    return (0 < rows <= MAX_ROWS and n % tiles.out == 0 and BLOCK % tiles.out == 0 and k % BLOCK == 0
            and n % (groups * BLOCK) == 0 and n * k < MAX_ELEMENTS)


def fp8_linear(x: jax.Array, weight: jax.Array, scale: jax.Array, *, interpret: bool = False,
               tiles: Tiles | None = None) -> jax.Array:
    """`ref_fp8_linear` reading the e4m3 weight once, in place. float32 [R, N]."""
    tiles = tiles or TILES
    r, k = x.shape[0], x.shape[-1]
    n = weight.shape[0]
    groups = x.shape[1] if x.ndim == 3 else 1
    if not supported(n, k, r, tiles, groups) or weight.shape[1] != k or scale.shape != (n // BLOCK, k // BLOCK):
        raise ValueError(f"fp8_linear: unsupported sizes R={r} G={groups} N={n} K={k} weight {weight.shape} scale "
                         f"{scale.shape}; use ref_fp8_linear")
    rp = max(16, 1 << (r - 1).bit_length())
    xp = jnp.pad(x.reshape(r, groups, k), ((0, rp - r), (0, 0), (0, 0)))  # a pad fuses into x's producer
    split = tiles.splits(n, k)
    partial = pl.pallas_call(
        functools.partial(_kernel, steps=k // BLOCK // split, out=tiles.out, group_rows=n // groups, swap=tiles.swap),
        out_shape=jax.ShapeDtypeStruct((split, rp, n), jnp.float32),
        grid=(n // tiles.out, split),
        interpret=interpret, name="fp8_linear",
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
    )(xp, weight, scale)
    return functools.reduce(jnp.add, [partial[i, :r] for i in range(split)])  # one order for every shape


def _kernel(x_ref, w_ref, s_ref, o_ref, *, steps: int, out: int, group_rows: int, swap: bool):
    tile, part = pl.program_id(0), pl.program_id(1)
    row0 = pl.multiple_of(tile * out, out)
    rows = pl.ds(row0, out)
    group = row0 // group_rows
    dtype = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def step(c, acc):
        block = part * steps + c
        cols = pl.ds(pl.multiple_of(block * BLOCK, BLOCK), BLOCK)
        w = w_ref[rows, cols].astype(dtype)  # exact: e4m3 values are bf16 values
        a, b = (w, x_ref[:, group, cols]) if swap else (x_ref[:, group, cols], w)
        y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)  # [out, Rp], or [Rp, out]
        return acc + y * scale_f32(s_ref[row0 // BLOCK, block])

    shape = (out, x_ref.shape[0]) if swap else (x_ref.shape[0], out)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
    o_ref[part, :, rows] = acc.T if swap else acc
