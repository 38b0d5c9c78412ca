"""A plain numpy reference of the routed-expert forward over a host bank, built from the independent
decoders of tests/model/dequant_ref.py, with the rounding points of jdspark.model.moe.Experts."""

import ml_dtypes
import numpy as np

from tests.model.dequant_ref import decode_fp4, decode_fp8


def dense_expert(bank, e: int, dtype: str):
    """Global expert e -> (w1 [F, D], w3 [F, D], w2 [D, F]) float32, as the model dequantizes them
    (cast to the model dtype)."""
    t = bank.expert(e)
    if bank.fmt == "fp4":
        ws = [decode_fp4(t[w].view(np.int8), t[s]) for w, s in (("w1", "s1"), ("w3", "s3"), ("w2", "s2"))]
    elif bank.fmt == "fp8":
        ws = [decode_fp8(t[w], t[s]) for w, s in (("w1", "s1"), ("w3", "s3"), ("w2", "s2"))]
    else:
        ws = [(t[w].astype(np.uint32) << 16).view(np.float32) for w in ("w1", "w3", "w2")]
    return [_round(w.astype(np.float32), dtype) for w in ws]


def _round(v, dtype):
    return v.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else v.astype(np.float32)


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference_forward(bank, x, ids, weights, *, limit=0.0, dtype="float32"):
    x = np.asarray(x, np.float32)
    r, k = ids.shape
    y = np.zeros((r, bank.dim), np.float32)
    cache = {}
    for i in range(r):
        for j in range(k):
            e = int(ids[i, j])
            if bank.slot_of[e] < 0:
                continue
            if e not in cache:
                cache[e] = dense_expert(bank, e, dtype)
            w1, w3, w2 = cache[e]
            g = _round(w1.astype(np.float64) @ x[i].astype(np.float64), dtype)
            u = _round(w3.astype(np.float64) @ x[i].astype(np.float64), dtype)
            if limit > 0:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            h = _round(silu(g) * u * np.float32(weights[i, j]), dtype)
            out = _round(w2.astype(np.float64) @ h.astype(np.float64), dtype)
            y[i] += out
    return y
