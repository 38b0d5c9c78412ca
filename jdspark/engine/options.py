"""How an engine speculates: its options and the shape of a width policy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jdspark.speculative.selector import FallbackBreaker

WidthPolicy = Callable[[np.ndarray], int]  # stale confidences [gamma] of one request -> width k
BATCH_WIDTHS = ("per_request", "padded", "budget")  # how a batch's rows get widths: jdspark.engine.widths
PROFILES = ("synchronised", "queued")  # how the executables' costs are measured: jdspark.engine.costs
# `Engine.ride_prompts`' default: a prompt with at most this many tokens left rides in the verify calls.
# H100, 2026-12-06 (docs/BENCHMARKS.md, "Prompts riding in the verify calls, H100"): the embedded model, steady
# tok/s at c = 16 / 4 / 1 1.07-1.08 / 1.02-1.03 / 0.97-1.00 of the better of target-only and width 5 (0.78-1.01
# / 0.90-1.04 / 0.96-1.02 without riding); the Flash-dims model at c = 16, 16-token prompts: 0.95-0.97 (0.91-0.92);
# there 64-token prompts riding 6 tokens a call lost (0.78 against 0.93), so longer ones take prefill calls.
RIDE_PROMPTS = 16


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """How the engine speculates. `width=None` is adaptive (E(k)/(D+V(k)) from measured costs);
    an integer fixes the width. `fallback_threshold` > 0 turns on the acceptance breaker (0.60 /
    32 / 64 is the measured starting point of the reference). `pause_steps`: with adaptive widths, a
    request whose stale confidences say drafting does not pay at all (its best E(k)/(D+V(k)) below
    a plain decode call's 1/V_decode, as on a CPU where the drafter costs what the target does)
    decodes without drafting for that many steps, then drafts once to refresh its confidences;
    each further pause in a row is twice as long, up to 32x (0: never pause; every speculative
    step drafts). Costs are cached in `cost_cache_dir` (default ~/.cache/jdspark/costs) unless
    `reprofile`."""

    width: int | None = None
    fallback_threshold: float = 0.0
    fallback_min_drafted: int = 32
    fallback_cooldown: int = 64
    profile_runs: int = 7
    cost_cache_dir: str | None = None
    reprofile: bool = False
    log_every: int = 0  # steps between engine log lines (0: never)
    batch_widths: str = "per_request"
    pause_steps: int = 32
    first_confidence: str = "recent"  # where a new request's stale confidences start, and where a probe is
    # judged: "ones", or "recent" (the engine's running average, `sequence.ConfidencePrior`)
    profile: str = "queued"  # a cost: calls issued back to back, the rate of overlapped steps (which hide
    # the host's dispatch behind the device), or "synchronised": one call at a time, what steps cost without
    # overlap (`costs.measure_bucket`). Queued priced the H200's 1- and 8-slot engines' adaptive widths 10%
    # faster at c = 1 in both paired runs (1302 vs 1179, 1342 vs 1218 tok/s; docs/BENCHMARKS.md)
    calibrate: bool = True  # adaptive widths read stale confidences scaled to the acceptance the engine saw
    # after such confidences, per position, greedy and sampled apart (`speculative.calibration`)
    price_switches: bool = True  # adaptive widths price issuing another executable than the last one at
    # what such steps were seen to cost beyond the others (`live_costs.LiveCosts`; ~0 on the CPU)

    def __post_init__(self):
        if not isinstance(self.pause_steps, int) or self.pause_steps < 0:
            raise ValueError(f"pause_steps={self.pause_steps!r}: must be an integer >= 0 (0: never pause)")
        if self.first_confidence not in ("ones", "recent"):
            raise ValueError(f"first_confidence={self.first_confidence!r}: use 'ones' or 'recent'")
        if self.profile not in PROFILES:
            raise ValueError(f"profile={self.profile!r}: use one of {', '.join(PROFILES)}")
        if self.batch_widths not in BATCH_WIDTHS:
            raise ValueError(f"batch_widths={self.batch_widths!r}: use one of {', '.join(BATCH_WIDTHS)}")

    def breaker(self) -> FallbackBreaker | None:
        """A new request's acceptance breaker (None when `fallback_threshold` is 0); validates them."""
        return FallbackBreaker(self.fallback_threshold, self.fallback_min_drafted, self.fallback_cooldown) \
            if self.fallback_threshold else None
