"""The numba implementation of `cpu_gemv.moe_forward` (same plan, same rounding points), kept to
measure it against the C++ kernel (`jdspark bench bw` times both). Threads: `numba.prange` over
(expert, output tile). Decoding goes through 16- and 256-entry float tables (E2M1, e4m3, e8m0), which
LLVM does not turn into SIMD shuffles: the C++ kernel's register decoding is the faster of the two.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0 = np.array([2.0 ** (b - 127) for b in range(255)] + [np.nan], np.float32)


def _e4m3_table() -> np.ndarray:
    t = np.empty(256, np.float32)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        t[b] = np.nan if (e == 15 and m == 7) else (-mag if s else mag)
    return t


E4M3 = _e4m3_table()
FP4, FP8_E8M0, FP8_F32, BF16 = 0, 1, 2, 3


@njit(inline="always")
def _bf16(v, fbuf, ubuf):
    fbuf[0] = v
    u = ubuf[0]
    ubuf[0] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return fbuf[0]


@njit(inline="always")
def _dot(fmt, u8, u16, f32, off_w, off_s, row, K, xv, round_w, wtmp, fbuf, ubuf):
    acc = np.float32(0.0)
    if fmt == FP4:
        base = off_w + row * (K // 2)
        sbase = off_s + row * (K // 32)
        for b in range(K // 32):
            blk = np.float32(0.0)
            for j in range(16):
                q = u8[base + 16 * b + j]
                blk += E2M1[q & 15] * xv[32 * b + 2 * j] + E2M1[q >> 4] * xv[32 * b + 2 * j + 1]
            acc += blk * E8M0[u8[sbase + b]]
    elif fmt == BF16:
        base = (off_w >> 1) + row * K
        for k in range(K):
            wtmp[k] = np.uint32(u16[base + k]) << np.uint32(16)
        wf = wtmp[:K].view(np.float32)
        for k in range(K):
            acc += wf[k] * xv[k]
    else:
        nb = (K + 127) // 128
        base = off_w + row * K
        for b in range(nb):
            if fmt == FP8_F32:
                s = f32[(off_s >> 2) + (row // 128) * nb + b]
            else:
                s = E8M0[u8[off_s + (row // 128) * nb + b]]
            blk = np.float32(0.0)
            k1 = min(K, 128 * (b + 1))
            if round_w:
                for k in range(128 * b, k1):
                    blk += _bf16(E4M3[u8[base + k]] * s, fbuf, ubuf) * xv[k]
                acc += blk
            else:
                for k in range(128 * b, k1):
                    blk += E4M3[u8[base + k]] * xv[k]
                acc += blk * s
    return acc


@njit(cache=True)
def _scratch(n):
    """One thread's buffers: n words for a row of decoded weights, and a float32 with its bits
    (the bf16 rounding reads a float's bits through them)."""
    fbuf = np.empty(1, np.float32)
    return np.empty(n, np.uint32), fbuf, fbuf.view(np.uint32)


@njit(parallel=True, cache=True)
def _phase(down, fmt, u8, u16, f32, off, stride, D, F, x, uniq_slot, pstart, pair_row, pair_w, pair_out, h, out,
           limit, rnd, tile):
    """One GEMV phase, threads over (expert, tile of output rows): gate and up into h [pairs, F],
    or (`down`) h through w2 into out [rows x k, D]."""
    n_rows = D if down else F
    round_w = rnd and fmt == FP8_F32
    n_tiles = (n_rows + tile - 1) // tile
    for item in prange(uniq_slot.shape[0] * n_tiles):
        u, t = item // n_tiles, item % n_tiles
        at = off + uniq_slot[u] * stride  # the slot's tensors (w1, w3, w2, s1, s3, s2) in the bank's bytes
        wtmp, fbuf, ubuf = _scratch(max(D, F))
        for row in range(t * tile, min(n_rows, (t + 1) * tile)):
            for p in range(pstart[u], pstart[u + 1]):
                if down:
                    o = _dot(fmt, u8, u16, f32, at[2], at[5], row, F, h[p], round_w, wtmp, fbuf, ubuf)
                    out[pair_out[p], row] = _bf16(o, fbuf, ubuf) if rnd else o
                    continue
                xv = x[pair_row[p]]
                g = _dot(fmt, u8, u16, f32, at[0], at[3], row, D, xv, round_w, wtmp, fbuf, ubuf)
                up = _dot(fmt, u8, u16, f32, at[1], at[4], row, D, xv, round_w, wtmp, fbuf, ubuf)
                if rnd:
                    g, up = _bf16(g, fbuf, ubuf), _bf16(up, fbuf, ubuf)
                if limit > 0:
                    g = min(g, limit)
                    up = min(max(up, -limit), limit)
                v = g / (np.float32(1.0) + np.exp(-g)) * up * pair_w[p]
                h[p, row] = _bf16(v, fbuf, ubuf) if rnd else v


@njit(parallel=True, cache=True)
def _sum_pairs(out, covered, y):
    """y[r] = the sum of row r's covered expert outputs."""
    r_, k_ = y.shape[0], covered.shape[0] // y.shape[0]
    for r in prange(r_):
        for d in range(y.shape[1]):
            y[r, d] = 0.0
        for k in range(k_):
            if covered[r * k_ + k]:
                for d in range(y.shape[1]):
                    y[r, d] += out[r * k_ + k, d]


def forward(bank, x: np.ndarray, plan, limit: float, round_bf16: bool, threads: int, fmt: int,
            tiles: tuple[int, int]) -> np.ndarray:
    """The C++ kernel's plan run by numba; `fmt` is the kernel's format code, `tiles` its (F, D) tiles."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    r, d, f = x.shape[0], bank.dim, bank.inter
    y = np.zeros((r, d), np.float32)
    if plan.n_pairs == 0:
        return y
    off, stride = bank.addressing()
    u8 = bank.data
    h = np.zeros((plan.n_pairs, f), np.float32)
    out = np.zeros((r * plan.k, d), np.float32)
    args = (fmt, u8, u8.view(np.uint16), u8.view(np.float32), off, stride, d, f, x, plan.uniq_slot, plan.pstart,
            plan.pair_row, plan.pair_w, plan.pair_out, h, out, np.float32(limit), bool(round_bf16))
    _phase(False, *args, tiles[0])
    _phase(True, *args, tiles[1])
    _sum_pairs(out, plan.covered, y)
    return y
