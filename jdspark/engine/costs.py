"""Measured verify costs V(k), cached on disk per (device kind, model config, engine config).

V(k) is the median wall time of N synchronised calls of the compiled width-k verify executable on
the engine's real state, after one warm-up call. The calls have every slot idle (n_valid = 0), so
they change nothing, while the shapes, and so the work, are exactly those of a real step.
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
    blob = json.dumps({"model": model_config, "dtype": dtype, "engine": engine_config}, sort_keys=True, default=str)
    kind = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def measure(run_width, widths, runs: int) -> list[float]:
    """Median seconds of `runs` timed calls per width; `run_width(k)` runs and blocks on one call."""
    costs = []
    for k in widths:
        run_width(k)  # warm-up
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            run_width(k)
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
    return costs


def load_or_measure(key: str, run_width, widths, runs: int, cache_dir: Path | None, reprofile: bool) -> list[float]:
    path = (cache_dir or default_cache_dir()) / f"{key}.json"
    if path.exists() and not reprofile:
        data = json.loads(path.read_text())
        if data.get("widths") == list(widths):
            log.info("verify costs from %s: %s", path, _fmt(data["verify_costs_s"]))
            return data["verify_costs_s"]
    costs = measure(run_width, widths, runs)
    log.info("profiled verify costs (median of %d runs): %s", runs, _fmt(costs))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"widths": list(widths), "verify_costs_s": costs, "runs": runs}, indent=1))
    return costs


def _fmt(costs) -> str:
    return ", ".join(f"V({k})={c * 1e3:.2f}ms" for k, c in enumerate(costs))
