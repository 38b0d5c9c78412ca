"""A training loop bounded by wall-clock time rather than a step count.

The first call compiles; steps 1..`probe` are timed, and the total step count (where the cosine
schedule ends) is then fixed so that training ends at the budget. Logs a line every `log_every`
steps and returns the history (step, seconds, metrics) for the JSON record.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def run(step: Callable[[int], dict], budget_s: float, set_total: Callable[[int], None], *, probe: int = 20,
        log_every: int = 100, evaluate: Callable[[], dict] | None = None, eval_every: int = 0) -> dict:
    start = time.perf_counter()
    history, total, compile_s, timed_from = [], None, None, None
    i = 0
    while total is None or i < total:
        info = step(i)
        if i == 0:
            jax.block_until_ready(info)
            compile_s = time.perf_counter() - start
            timed_from = time.perf_counter()
        elif i == probe:
            jax.block_until_ready(info)
            per_step = (time.perf_counter() - timed_from) / probe
            total = max(probe + 1, int((budget_s - (time.perf_counter() - start)) / per_step) + probe)
            set_total(total)
            print(f"compile {compile_s:.1f} s, {per_step * 1e3:.1f} ms/step -> {total} steps", flush=True)
        i += 1
        if i % log_every == 0 or i == total:
            row = {"step": i, "seconds": round(time.perf_counter() - start, 2),
                   **{k: np.asarray(v).round(4).tolist() for k, v in info.items()}}
            if evaluate is not None and eval_every and (i % eval_every == 0 or i == total):
                row.update({f"heldout_{k}": v for k, v in evaluate().items()})
            history.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return {"steps": i, "compile_s": compile_s, "seconds": time.perf_counter() - start, "history": history}
