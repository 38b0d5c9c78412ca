"""Placement of routed experts between the GPU and the host banks.

`plan_placement(sizes, gpu_budget_bytes, counts)` decides which (layer, expert) live on the GPU:

- Everything that fits stays on the GPU. Otherwise `deficit = total - budget` bytes of experts go to
  the host.
- Hot experts first: routing counts (measured on calibration text, or given; uniform when absent)
  rank a layer's experts; the host takes the coldest per byte.
- Cold experts grouped into few layers: every layer that has host experts costs one host round trip
  per step (one batched callback per MoE layer), so the host experts are gathered into m layers. For
  each m from the fewest that can hold the deficit up to all layers, the m layers whose coldest
  experts cover deficit/m bytes at the lowest routed share are chosen, and the globally coldest
  experts of those layers go to the host until the deficit is met. The m kept is the one with the
  least expected host time per token: expected host expert bytes / host GEMV bandwidth + m x the
  cost of a round trip (both arguments, defaulting to the measured ~40 GB/s and 0.25 ms).

`Placement.report()` is the start-up line: GB on GPU and host, and the expected share of routed uses
served by the host ("host 72.6% / GPU 27.4%" in the reference's terms).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Placement:
    on_gpu: np.ndarray        # bool [L, E]
    sizes: np.ndarray         # int64 [L, E] bytes
    probs: np.ndarray         # float64 [L, E]: share of a layer's routed uses per expert (rows sum to 1)
    measured: bool            # whether routing counts were given
    top_k: int
    budget: int
    layer_ids: tuple[int, ...] | None = None  # model layer id of each row (default 0..L-1)

    @property
    def gpu_bytes(self) -> int:
        return int(self.sizes[self.on_gpu].sum())

    @property
    def host_bytes(self) -> int:
        return int(self.sizes[~self.on_gpu].sum())

    @property
    def host_layers(self) -> list[int]:
        """Rows (layers) with at least one host expert: one host round trip each per step."""
        return [int(i) for i in np.flatnonzero((~self.on_gpu).any(axis=1))]

    def host_experts(self, layer: int) -> np.ndarray:
        return np.flatnonzero(~self.on_gpu[layer]).astype(np.int32)

    def host_map(self) -> dict[int, list[int]]:
        """model layer id -> its host experts, for the layers that have some (`with_host_experts`)."""
        names = self.layer_ids or tuple(range(self.on_gpu.shape[0]))
        return {names[i]: self.host_experts(i).tolist() for i in self.host_layers}

    def gpu_experts(self, layer: int) -> np.ndarray:
        return np.flatnonzero(self.on_gpu[layer]).astype(np.int32)

    @property
    def host_share(self) -> float:
        """Expected share of all routed uses (over layers, each layer equally many) served on the host."""
        return float((self.probs * ~self.on_gpu).sum() / self.probs.shape[0])

    @property
    def host_bytes_per_token(self) -> float:
        """Expected host expert bytes a single token reads: top_k uses per layer, each reading its expert."""
        return float(self.top_k * (self.probs * self.sizes * ~self.on_gpu).sum())

    def report(self) -> str:
        n_l, n_e = self.on_gpu.shape
        n_host = int((~self.on_gpu).sum())
        names = self.layer_ids or tuple(range(n_l))
        layers = [names[i] for i in self.host_layers]
        shown = ", ".join(map(str, layers[:12])) + (", ..." if len(layers) > 12 else "")
        src = "measured routing counts" if self.measured else "uniform routing assumed"
        host = (f"host {self.host_bytes / 1e9:.2f} GB ({n_host} experts in {len(layers)} layers"
                + (f": {shown})" if layers else ")"))
        return (f"experts: {n_l} layers x {n_e}, {self.sizes.sum() / 1e9:.2f} GB; budget "
                f"{self.budget / 1e9:.2f} GB: GPU {self.gpu_bytes / 1e9:.2f} GB ({n_l * n_e - n_host} experts), "
                f"{host}; routed uses: host {100 * self.host_share:.1f}% / GPU {100 * (1 - self.host_share):.1f}% "
                f"({src}); host reads ~{self.host_bytes_per_token / 1e9:.3f} GB/token, "
                f"{len(layers)} host round trips/step")


def _normalise(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, np.float64)
    if (counts < 0).any():
        raise ValueError("routing counts must be >= 0")
    tot = counts.sum(axis=1, keepdims=True)
    uniform = np.full_like(counts, 1.0 / counts.shape[1])
    return np.where(tot > 0, counts / np.where(tot > 0, tot, 1.0), uniform)


def plan_placement(sizes, gpu_budget_bytes: float, counts=None, *, top_k: int = 6, host_GBps: float = 40.0,
                   round_trip_ms: float = 0.25, max_host_layers: int | None = None,
                   layer_ids=None) -> Placement:
    """Choose the GPU experts. sizes [L, E] bytes per (layer, expert); counts [L, E] routing counts
    (None: uniform); max_host_layers caps the layers holding host experts (None: chosen by the cost
    model). Raises ValueError when the budget cannot be met within max_host_layers."""
    sizes = np.asarray(sizes, np.int64)
    if sizes.ndim != 2 or (sizes < 0).any():
        raise ValueError(f"sizes must be a [layers, experts] array of byte counts, got shape {list(sizes.shape)}")
    probs = _normalise(np.ones(sizes.shape) if counts is None else counts)
    if probs.shape != sizes.shape:
        raise ValueError(f"counts {list(probs.shape)} and sizes {list(sizes.shape)} differ")
    budget = int(max(gpu_budget_bytes, 0))
    n_l = sizes.shape[0]
    kw = dict(sizes=sizes, probs=probs, measured=counts is not None, top_k=top_k, budget=budget,
              layer_ids=tuple(layer_ids) if layer_ids is not None else None)
    deficit = int(sizes.sum()) - budget
    if deficit <= 0:
        return Placement(on_gpu=np.ones(sizes.shape, bool), **kw)

    # per layer, experts from the coldest per byte
    density = probs / np.maximum(sizes, 1)
    order = np.argsort(density, axis=1, kind="stable")
    cum_bytes = np.cumsum(np.take_along_axis(sizes, order, 1), axis=1)
    cum_prob = np.cumsum(np.take_along_axis(probs, order, 1), axis=1)
    capacity = cum_bytes[:, -1]
    caps = np.sort(capacity)[::-1]
    m_min = int(np.searchsorted(np.cumsum(caps), deficit) + 1)
    m_max = n_l if max_host_layers is None else min(n_l, max_host_layers)
    if m_min > m_max:
        raise ValueError(f"the experts need {deficit / 1e9:.2f} GB off the GPU budget of {budget / 1e9:.2f} GB, "
                         f"more than {m_max} layers hold: raise the budget or max_host_layers")

    best = None
    for m in range(m_min, m_max + 1):
        on_gpu = _evict(m, deficit, sizes, density, order, cum_bytes, cum_prob, capacity)
        if on_gpu is None:
            continue
        p = Placement(on_gpu=on_gpu, **kw)
        cost = p.host_bytes_per_token / (host_GBps * 1e9) + len(p.host_layers) * round_trip_ms * 1e-3
        if best is None or cost < best[0] - 1e-12:
            best = (cost, p)
    return best[1]


def _evict(m, deficit, sizes, density, order, cum_bytes, cum_prob, capacity):
    """GPU mask with the host experts in m layers: the layers cheapest to take deficit/m bytes from,
    then their globally coldest experts until the deficit is met; None if those m cannot hold it."""
    share = deficit / m
    idx = np.minimum(np.array([np.searchsorted(cb, share) for cb in cum_bytes]), sizes.shape[1] - 1)
    cost = np.where(capacity >= share, cum_prob[np.arange(len(idx)), idx], np.inf)
    # layers that cannot hold a share still count when the chosen ones together can
    chosen = np.argsort(np.where(np.isfinite(cost), cost, 1e9 + capacity.max() - capacity), kind="stable")[:m]
    if capacity[chosen].sum() < deficit:
        return None
    cand_l = np.repeat(chosen, sizes.shape[1])
    cand_e = order[chosen].reshape(-1)
    pick = np.lexsort((cand_l, density[cand_l, cand_e]))
    on_gpu = np.ones(sizes.shape, bool)
    moved = 0
    for i in pick:
        if moved >= deficit:
            break
        l, e = cand_l[i], cand_e[i]
        on_gpu[l, e] = False
        moved += int(sizes[l, e])
    return on_gpu


def expert_sizes(n_layers: int, n_experts: int, fmt: str, dim: int, inter: int, scale_dtype: str = "e8m0") -> np.ndarray:
    """[L, E] bytes when every routed expert has the same stored size (the usual case)."""
    from jdspark.experts.banks import weight_bytes
    return np.full((n_layers, n_experts), weight_bytes(fmt, dim, inter, scale_dtype), np.int64)


def routing_counts(expert_ids, n_layers: int, n_experts: int) -> np.ndarray:
    """Counts [L, E] from routed expert ids [L, tokens, K] (or a list of per-layer arrays) recorded
    on calibration text."""
    out = np.zeros((n_layers, n_experts), np.int64)
    for layer, ids in enumerate(expert_ids):
        out[layer] = np.bincount(np.asarray(ids).reshape(-1), minlength=n_experts)[:n_experts]
    return out
