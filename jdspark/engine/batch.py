"""What one executable call runs on: its rows (state slots, padded to a batch bucket) and their
inputs, the prompt chunks of requests still being prefilled, and what reading an issued call needs.

A call of bucket n has n rows, each naming a distinct state slot (the executables gather and
scatter those slots, `executables`). The live rows come first in slot order; padding rows take
other slots and run inactive (n_valid 0), which leaves their state as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable

import jax
import numpy as np

from jdspark.engine.calls import slot_inputs
from jdspark.engine.sequence import Sequence


@dataclasses.dataclass
class PendingPrompt:
    """A request admitted into its slot whose prompt is not yet all in the state."""

    ids: np.ndarray
    done: int = 0  # prompt tokens prefilled so far
    invalid: bool = False  # a chunk came back with non-finite logits
    since: float = dataclasses.field(default_factory=time.perf_counter)  # admitted (perf_counter)

    def chunk(self, size: int) -> np.ndarray:
        return self.ids[self.done:self.done + size]


def prompts_to_prefill(pending: int, budget_rows: int, buckets, running: bool) -> int:
    """Prompts a step prefills: `budget_rows` (the prefill budget; the engine's default is every slot,
    so every pending prompt) beside running requests; with none running no one waits on the call, so
    as many as fill the largest batch bucket they can fill (no padded row: a wave of 16 prompts is one
    call, not 16). Either way, pending prompts also fill the padding of the bucket the call runs in:
    its padded rows cost the call's dense work whatever they hold (one prompt at a time in a smallest
    bucket of 16 had left finished requests' slots empty for up to 15 steps; with a bucket of 1, a
    budget of one prompt a step left a 64-slot H100 engine at 27 of 64 rows a step, docs/BENCHMARKS.md)."""
    fill = next((b for b in buckets if b >= budget_rows), budget_rows)  # the bucket the budget's call runs in
    if not running:
        fill = max([fill, *(b for b in buckets if b <= pending)])
    return min(pending, fill)


MAX_WAIT_CALLS = 8  # the longest a prompt waits for others to share its prefill call, in the savings it waits for


class Arrivals:
    """When prompts were last admitted, GAPS + 1 times: the mean gap between two, which says whether a
    prefill call held back (`prefill_waits`) can expect the next prompt soon enough. The mean, not the
    median: it is the arrival rate, and requests started together end close together, so gaps come in
    short and long (a median of the short ones had promised a partner every 11 ms to prompts whose
    partners came ~77 ms apart on average, Flash dimensions on an H200, 4 requests). An idle spell
    raises the mean, which only holds fewer calls back (each prefill as it comes). Prompts admitted
    together (one `Engine.admit`, or within SAME_S) count once: they are pending together, and a run of
    zero gaps would say that the next prompt comes at once (requests of one wave ending on one step).
    The gap does not age: a prompt coming after a burst is judged on the burst's gaps, its own
    included (a hold still ends at its summed waits or MAX_WAIT_CALLS)."""

    GAPS = 8
    SAME_S = 0.001

    def __init__(self):
        self._times: collections.deque[float] = collections.deque(maxlen=self.GAPS + 1)

    def admitted(self, when: float) -> None:
        if not self._times or when - self._times[-1] >= self.SAME_S:
            self._times.append(when)

    def gap(self) -> float | None:
        """Seconds between two admissions, the mean of the last GAPS; None until there are as many."""
        if len(self._times) < self.GAPS + 1:
            return None
        return (self._times[-1] - self._times[0]) / self.GAPS


def prefill_waits(pending: Iterable[PendingPrompt], running_rows: int, saves: list[float] | None, now: float,
                  arrival_gap: float | None = None) -> bool:
    """Whether a step holds its prefill call back, so that prompts coming later share it. The call
    stalls the `running_rows`; `saves[j - 1]` is the stall each of them is spared if j more prompts
    share it (`sharing_saves`), and each pending prompt meanwhile waits. The hold aims at the j whose
    saving pays best: with `arrival_gap` (the mean seconds between two admissions, `Arrivals`), waiting
    for j more costs the n pending prompts about n j + j (j - 1) / 2 gaps, so the j with the most
    running_rows x saves[j - 1] beyond that, and no hold where none gains (Flash dimensions, an H100, 4
    requests: a lone prompt waited ~3 verify calls, while requests ended ~6 apart, and a slot stood
    empty on 17% of the steps; on an H200 the same with the gap weighed, the second prompt spilling
    into bucket 4: 20.4 ms against bucket 1's 11.2, docs/BENCHMARKS.md); with no gap known, the next
    prompt's saving alone. The call then waits until the prompts' summed waits reach running_rows x that
    saving: the TCP acknowledgment-delay rule (Dooly, Goldman and Scott), which for a fixed call cost
    keeps the summed waits and stalls within twice the best schedule's (here the saving moves with the
    bucket and the running rows, so that is its reason, not a bound). As TCP caps its delayed
    acknowledgment, no prompt waits longer than MAX_WAIT_CALLS such savings (a lone prompt beside 63
    running rows would otherwise wait 63). Never for a prompt whose prefill has begun, with nothing
    running, or where the aimed-at saving is none (no profile, or a next prompt that spills into a
    bucket as dear as its own call)."""
    prompts = list(pending)
    if not prompts or not running_rows or not saves or any(p.done for p in prompts):
        return False
    n, save = len(prompts), saves[0]
    if arrival_gap is not None:
        gains = [running_rows * s - arrival_gap * (n * j + j * (j - 1) / 2) for j, s in enumerate(saves, 1)]
        save = saves[max(range(len(gains)), key=gains.__getitem__)] if max(gains) > 0 else 0.0
    if save <= 0:
        return False
    waits = [now - p.since for p in prompts]
    return sum(waits) < running_rows * save and max(waits) < MAX_WAIT_CALLS * save


def sharing_saves(prefill_s: dict[int, float], buckets, rows: int, most: int) -> list[float]:
    """Seconds of stall each running row is spared if the prefill call of `rows` prompts waits for j =
    1, 2, ... more to share it (up to `most` prompts in the call), against issuing it now and each later
    prompt in a call of its own: call(rows) + j x call(1) - call(rows + j), every call priced at its
    bucket's profiled cost (`prefill_s`); the list ends where a bucket is not profiled. A prompt that
    spills into a larger bucket may save little: prefill buckets 1 and 4 at 11.2 and 20.4 ms (Flash
    dimensions, an H200) spare 2.0 ms for a second prompt, 13.2 for a third and 24.4 for a fourth."""
    def call(n):
        return prefill_s.get(next((b for b in buckets if b >= n), None))

    first, alone, saves = call(rows), call(1), []
    for j in range(1, most - rows + 1):
        joint = call(rows + j)
        if first is None or alone is None or joint is None:
            break
        saves.append(first + j * alone - joint)
    return saves


def prompts_this_step(pending: dict[int, PendingPrompt], running_rows: int, budget_rows: int, buckets,
                      prefill_s: dict[int, float], arrival_gap: float | None = None) -> int:
    """Prompts a step prefills: `prompts_to_prefill`'s, or none while `prefill_waits` holds the call
    back. `prefill_s`: each bucket's prefill call's seconds (empty: never held back), `arrival_gap`:
    `Arrivals.gap`. Later prompts may join the call up to the bucket the budget's call runs in."""
    rows = prompts_to_prefill(len(pending), budget_rows, buckets, running_rows > 0)
    if not rows or not running_rows or not prefill_s:
        return rows  # nothing to hold (the savings' list is host time in every step)
    most = next((b for b in buckets if b >= budget_rows), budget_rows)
    saves = sharing_saves(prefill_s, buckets, rows, most)
    return 0 if prefill_waits(pending.values(), running_rows, saves, time.perf_counter(), arrival_gap) else rows


def call_slots(live: list[int], bucket: int, max_batch: int) -> np.ndarray:
    """The bucket's row slots, ascending: the live ones plus the lowest other slots as padding (so
    the full bucket is every slot in order, which the executables run without a gather)."""
    if len(live) > bucket:
        raise ValueError(f"{len(live)} live slots do not fit a bucket of {bucket}")
    taken = set(live)
    padding = [b for b in range(max_batch) if b not in taken][:bucket - len(live)]
    return np.array(sorted([*live, *padding]), np.int32)


def call_inputs(slots: np.ndarray, sequences: list[Sequence | None], active: set[int],
                widths: dict[int, int] | None = None, *, gamma: int, prompts: dict[int, np.ndarray] | None = None,
                reset: np.ndarray | None = None, prompt_columns: int = 0) -> np.ndarray:
    """slot_inputs for rows `slots`: sampling and widths of the active ones; padding rows are greedy
    and inactive. The counter is the request's own count of calls, so its noise does not depend on
    the other rows (and never repeats, however many calls are in flight). `prompts`: {slot: its
    prompt's next tokens, <= gamma + 1} of rows that carry a prompt chunk in a verify call
    (`prompt_len`; a prompt segment's row: up to `prompt_columns`); `reset` [n]: the rows whose slot the
    call empties first (a prompt's first chunk)."""
    n = len(slots)
    columns = {"active": np.zeros(n, bool), "temperature": np.zeros(n, np.float32),
               "top_k": np.zeros(n, np.int32), "top_p": np.ones(n, np.float32), "seed": np.zeros(n, np.uint32),
               "counter": np.zeros(n, np.int32), "slot": slots, "width": np.zeros(n, np.int32),
               "prompt_len": np.zeros(n, np.int32), "reset": np.zeros(n, bool) if reset is None else reset}
    prompt = np.zeros((n, max(gamma + 1, prompt_columns)), np.int32)
    for i, b in enumerate(slots.tolist()):
        seq = sequences[b]
        if seq is None:
            continue
        p = seq.params
        columns["temperature"][i], columns["top_k"][i], columns["top_p"][i] = p.temperature, p.top_k, p.top_p
        columns["seed"][i], columns["counter"][i] = seq.seed, seq.calls
        if b in active:
            columns["active"][i] = True
            columns["width"][i] = (widths or {}).get(b, 0)
        elif b in (prompts or {}):
            prompt[i, :len(prompts[b])], columns["prompt_len"][i] = prompts[b], len(prompts[b])
    return slot_inputs(prompt, **columns)


def advance_prompts(rows: np.ndarray, live: list[int], n_valid: np.ndarray, pending: dict[int, PendingPrompt],
                    sequences: list[Sequence | None]) -> dict[int, tuple[Sequence, PendingPrompt, bool]]:
    """After a prefill call is issued: each live row's prompt advanced by its chunk, and no longer
    pending where that was its last. {slot: (request, prompt, whether its last chunk)}."""
    prompts = {}
    for i, b in enumerate(rows.tolist()):
        if b in live:
            prompt = pending[b]
            prompt.done += int(n_valid[i])
            last = prompt.done == len(prompt.ids)
            if last:
                del pending[b]
            prompts[b] = (sequences[b], prompt, last)
    return prompts


def prefill_inputs(slots: np.ndarray, advancing: dict[int, PendingPrompt], chunk: int):
    """(ids [n, chunk], n_valid [n], reset [n]) of one prefill call: the next chunk of each prompt
    it advances (reset on its first); every other row empty, even one whose prompt is pending (a
    chunk written without advancing its prompt would be written again by the next call)."""
    ids = np.zeros((len(slots), chunk), np.int32)
    n_valid, reset = np.zeros(len(slots), np.int32), np.zeros(len(slots), bool)
    for i, b in enumerate(slots.tolist()):
        if b in advancing:
            piece = advancing[b].chunk(chunk)
            ids[i, :len(piece)] = piece
            n_valid[i], reset[i] = len(piece), advancing[b].done == 0
    return ids, n_valid, reset


@dataclasses.dataclass
class IssuedPrefill:
    """A prefill call issued and not yet read."""

    out: jax.Array
    rows: np.ndarray
    prompts: dict[int, tuple[Sequence, PendingPrompt, bool]]  # slot -> (request, prompt, its last chunk)


@dataclasses.dataclass
class IssuedVerify:
    """A verify (or plain decode) call issued and not yet read: what reading it needs."""

    out: jax.Array
    rows: np.ndarray
    sequences: dict[int, Sequence]  # slot -> the request it ran for
    stale: dict[int, np.ndarray]  # slot -> the confidences its width was chosen from
    width: int  # the executable's
    widths: dict[int, int]  # slot -> its own width
    bucket: int
    drafted: bool  # a step[k] call (else a plain decode)
    started: float  # perf_counter before its width choice
    costs: dict  # Engine.cost_summary when it was chosen: what the choice read
    prompts: dict = dataclasses.field(default_factory=dict)  # slot -> (request, prompt, its last chunk): riders,
    # or the prompt segment's
    prompt_tokens: int = 0  # the prompt tokens it prefills (riders' or the segment's)
    segment: int | None = None  # the prompt segment's slot (its output row follows the verify rows)
