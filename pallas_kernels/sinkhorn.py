"""The mHC Sinkhorn projection (spec dsv4.md §5.2) as one Pallas kernel per call.

The projection of each token's C x C comb logits is a row softmax (+eps), a column normalisation,
then iters-1 row-then-column normalisations. On the GPU the jnp form is a device loop of
iters-1 iterations per mHC site — at least one kernel launch per iteration, 19 x 12 sites per
decode step of the embedded model — while the arithmetic is a few hundred flops per token. The
kernel runs every iteration of a tile of tokens in registers in one launch.

`sinkhorn` (Pallas: Triton on the GPU, interpret mode on CPU, one source) equals `ref_sinkhorn`
(plain jnp) to float32 rounding: the same operations in the same order, only exp and division
may round differently on the two backends. It is differentiable: the backward pass is the
reference's, at the same inputs.

Kernel layout: the logits flattened to [N, C, C]; grid (ceil(N / tile),). Each program loads its
tile of tokens as C * C vectors (entry (i, j) of every token: strided loads of a few hundred
bytes), so every reduction over the C = 4 streams is C - 1 adds of vectors and nothing needs a
block reshape. The tile is a power of two <= N and the last tile is shifted back to end at N, so
no access is out of bounds (rows computed twice get the same values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import interpret_mode

TILE = 128  # tokens per program


def ref_sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax (+eps), column normalisation, then iters-1 x (row, column) normalisations."""
    p = jax.nn.softmax(logits, axis=-1) + eps
    p = p / (jnp.sum(p, axis=-2, keepdims=True) + eps)

    def row_then_column(_, p):
        p = p / (jnp.sum(p, axis=-1, keepdims=True) + eps)
        return p / (jnp.sum(p, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, row_then_column, p)  # a loop, not 19 unrolled copies


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def sinkhorn(logits: jax.Array, iters: int, eps: float, interpret: bool | None = None) -> jax.Array:
    """`ref_sinkhorn` as a Pallas kernel: logits [..., C, C] float32 -> doubly stochastic [..., C, C].
    interpret=None runs interpret mode exactly on the CPU (`interpret_mode`)."""
    *lead, c, c2 = logits.shape
    if c != c2:
        raise ValueError(f"comb logits of shape {logits.shape}: the last two axes must be equal (C x C)")
    n = 1
    for size in lead:
        n *= size
    if n == 0:
        return logits
    tile = min(TILE, 1 << (n.bit_length() - 1))
    interpret = interpret_mode(interpret)
    out = pl.pallas_call(
        functools.partial(_kernel, n=n, c=c, iters=iters, eps=eps, tile=tile),
        out_shape=jax.ShapeDtypeStruct((n, c, c), jnp.float32),
        grid=(-(-n // tile),),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="mhc_sinkhorn",
    )(logits.astype(jnp.float32).reshape(n, c, c))
    return out.reshape(logits.shape)


def _forward(logits, iters, eps, interpret):
    return sinkhorn(logits, iters, eps, interpret), logits


def _backward(iters, eps, interpret, logits, grad):
    return jax.vjp(lambda x: ref_sinkhorn(x, iters, eps), logits)[1](grad)


sinkhorn.defvjp(_forward, _backward)


def _kernel(x_ref, o_ref, *, n, c, iters, eps, tile):
    start = jnp.minimum(pl.program_id(0) * tile, n - tile)
    rows = pl.ds(start, tile)
    p = [[x_ref[rows, i, j] for j in range(c)] for i in range(c)]  # p[i][j]: entry (i, j) of each token

    def total(values):
        out = values[0]
        for v in values[1:]:
            out = out + v
        return out

    def rows_normalised(p):
        sums = [total(row) + eps for row in p]
        return [[v / s for v in row] for row, s in zip(p, sums)]

    def columns_normalised(p):
        sums = [total([p[i][j] for i in range(c)]) + eps for j in range(c)]
        return [[v / sums[j] for j, v in enumerate(row)] for row in p]

    softmax = []
    for row in p:
        top = functools.reduce(jnp.maximum, row)
        e = [jnp.exp(v - top) for v in row]
        s = total(e)
        softmax.append([v / s + eps for v in e])
    p = columns_normalised(softmax)

    def step(_, flat):
        p = [list(flat[i * c:(i + 1) * c]) for i in range(c)]
        p = columns_normalised(rows_normalised(p))
        return tuple(v for row in p for v in row)

    flat = jax.lax.fori_loop(0, iters - 1, step, tuple(v for row in p for v in row))
    for i in range(c):
        for j in range(c):
            o_ref[rows, i, j] = flat[i * c + j]
