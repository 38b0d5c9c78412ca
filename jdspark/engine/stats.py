"""One statistics record per engine step, and the readers of it.

The engine fills a `StepRecord` after every step; a request's `CompletionStats`, the engine's log
line (`LogCounters`), `jdspark profile` and the server's Prometheus counters all read that one
record, so the figures they show cannot disagree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RowRecord:
    """One request's part of a step."""

    request_id: int
    stale_confidence: np.ndarray  # [gamma]: the previous proposal's as stated (the choice read it calibrated)
    n_accepted: int  # drafts accepted (0 when the step verified none)
    emitted: tuple[int, ...]  # tokens the request received, after its stop conditions
    width: int = 0  # drafts this request verified (its own width; at most the step's)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    width: int  # the executable's width: the widest any row verified (0: a plain decode step, or width 0)
    seconds: float  # the step's wall time: its choice, call, read and emission (overlapped: since the read before)
    rows: tuple[RowRecord, ...]
    draft_cost_s: float | None  # D the width selector used (None: fixed width)
    verify_costs_s: tuple[float, ...] | None  # V(0..gamma) the selector used
    bucket: int = 0  # the batch bucket the call ran in
    drafted_call: bool = True  # False: a plain decode call (no row drafted)
    waited_s: float = 0.0  # of `seconds`, the read's wait for the device (the rest is the host's)
    ready: bool = False  # the device had finished the call when its read began: the host set the pace
    prompt_tokens: int = 0  # prompt tokens the call prefilled (`Engine.ride_prompts`, `prompt_segment`)

    @property
    def drafted(self) -> int:
        """Drafts verified in this step, over all its rows."""
        return sum(r.width for r in self.rows)

    def as_dict(self) -> dict:
        return {"width": self.width, "bucket": self.bucket, "drafted_call": self.drafted_call, "seconds": self.seconds,
                "rows": [{"request_id": r.request_id, "stale_confidence": r.stale_confidence.tolist(),
                          "n_accepted": r.n_accepted, "width": r.width, "emitted": list(r.emitted)}
                         for r in self.rows]}


@dataclasses.dataclass
class CompletionStats:
    """One request's statistics, accumulated from the step records that include it."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0  # from the request's admission to its last token
    time_to_first_token_s: float = 0.0
    steps: int = 0  # verifications (each emits n_accepted + 1 tokens)
    emitted_by_steps: int = 0  # tokens those verifications emitted, bonus included, before stop truncation
    widths: list[int] = dataclasses.field(default_factory=list)  # widths[k]: steps that verified k drafts
    accepted: list[int] = dataclasses.field(default_factory=list)  # accepted[n]: steps that accepted n drafts
    draft_cost_s: float | None = None  # D the width selector used (None: fixed width)
    verify_costs_s: tuple[float, ...] | None = None  # V(0..gamma) the width selector used
    fallback_trips: int = 0  # times the acceptance breaker switched this request to target-only
    pauses: int = 0  # times the width selector paused drafting (it did not pay: SpecOptions.pause_steps)

    @classmethod
    def empty(cls, prompt_tokens: int, gamma: int) -> "CompletionStats":
        return cls(prompt_tokens=prompt_tokens, widths=[0] * (gamma + 1), accepted=[0] * (gamma + 1))

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification, bonus included (the paper's accepted length)."""
        return self.emitted_by_steps / self.steps if self.steps else 0.0

    @property
    def verified_at(self) -> list[int]:
        """[gamma]: steps that verified draft position i (a width above i)."""
        return _counts_above(self.widths)

    @property
    def accepted_at(self) -> list[int]:
        """[gamma]: steps whose accepted prefix reached position i."""
        return _counts_above(self.accepted)

    @property
    def acceptance(self) -> list[float]:
        """Per draft position i: of the verifications whose width included position i, the fraction
        whose accepted prefix reached it (not conditional on positions before i being accepted)."""
        return [a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at)]

    def record(self, step: StepRecord, row: RowRecord) -> None:
        self.steps += 1
        self.emitted_by_steps += row.n_accepted + 1
        self.widths[row.width] += 1  # histograms: a row a step pays two increments (the step's host path)
        self.accepted[row.n_accepted] += 1
        self.draft_cost_s, self.verify_costs_s = step.draft_cost_s, step.verify_costs_s

    def as_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                    elapsed_s=self.elapsed_s, time_to_first_token_s=self.time_to_first_token_s,
                    tokens_per_s=self.tokens_per_s, steps=self.steps, tau=self.tau, widths=list(self.widths),
                    acceptance=self.acceptance, draft_cost_s=self.draft_cost_s,
                    verify_costs_s=None if self.verify_costs_s is None else list(self.verify_costs_s),
                    fallback_trips=self.fallback_trips, pauses=self.pauses)


def _counts_above(histogram: list[int]) -> list[int]:
    """[len - 1]: out[i] = sum(histogram[i + 1:])."""
    return list(itertools.accumulate(histogram[:0:-1]))[::-1]


class LogCounters:
    """The step records between two engine log lines."""

    def __init__(self):
        self.steps = self.tokens = self.drafted = self.accepted = 0
        self.seconds = 0.0
        self.widths: dict[int, int] = {}
        self.last: StepRecord | None = None

    def add(self, step: StepRecord) -> None:
        self.steps += 1
        self.tokens += sum(len(r.emitted) for r in step.rows)
        self.seconds += step.seconds
        self.drafted += step.drafted
        self.accepted += sum(r.n_accepted for r in step.rows)
        self.widths[step.width] = self.widths.get(step.width, 0) + 1
        self.last = step

    def summary(self) -> str:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        widths = " ".join(f"{k}:{n}" for k, n in sorted(self.widths.items()))
        costs = ""
        if self.last is not None and self.last.verify_costs_s is not None:
            d = self.last.draft_cost_s
            costs = (f" D={d * 1e3:.2f}ms" if d else " D=?") + " V=[" + \
                ", ".join(f"{x * 1e3:.2f}" for x in self.last.verify_costs_s) + "]ms"
        return (f"{self.steps} steps: {self.tokens / max(self.seconds, 1e-9):.1f} tok/s, acceptance {rate:.2f}, "
                f"widths {{{widths}}}{costs}")


class StepReaders:
    """Where each step's record goes besides its requests: recorders (`Engine.record_steps`) and, every
    `log_every` steps, the engine's log line."""

    def __init__(self):
        self.recorders: list[list[StepRecord]] = []
        self.counters = LogCounters()

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[StepRecord]]:
        records: list[StepRecord] = []
        self.recorders.append(records)
        try:
            yield records
        finally:
            self.recorders.remove(records)

    def publish(self, record: StepRecord, log_every: int) -> None:
        for records in self.recorders:
            records.append(record)
        self.counters.add(record)
        if log_every and self.counters.steps >= log_every:
            log.info("%s", self.counters.summary())
            self.counters = LogCounters()
