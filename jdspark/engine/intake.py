"""How prompts come into the engine: admitting requests into free slots (`admit`, or `add_many`, which
prefills at once), prefill calls of their own, prompts riding in the verify calls, and a verify call's
prompt segment; and each request's first Delta once its prompt's last chunk is read. A part of
`Engine` (its base class): it reads and sets the engine's slots and pending prompts.

Beside running requests a pending prompt comes in one of three ways, chosen per step by
`Engine.step`: in the step's verify call as a prompt segment of its own (`segment_prompts`, with the
segment executables compiled: `Engine(prompt_segment=N)`, N tokens a call; the oldest pending prompt;
the model runs the verify rows and the chunk in one pass, `DSV4.extend_segments`, so the weights and
routed experts are read once for both), riding in the verify rows (`ride_prompts`: short prompts,
width + 1 tokens a call), or in a prefill call before the verify call (`batch.prompts_this_step`,
which may hold it back to share the call). With nothing running, prefill calls take them all.
"""

from __future__ import annotations

import numbers
import time

import numpy as np

from jdspark.engine import calls
from jdspark.engine.batch import IssuedPrefill, PendingPrompt, advance_prompts, call_inputs, call_slots, prefill_inputs
from jdspark.engine.errors import CapacityError, EngineError
from jdspark.engine.request import Delta, SamplingParams, check_prompt, room
from jdspark.engine.sequence import Sequence


def prefill_chunk_of(prefill_chunk: int, prefill_budget: int | None, max_seq_len: int) -> int:
    """The prompt tokens a prefill row takes per call (at most the context), once both options are
    checked: a chunk or a budget under one token would never finish a prompt."""
    def count(x) -> bool:  # a whole number of tokens, at least 1 (not a bool)
        return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
    if not count(prefill_chunk):
        raise EngineError(f"prefill_chunk={prefill_chunk!r}: a prefill row takes at least 1 prompt token a call "
                          "(default 256)")
    if prefill_budget is not None and not count(prefill_budget):
        raise EngineError(f"prefill_budget={prefill_budget!r}: use at least 1 prompt token a step (a whole chunk "
                          "is taken at least), or None for the default")
    return min(int(prefill_chunk), max_seq_len)


class PromptIntake:
    """`Engine`'s requests coming in: `admit` / `add` / `add_many`, the prefill calls and the prompts a
    verify call carries (riders, a segment); set up by `Engine.__init__`."""

    def add(self, prompt_ids, params: SamplingParams) -> Delta:
        """Admit one request into a free slot and prefill it; returns its first Delta (its
        `request_id` names the request from then on)."""
        return self.add_many([(prompt_ids, params)])[0]

    def add_many(self, requests: list[tuple[object, SamplingParams]]) -> list[Delta]:
        """Admit several requests and prefill them now, together (running requests wait); returns
        each one's first Delta. Every request is checked before any is admitted."""
        ids = self.admit(requests)
        deltas: dict[int, Delta] = {}
        while any(self._slot_of.get(rid) in self._pending for rid in ids):
            mine = [b for b in self._pending if self._slots[b].request_id in ids]
            deltas.update(self._read_prefill(self._issue_prefill(mine[:max(self.config.buckets)])))
        return [deltas[rid] for rid in ids]

    def admit(self, requests: list[tuple[object, SamplingParams]]) -> list[int]:
        """Admit requests into free slots without prefilling them: the coming `step`s prefill
        their prompts (`prefill_budget` tokens per step, running requests decoding meanwhile) and
        return each one's first Delta with the step that reads its last chunk's call (overlapped:
        the step after the one that issued it). Their request ids."""
        prompts = [self.check_prompt(ids, params) for ids, params in requests]
        for _, params in requests:
            if params.stop and self.tokenizer is None:
                raise EngineError(f"stop={list(params.stop)} needs a tokenizer; use stop_token_ids instead")
        free = [i for i, s in enumerate(self._slots) if s is None]
        if len(free) < len(requests):
            raise CapacityError(f"{len(requests)} request(s) but only {len(free)} of {self.config.max_batch} "
                                "slots are free")
        now = time.perf_counter()  # one time for them all: they are pending together (`batch.Arrivals`)
        self.arrivals.admitted(now)
        return [self._admit(b, ids, params, now) for b, ids, (_, params) in zip(free, prompts, requests)]

    def _admit(self, b: int, prompt: np.ndarray, params: SamplingParams, now: float) -> int:
        seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(2 ** 32))
        rid, self._next_id = self._next_id, self._next_id + 1
        self._slots[b] = Sequence(rid, len(prompt), params, seed=seed, gamma=self.config.gamma,
                                  eos_token_id=self.model.config.eos_token_id, tokenizer=self.tokenizer,
                                  breaker=self.options.breaker(), confidence=self._first_confidence())
        self._slot_of[rid] = b
        self._pending[b] = PendingPrompt(prompt, since=now)
        return rid

    def _first_confidence(self) -> np.ndarray | None:
        """Where a new request's (and a probe's) stale confidences start; None: ones."""
        return None if self.options.first_confidence == "ones" else self.prior.value

    def _issue_prefill(self, live: list[int]) -> IssuedPrefill:
        """One prefill call: the next chunk of each of these slots' prompts, in the smallest bucket
        that holds them. A prompt whose last chunk it holds is no longer pending: its request runs
        from this step's verify call on (its first token, the call's sample, is the state's anchor)."""
        bucket = self.config.prefill_bucket(len(live))
        rows = call_slots(live, bucket, self.config.max_batch)
        ids, n_valid, reset = prefill_inputs(rows, {b: self._pending[b] for b in live}, self.exe.prefill_chunk)
        out, self.state, self.draft_cache = calls.fetch_early(self.exe.buckets[bucket].prefill(
            self.exe.params.arrays, self.state, self.draft_cache, ids, n_valid,
            call_inputs(rows, self._slots, set(), gamma=self.config.gamma, reset=reset)))
        self.live.issued(bucket, "prefill")
        prompts = advance_prompts(rows, live, n_valid, self._pending, self._slots)
        for seq, _, last in prompts.values():
            if last:
                seq.issued(None)  # its first token, unread until this call is
        return IssuedPrefill(out, rows, prompts)

    def _read_prefill(self, call: IssuedPrefill) -> dict[int, Delta]:
        """The first Delta of each request whose prompt ended in the call (an error for non-finite logits)."""
        out = calls.read_output(call.out, self.config.gamma)
        deltas = self._first_deltas(call.rows, call.prompts, out.token, out.invalid)
        self._last_read = time.perf_counter()  # the verify read next is timed from here, not over this prefill
        return deltas

    def _first_deltas(self, rows: np.ndarray, prompts: dict, token: np.ndarray, invalid: np.ndarray) -> dict:
        """Of a call's rows that carried prompt chunks ({slot: (request, prompt, its last chunk)}): the
        first Delta of each request whose prompt ended there and still holds its slot."""
        deltas = {}
        for i, b in enumerate(rows.tolist()):
            seq, pending, last = prompts.get(b, (None, None, False))
            if seq is None or self._slots[b] is not seq:
                continue
            pending.invalid |= bool(invalid[i])
            if last:
                seq.first_read()
                seq.stats.time_to_first_token_s = time.perf_counter() - seq.started
                deltas[seq.request_id] = self._emit(b, [int(token[i])], pending.invalid)
        return deltas

    def check_prompt(self, prompt_ids, params: SamplingParams) -> np.ndarray:
        """The prompt as int32 ids, or a typed EngineError (`request.check_prompt`); reads the config only."""
        return check_prompt(prompt_ids, params, self.model.config.vocab_size, self.config)

    def room(self, prompt_len: int) -> int:
        """The most tokens a request with a prompt of `prompt_len` tokens may generate here."""
        return room(self.config, prompt_len)

    def _riders(self, running: int) -> list[int]:
        """The pending prompts that ride in this step's verify call (`ride_prompts`): beside running
        requests, while the last verify call verified drafts (width > 0: a decode call would carry one token
        of each; on the 2-core CPU target-only riding cost 8% of tok/s), those with at most `ride_prompts`
        tokens left. The width is the last call's: this step's, chosen for the bucket the riders fill, may
        be 0 (they then carry a token each). A prompt begun riding goes on in prefill calls when it stops."""
        if not self.ride_prompts or not running or not self._last_width:
            return []
        return [b for b, prompt in self._pending.items() if len(prompt.ids) - prompt.done <= self.ride_prompts]

    def _segment(self, running: int) -> int | None:
        """The pending prompt that this step's verify call carries in its prompt segment: beside running
        requests, with the segment executables compiled and `segment_prompts` on, the oldest one."""
        if not (self.exe.segment and self.segment_prompts and running and self._pending):
            return None
        return next(iter(self._pending))

    def _with_segment(self, inputs: np.ndarray, b: int) -> tuple[np.ndarray, dict, int]:
        """A verify call's slot inputs with slot b's prompt segment as their last row (its next
        `exe.segment` tokens; the slot emptied first at the prompt's first chunk), that prompt advanced
        past them. -> (inputs, {b: (request, prompt, its last chunk)}, the chunk's tokens)."""
        prompt = self._pending[b]
        chunk, slot = prompt.chunk(self.exe.segment), np.array([b], np.int32)
        row = call_inputs(slot, self._slots, set(), gamma=self.config.gamma, prompts={b: chunk},
                          reset=np.array([prompt.done == 0]), prompt_columns=self.exe.segment)
        inputs = np.pad(inputs, ((0, 0), (0, row.shape[1] - inputs.shape[1])))
        prompts = advance_prompts(slot, [b], np.array([len(chunk)]), self._pending, self._slots)
        return np.concatenate([inputs, row]), prompts, len(chunk)
