"""What one executable call runs on: its rows (state slots, padded to a batch bucket) and their
inputs, and the prompt chunks of requests still being prefilled.

A call of bucket n has n rows, each naming a distinct state slot (the executables gather and
scatter those slots, `executables`). The live rows come first in slot order; padding rows take
other slots and run inactive (n_valid 0), which leaves their state as it was.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jdspark.engine.executables import slot_inputs
from jdspark.engine.sequence import Sequence


@dataclasses.dataclass
class PendingPrompt:
    """A request admitted into its slot whose prompt is not yet all in the state."""

    ids: np.ndarray
    done: int = 0  # prompt tokens prefilled so far
    invalid: bool = False  # a chunk came back with non-finite logits

    def chunk(self, size: int) -> np.ndarray:
        return self.ids[self.done:self.done + size]


def call_slots(live: list[int], bucket: int, max_batch: int) -> np.ndarray:
    """The bucket's row slots, ascending: the live ones plus the lowest other slots as padding (so
    the full bucket is every slot in order, which the executables run without a gather)."""
    if len(live) > bucket:
        raise ValueError(f"{len(live)} live slots do not fit a bucket of {bucket}")
    taken = set(live)
    padding = [b for b in range(max_batch) if b not in taken][:bucket - len(live)]
    return np.array(sorted([*live, *padding]), np.int32)


def call_inputs(slots: np.ndarray, sequences: list[Sequence | None], active: set[int],
                widths: dict[int, int] | None = None) -> np.ndarray:
    """slot_inputs for rows `slots`: sampling and widths of the active ones; padding rows are greedy
    and inactive. The counter is the request's own count of calls, so its noise does not depend on
    the other rows (and never repeats, however many calls are in flight)."""
    n = len(slots)
    columns = {"active": np.zeros(n, bool), "temperature": np.zeros(n, np.float32),
               "top_k": np.zeros(n, np.int32), "top_p": np.ones(n, np.float32), "seed": np.zeros(n, np.uint32),
               "counter": np.zeros(n, np.int32), "slot": slots, "width": np.zeros(n, np.int32)}
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
    return slot_inputs(**columns)


def prefill_inputs(slots: np.ndarray, pending: dict[int, PendingPrompt], chunk: int):
    """(ids [n, chunk], n_valid [n], reset [n]) of one prefill call: each pending row's next chunk
    (reset on its first), padding rows empty."""
    ids = np.zeros((len(slots), chunk), np.int32)
    n_valid, reset = np.zeros(len(slots), np.int32), np.zeros(len(slots), bool)
    for i, b in enumerate(slots.tolist()):
        if b in pending:
            piece = pending[b].chunk(chunk)
            ids[i, :len(piece)] = piece
            n_valid[i], reset[i] = len(piece), pending[b].done == 0
    return ids, n_valid, reset
