"""One request's lifecycle, owned by the engine: tokens -> text -> stop conditions -> finish reason.

Everything that decides where a request ends is here, in one place: the model's EOS, stop token
ids, `max_tokens`, and stop strings found in the detokenized text (which also cut the token list
at the token that completes them, so usage counts what the text shows). The Generator and the
server only read the `Delta`s the engine hands back; neither writes engine state.
"""

from __future__ import annotations

import time

import numpy as np

from jdspark.engine.request import Completion, Delta, SamplingParams
from jdspark.engine.stats import CompletionStats, RowRecord, StepRecord
from jdspark.speculative.sampling import MIN_TEMPERATURE
from jdspark.speculative.selector import FallbackBreaker
from jdspark.tokenizer.tokenizer import Detokenizer, Tokenizer

MAX_BACKOFF = 5  # a pause is at most 2**5 times `SpecOptions.pause_steps` long
# A paused request drafted this many times beside others (lifted to their step's width) is judged again on those
# proposals (`Sequence.resume`): at c = 64 on an H100 four paused requests a level, lifted while others drafted,
# decoded alone in the level's tail for 18-19 steps once the others had ended
RESUME_PROPOSALS = 4
# The weight of a request's newest proposal in `Sequence.typical`, what pauses and the decode call's
# price judge. A pause lasts 32+ steps, and one step's stale proposal predicts the next step's
# acceptance weakly: judged on it, a lone request on an H100 paused a third of its steps (0.92 of
# fixed width 5); replayed on the embedded model's recorded steps at those costs, an average at 0.25
# kept 0.99-1.00 of fixed width 5 (one step: 0.91-0.98), pausing as quickly where drafting never
# pays (docs/BENCHMARKS.md, serving).
TYPICAL_WEIGHT = 0.25

NON_FINITE = ("the model produced non-finite logits or draft probabilities for this request (NaN or inf); "
              "it was stopped instead of emitting a token drawn from them")


def moved_averages(typical: list[np.ndarray | None], confidence: np.ndarray) -> np.ndarray:
    """[R, gamma]: each row's `Sequence.typical` after its new proposal `confidence` [R, gamma], moved
    TYPICAL_WEIGHT of the way to it (the proposal itself where a row has none). A step's rows in one
    array operation: row by row it was ~1.2 us each, 75 us a step at 64 rows (timeit, the 2-core CPU)."""
    before = np.array([c if t is None else t for t, c in zip(typical, confidence)]).reshape(confidence.shape)
    return before + np.float32(TYPICAL_WEIGHT) * (confidence - before)  # exactly `confidence` where none


class ConfidencePrior:
    """Where a new request's stale confidences start (`SpecOptions.first_confidence="recent"`): ones
    until the engine has seen a proposal, then a running average (`weight` per step) of every step's
    proposals, position by position. Non-anticipating: it reads other requests' past steps only. At
    ones, a new request looked like a sure draft: on the CPU, where drafting pays only on confidences
    near 1, its first step drafted for the whole batch (inter-token p99 4-8x the p50 at c = 4)."""

    def __init__(self, gamma: int, weight: float = 0.1):
        self.value, self.weight = np.ones(gamma, np.float32), weight

    def update(self, confidence: np.ndarray) -> None:
        """One step's proposals [rows, gamma]."""
        self.value = self.value + self.weight * (confidence.mean(axis=0) - self.value)


class Sequence:
    """A running request in one engine slot."""

    def __init__(self, request_id: int, prompt_len: int, params: SamplingParams, *, seed: int, gamma: int,
                 eos_token_id: int | None, tokenizer: Tokenizer | None, breaker: FallbackBreaker | None,
                 confidence: np.ndarray | None = None):
        self.request_id, self.params, self.seed, self.breaker = request_id, params, seed, breaker
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos or eos_token_id is None
                                                      else {eos_token_id})
        self.detok = Detokenizer(tokenizer, params.stop) if tokenizer is not None else None
        self.tokens: list[int] = []  # generated so far
        # the previous proposal's (stale on purpose); a new request starts at `confidence` (ones if None)
        self.confidence = np.ones(gamma, np.float32) if confidence is None else np.array(confidence, np.float32)
        # its proposals averaged (`TYPICAL_WEIGHT` on the newest) from its start, where the engine's recent
        # average (`confidence`) seeds it, or from its first proposal after a pause (None until then, or
        # from the first proposal where nothing seeds it). Judged on its first proposals alone, 20 of the
        # 32 pauses of one request at a time on an H100 (the embedded model, 64 tokens: ~21 steps a
        # request; 0.93-0.96 of fixed width 5) came within a request's first 4 verify steps, each 30+ steps;
        # replayed at its costs (`eval_calibration.py`, T = 1), seeding took it from 0.871 to 0.990 of width 5.
        # It may share `confidence`'s array: both are replaced on update, never changed in place.
        self.typical: np.ndarray | None = None if confidence is None else self.confidence
        self.calls = 0  # verify calls issued for it: the counter of the request's own noise
        self.unread = 0  # tokens its issued calls not yet read may emit (each at most its width + 1)
        self.unread_calls = 0  # its issued calls not yet read (each emits at least one token)
        self.stats = CompletionStats.empty(prompt_len, gamma)
        self.started = time.perf_counter()
        self.finish_reason: str | None = None
        self.paused_left, self.probing, self._probe_next = 0, False, False
        self.pausing = False  # not drafting this step because of a pause (not the breaker)
        self.pauses_in_a_row = 0  # doubles the next pause (probes back off), reset when drafting pays
        self.proposals_in_pause = 0  # proposals read since the pause began (it drafted in others' steps)

    def speculates(self) -> bool:
        """Called once per verify call issued for it, before widths are chosen: False while paused
        (`pause`) or while the breaker cools down. The first step after a pause drafts whatever the
        cost (`probing`)."""
        self.probing, self._probe_next = self._probe_next, False
        self.pausing = self.paused_left > 0
        if self.pausing:
            self.paused_left -= 1
            self._probe_next = self.paused_left == 0
            return False
        return self.breaker is None or self.breaker.should_speculate()

    def pause(self, steps: int) -> None:
        """Decode without drafting for `steps` steps, doubled for each pause since drafting last paid
        (at most 32x): a request whose drafts never pay probes ever more rarely."""
        self.paused_left, self.pausing, self.typical = steps << self.pauses_in_a_row, True, None
        self.proposals_in_pause = 0
        self.pauses_in_a_row = min(self.pauses_in_a_row + 1, MAX_BACKOFF)
        self.stats.pauses += 1

    def defer_probe(self) -> None:
        """The step decoded although this request probes (even judged as a new request, it would not
        have made the batch's draft pay): it probes again next step."""
        self._probe_next = True

    def drafting_pays(self) -> None:
        """Its confidences make drafting pay again: the next pause is `steps` long."""
        self.pauses_in_a_row = 0

    def resume(self) -> bool:
        """End the pause early: the proposals it made in other requests' drafting steps since the pause
        (`RESUME_PROPOSALS` or more) make drafting pay again. Returns whether it drafts this step: what
        `speculates` would have said unpaused (not while its breaker cools down)."""
        self.paused_left, self.pausing, self._probe_next = 0, False, False
        self.drafting_pays()
        return self.breaker is None or self.breaker.should_speculate()

    @property
    def greedy(self) -> bool:
        """Whether it decodes greedily (its drafts are accepted by argmax match, not by p / q)."""
        return not self.params.temperature >= MIN_TEMPERATURE

    def may_issue(self) -> bool:
        """Whether another call may run for it: even if the calls not yet read emit all they can, it
        stays short of max_tokens (so its state never outgrows what `room` reserved)."""
        return len(self.tokens) + self.unread < self.params.max_tokens

    def issued(self, width: int | None) -> None:
        """A call now runs for it: a verify call of this width, or (None) the prefill of its prompt's
        last chunk, which samples its first token (read by `first_read`)."""
        self.calls += width is not None
        self.unread += 1 if width is None else width + 1
        self.unread_calls += 1

    def first_read(self) -> None:
        self.unread -= 1
        self.unread_calls -= 1

    def draft_room(self) -> int:
        """The most drafts its next call could emit before max_tokens: the tokens left, less one for each
        call not yet read (each emits at least one) and one for the call's own token."""
        return self.params.max_tokens - len(self.tokens) - self.unread_calls - 1

    def record(self, step: StepRecord, row: RowRecord, confidence: np.ndarray | None,
               typical: np.ndarray | None = None) -> None:
        """What the engine learned of this request in a step read (after its tokens were emitted):
        its new proposal `confidence` and, if the caller has it (`moved_averages` over the step's
        rows at once), its `typical` after that proposal."""
        self.unread -= row.width + 1
        self.unread_calls -= 1
        self.stats.record(step, row)
        if row.width and self.breaker is not None:
            self.breaker.record(row.n_accepted, row.width)
            self.stats.fallback_trips = self.breaker.trips
        if confidence is not None:
            self.confidence = confidence
            self.proposals_in_pause += self.paused_left > 0
            self.typical = moved_averages([self.typical], confidence[None])[0] if typical is None else typical

    def emit(self, new: list[int]) -> Delta:
        """Append a call's tokens up to the first stop condition; the Delta the request receives."""
        out, finish = new, None
        if not self.stop_ids.isdisjoint(new) or len(self.tokens) + len(new) >= self.params.max_tokens:
            out = []  # it ends inside this call's tokens: up to the first stop condition
            for t in new:
                out.append(t)
                if t in self.stop_ids:
                    finish = "stop"
                    break
                if len(self.tokens) + len(out) >= self.params.max_tokens:
                    finish = "length"
                    break
        text = ""
        if self.detok is not None:
            text = self.detok.add(out)
            if self.detok.stopped:
                finish = "stop"
                out = out[:len(self.detok.tokens) - len(self.tokens)]
            if finish is not None:
                text += self.detok.finish()
        self.tokens.extend(out)
        self.stats.generated_tokens = len(self.tokens)
        self.stats.elapsed_s = time.perf_counter() - self.started
        if finish is None:
            return Delta(self.request_id, tuple(out), text)
        return self.finish(finish, tuple(out), text)

    def finish(self, reason: str, tokens: tuple[int, ...] = (), text: str = "", error: str | None = None) -> Delta:
        self.finish_reason = reason
        completion = Completion(token_ids=list(self.tokens), text=self.detok.text if self.detok else None,
                                finish_reason=reason, stats=self.stats)
        return Delta(self.request_id, tokens, text, reason, error, completion)
