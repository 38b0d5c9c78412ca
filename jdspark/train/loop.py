"""A training loop bounded by wall-clock time rather than a step count.

The first call compiles; steps 1..`probe` are timed, and the total step count (where the cosine
schedule ends) is then fixed so that training ends at the budget. With an `evaluate` every
`eval_every` steps, one evaluation runs at the probe as well (the held-out figure near the start),
and its time (compilation included, so an over-estimate) is charged to every `eval_every` steps:
evaluations are part of the budget, not added to it. Logs a line every `log_every` steps and
returns the history (step, seconds, metrics) for the JSON record. Time is read from `clock`
(`time.perf_counter` unless a test passes a fake one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def run(step: Callable[[int], dict], budget_s: float, set_total: Callable[[int], None], *, probe: int = 20,
        log_every: int = 100, evaluate: Callable[[], dict] | None = None, eval_every: int = 0,
        clock: Callable[[], float] = time.perf_counter) -> dict:
    start = clock()
    history, total, compile_s, timed_from = [], None, None, None
    evaluating = evaluate is not None and eval_every > 0
    i = 0
    while total is None or i < total:
        info = step(i)
        if i == 0:
            jax.block_until_ready(info)
            compile_s = clock() - start
            timed_from = clock()
        elif i == probe:
            jax.block_until_ready(info)
            per_step = (clock() - timed_from) / probe
            eval_s, row = 0.0, None
            if evaluating:
                eval_start = clock()
                row = _row(i + 1, clock() - start, info, evaluate)  # after probe + 1 steps
                eval_s = clock() - eval_start
            cost = per_step + (eval_s / eval_every if evaluating else 0.0)  # per step, evaluations spread
            total = max(probe + 1, int((budget_s - (clock() - start)) / cost) + probe)
            set_total(total)
            print(f"compile {compile_s:.1f} s, {per_step * 1e3:.1f} ms/step"
                  + (f", evaluation {eval_s:.1f} s" if evaluating else "") + f" -> {total} steps", flush=True)
            if row is not None:
                _log(history, row)
        i += 1
        if i % log_every == 0 or i == total:
            due = evaluating and (i % eval_every == 0 or i == total)
            _log(history, _row(i, clock() - start, info, evaluate if due else None))
    return {"steps": i, "compile_s": compile_s, "seconds": clock() - start, "history": history}


def _row(i: int, seconds: float, info: dict, evaluate: Callable[[], dict] | None) -> dict:
    row = {"step": i, "seconds": round(seconds, 2),
           **{k: np.asarray(v).round(4).tolist() for k, v in info.items()}}
    if evaluate is not None:
        row.update({f"heldout_{k}": v for k, v in evaluate().items()})
    return row


def _log(history: list[dict], row: dict) -> None:
    history.append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
