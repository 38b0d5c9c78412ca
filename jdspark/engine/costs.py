"""Measured verify costs V(k), cached on disk per (device kind, model config, engine config).

V(k) is the median wall time of N synchronised calls of the compiled width-k verify executable on
the engine's state, after one warm-up call. Every slot is active and verifies k rows, as in a full
batch step (idle slots skip writes, so an idle profile under-counts what a width costs); the state
is reset before each call (outside the timed region), so the profile leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("JDSPARK_CACHE", Path.home() / ".cache" / "jdspark")) / "costs"


def cost_key(model_config: dict, dtype: str, engine_config: dict) -> str:
    """A stable key: the device kind plus a hash of everything that changes the executables."""
    blob = json.dumps({"model": model_config, "dtype": dtype, "engine": engine_config, "profile": "active slots"},
                      sort_keys=True, default=str)
    kind = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def measure(run_width, widths, runs: int, reset=lambda: None) -> list[float]:
    """Median seconds of `runs` timed calls per width; `run_width(k)` runs and blocks on one call,
    `reset()` (untimed) runs before each call."""
    costs = []
    for k in widths:
        reset()
        run_width(k)  # warm-up
        times = []
        for _ in range(runs):
            reset()
            start = time.perf_counter()
            run_width(k)
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
    return costs


def load_or_measure(key: str, run_width, widths, runs: int, cache_dir: Path | None, reprofile: bool,
                    reset=lambda: None) -> list[float]:
    path = (cache_dir or default_cache_dir()) / f"{key}.json"
    if path.exists() and not reprofile:
        data = json.loads(path.read_text())
        if data.get("widths") == list(widths):
            log.info("verify costs from %s: %s", path, _fmt(data["verify_costs_s"]))
            return data["verify_costs_s"]
    costs = measure(run_width, widths, runs, reset)
    log.info("profiled verify costs (median of %d runs): %s", runs, _fmt(costs))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"widths": list(widths), "verify_costs_s": costs, "runs": runs}, indent=1))
    return costs


def _fmt(costs) -> str:
    return ", ".join(f"V({k})={c * 1e3:.2f}ms" for k, c in enumerate(costs))
