"""The engine: slots of requests over one decode state; a step = prefill one chunk of the prompts
still coming in (if any), then choose each running request's width and draft + verify them all in
one executable call of the smallest batch bucket that holds them.

The host owns the bookkeeping (which slot holds which request, its tokens, stop conditions,
statistics); the device owns the model state. Per call only (n_accepted, token) per row, the
drafted tokens and their confidences come back to the host, as one small array. Requests join a
free slot and leave it when they finish. `add_many` prefills its prompts at once (offline use);
`admit` spreads them over the coming steps, `prefill_budget` prompt tokens per step, so running
requests keep decoding while a new one is prefilled (serving), and new prompts may wait to share a
call (`batch.prefill_waits`), come in a verify call's prompt segment (`prompt_segment`) or, short
ones, ride in the verify rows (`ride_prompts`; `intake`). With overlap
(the default) a step reads the previous step's calls after issuing its own (docs/ARCHITECTURE.md,
"Overlapped steps")."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import jax
import numpy as np

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import calls, deferred
from jdspark.engine.batch import (Arrivals, IssuedPrefill, IssuedVerify, PendingPrompt, advance_prompts, call_inputs,
                                  call_slots, prompts_this_step)
from jdspark.engine.executables import Executables, check_segment
from jdspark.engine.intake import PromptIntake, prefill_chunk_of
from jdspark.engine.live_costs import LiveCosts
from jdspark.engine.options import RIDE_PROMPTS, SpecOptions, WidthPolicy
from jdspark.engine.policy import SpeculationPolicy
from jdspark.engine.request import Completion, Delta
from jdspark.engine.sequence import NON_FINITE, ConfidencePrior, Sequence, moved_averages
from jdspark.engine.stats import RowRecord, StepReaders, StepRecord
from jdspark.engine.widths import choose, compiled_widths, judged
from jdspark.model.model import Model
from jdspark.speculative.calibration import Calibration
from jdspark.tokenizer.tokenizer import Tokenizer
from pallas_kernels import resolve_implementation

log = logging.getLogger(__name__)


def checked_widths(model_config, config: EngineConfig, speculative: bool, widths: tuple[int, ...] | None,
                   options: SpecOptions, prompt_segment: int, implementation: str) -> tuple[int, ...]:
    """The widths to compile, after every check of the engine's options that needs no weights (the widths,
    the fallback options, the prompt segment, the kernels' implementation; `EngineConfig` checks its own):
    `Generator.from_pretrained` runs it before the checkpoint loads, the engine before anything compiles."""
    widths = compiled_widths(model_config, config, speculative, widths, options.width)
    options.breaker()
    check_segment(config, prompt_segment)
    resolve_implementation(implementation)
    return widths


class Engine(PromptIntake, SpeculationPolicy):
    """Slots of running requests over one decode state. Faces hand it prompts and read `Delta`s:
    `add` / `add_many` admit (and prefill), `step` advances every running request, `cancel` drops
    one. A request's end (EOS, stop ids, stop strings, max_tokens) is decided here, in its
    `Sequence`, and a finished request's slot is free when its last Delta is returned."""

    def __init__(self, model: Model, config: EngineConfig, *, tokenizer: Tokenizer | None = None,
                 speculative: bool = True, prefill_chunk: int = 256, options: SpecOptions = SpecOptions(),
                 width_policy: WidthPolicy | None = None, widths: tuple[int, ...] | None = None,
                 implementation: str = "auto", pack_params: bool | None = None, prefill_budget: int | None = None,
                 overlap: bool = True, batch_prefills: bool = True, defer_steps: bool = False,
                 ride_prompts: int = RIDE_PROMPTS, prompt_segment: int = 0):
        """`tokenizer` turns tokens into text deltas and enables stop strings; `widths`: the step
        widths to compile (default 0..gamma; only 0 without speculation; a row's width rounds up to
        the next compiled one's executable); `prefill_budget`: prompt tokens a `step` prefills beside
        running requests (whole chunks of `prefill_chunk`; default: a chunk of every pending prompt on
        a GPU, where a call's rows share its weight reads, one chunk on the CPU, where its cost grows
        with its rows, so spreading prompts over steps keeps steps even, docs/BENCHMARKS.md); `width_policy`
        overrides the width choice (a function of a request's stale confidences); `implementation` ("auto",
        "pallas", "xla") picks the Pallas kernels or their jnp references (rejection sampler,
        Sinkhorn; "auto": the kernels on the GPU); `pack_params` (small parameters passed in a few
        buffers, `jdspark.engine.packed`) defaults to on exactly on the GPU; `overlap`: a step issues
        its calls before it reads the previous step's (`step`); `batch_prefills`: new prompts may wait;
        `defer_steps`: serve target-only at once and speculate when the step executables, built or loaded
        in the background, are ready (`jdspark.engine.deferred`; `poll`, `wait_for_steps`); `ride_prompts`:
        beside running requests, a prompt with at most this many tokens left rides in the verify calls,
        the step's width + 1 tokens a call, instead of taking prefill calls of its own (0: never; `step`);
        `prompt_segment`: beside running requests the oldest pending prompt comes in the verify call, this
        many tokens a call (>= gamma + 1; 0: never), in the same model pass (`intake`; while on, none rides)."""
        widths = checked_widths(model.config, config, speculative, widths, options, prompt_segment, implementation)
        self.model, self.config, self.speculative, self.options = model, config, speculative, options
        self.overlap, self.batch_prefills, self.ride_prompts = overlap, batch_prefills, ride_prompts
        self.segment_prompts = bool(prompt_segment)  # whether steps use the segment executables (compiled if N > 0)
        self.tokenizer = tokenizer
        self._last_width = None  # the executable width of the last verify call (0: a decode; None: none yet)
        on_gpu = jax.default_backend() == "gpu"
        pack_params = on_gpu if pack_params is None else pack_params
        chunk = prefill_chunk_of(prefill_chunk, prefill_budget, config.max_seq_len)
        default_rows = config.max_batch if on_gpu else 1  # prompts prefilled beside running requests
        self.prefill_rows = default_rows if prefill_budget is None else max(1, int(prefill_budget) // chunk)
        self.exe = Executables(model, config, chunk, implementation, widths if speculative else (), pack_params,
                               prompt_segment)
        self.state, self.draft_cache = self._fresh_state()
        self._clear_requests()
        self.prior, self.calibration = ConfidencePrior(config.gamma), Calibration(config.gamma, fold_steps=4)
        self._next_id, self.arrivals = 0, Arrivals()  # arrivals: whether holding a prefill call back can pay
        # several processes must issue the same calls: none takes executables a step apart from the others
        start, defer = time.perf_counter(), defer_steps and speculative and jax.process_count() == 1
        which = "serving" if defer else "all"
        if defer:
            self._width_policy(width_policy, widths, True, measure=False)  # a bad choice fails now, not when taken
        self.exe.compile(self.state, self.draft_cache, which)
        self.state, self.draft_cache = self.exe.warm_up(self.state, self.draft_cache, which)
        self.selector, self.selectors, self.live = None, {}, LiveCosts({})  # the measured selectors: the
        # largest bucket's, every bucket's, and as the steps take them (`LiveCosts`), once measured
        self._measured: dict[str, tuple] = {}  # profile -> (selectors, selector, live) measured under it
        self._build, self._speculate_when_built = None, False  # `defer_steps`: the step executables' build
        if defer:
            self._build, self.speculative = deferred.StepBuild(self.exe, self._fresh_state()), False
            self._speculate_when_built, self._policy_when_built = True, (width_policy, widths)
        self.width_policy = self._width_policy(width_policy, widths, self.speculative)
        log.info("engine ready in %.1f s%s (compile cache %s)", time.perf_counter() - start,
                 ", target-only until the step executables are built" if self._build else "",
                 jax.config.jax_compilation_cache_dir or "off")
        self.last_step: StepRecord | None = None
        self._readers = StepReaders()

    def _fresh_state(self):
        """Empty decode state and draft cache (None without a drafter) for every slot."""
        draft_cache = None if self.model.config.dspark is None else self.model.on_devices(
            dspark.init_draft_cache(self.model.config, self.config.max_batch, self.model.dtype))
        return self.model.init_state(self.config), draft_cache

    def _clear_requests(self) -> None:
        """No request in any slot, no prompt pending, no call unread."""
        self._slots: list[Sequence | None] = [None] * self.config.max_batch
        self._slot_of: dict[int, int] = {}  # request id -> slot
        self._pending: dict[int, PendingPrompt] = {}  # slot -> prompt still being prefilled, oldest first
        self._unread: list[IssuedPrefill | IssuedVerify] = []  # calls issued and not yet read (the previous step's)
        self._last_read = 0.0  # when a call was last read (perf_counter): where an overlapped step's time starts

    def reset(self) -> list[Delta]:
        """Fail every request and start again from empty device state. An executable that raised
        may already have consumed the donated state, so a server calls this after a failed step to
        keep serving the next requests. Returns the failed requests' last Deltas."""
        failed = [seq.finish("error", error="the engine failed while running this request")
                  for seq in self._slots if seq is not None]
        self._clear_requests()
        self.state, self.draft_cache = self._fresh_state()
        return failed

    def cancel(self, request_id: int) -> None:
        """Drop a running request (its client went away): its slot is free; a finished one is ignored."""
        if (b := self._slot_of.pop(request_id, None)) is not None:
            self._slots[b] = None
            self._pending.pop(b, None)

    def complete(self, first: list[Delta]) -> list[Completion]:
        """Step until these first Deltas' requests finish; their Completions, in order (offline use, tests)."""
        done = {d.request_id: d.completion for d in first if d.final}
        while len(done) < len(first):
            done.update({rid: d.completion for rid, d in self.step().items() if d.final})
        return [done[d.request_id] for d in first]

    @property
    def running(self) -> list[int]:
        """The request ids holding a slot."""
        return list(self._slot_of)

    @property
    def free_slots(self) -> int:
        return self._slots.count(None)

    def slot_of(self, request_id: int) -> int:
        """The slot a running request occupies (for inspecting `state` / `draft_cache`)."""
        return self._slot_of[request_id]

    @contextlib.contextmanager
    def record_steps(self) -> Iterator[list[StepRecord]]:
        """Collect every step's record while the block runs (profiling)."""
        with self._readers.recording() as records:
            yield records

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> dict[int, Delta]:
        """One step: issue a prefill call for the prompts still coming in (`prefill_budget` tokens;
        `batch.prefill_waits` may hold it back for more) and one draft + verify call for every running request,
        those whose prompt that prefill ends included (it leaves their first token as the anchor), with the
        oldest other pending prompt's next chunk in its segment (`prompt_segment`) or the prompts that ride in
        it (`ride_prompts`: their next width + 1 tokens; either way no prefill call for them), then read
        calls: with `overlap` the previous step's (these run meanwhile; a request that ended in them has its
        extra call's tokens dropped), else these. Returns each request's Delta by request id (a request whose
        prompt ended gets its first, with what its first verify emitted); finished requests' slots are then
        free; `last_step`: the verify call's record (None when only a prefill was read)."""
        self.last_step = None
        self.poll()
        running = [b for b, seq in enumerate(self._slots)
                   if seq is not None and b not in self._pending and seq.may_issue()]
        segment = self._segment(len(running))
        riders = [] if segment is not None else self._riders(len(running))
        waiting = {b: prompt for b, prompt in self._pending.items() if b not in riders and b != segment}
        rows = prompts_this_step(waiting, len(running), self.prefill_rows, self.config.prefill_buckets,
                                 self.live.prefill_s if self.batch_prefills else {}, self.arrivals.gap())
        issued = [self._issue_prefill(list(waiting)[:rows])] if rows else []
        running += [b for call in issued for b, (seq, _, last) in call.prompts.items() if last and seq.may_issue()]
        if running:
            issued.append(self._issue_verify(sorted(running), riders, segment))
        if self.overlap:
            issued, self._unread = self._unread, issued
        deltas: dict[int, Delta] = {}
        for call in issued:
            read = self._read_prefill(call) if isinstance(call, IssuedPrefill) else self._read_verify(call)
            deltas.update({rid: deltas[rid].then(d) if rid in deltas else d for rid, d in read.items()})
        return deltas

    def _issue_verify(self, active: list[int], riders: list[int] = (), segment: int | None = None) -> IssuedVerify:
        started = time.perf_counter()
        bucket = self.config.bucket(len(active) + len(riders))
        stale = {b: self._slots[b].confidence for b in active}  # the last read proposal's: what the choice reads
        width, widths, drafted, call = self._choose(stale, bucket, segment is not None)
        self._last_width = width
        rows = call_slots(sorted([*active, *riders]), bucket, self.config.max_batch)
        chunks = {b: self._pending[b].chunk(width + 1) for b in riders}
        reset = np.array([b in chunks and self._pending[b].done == 0 for b in rows.tolist()])
        inputs = call_inputs(rows, self._slots, set(active), widths, gamma=self.config.gamma, prompts=chunks,
                             reset=reset)
        ridden = np.array([len(chunks[b]) if b in chunks else 0 for b in rows])
        prompts, prompt_tokens = advance_prompts(rows, riders, ridden, self._pending, self._slots), int(ridden.sum())
        if segment is not None:  # no rider beside it (`step`): the segment's prompt is the call's one
            assert not riders, "riders and a prompt segment in one call"
            inputs, prompts, prompt_tokens = self._with_segment(inputs, segment)
        out, self.state, self.draft_cache = calls.fetch_early(call(self.exe.params.arrays, self.state, self.draft_cache,
                                                                   inputs))
        for seq, _, last in prompts.values():
            if last:
                seq.issued(None)  # its first token, unread until this call is
        self.live.issued(bucket, width if drafted else "decode", with_prompt=segment is not None)
        sequences = {b: self._slots[b] for b in active}
        for b, seq in sequences.items():
            seq.issued(widths.get(b, 0))
        return IssuedVerify(out, rows, sequences, stale, width, widths, bucket, drafted, started,
                            self.cost_summary(bucket), prompts, prompt_tokens, segment)

    def _read_verify(self, call: IssuedVerify) -> dict[int, Delta]:
        """Emit a verify call's tokens to the requests it ran for that still hold their slots (one
        finished, cancelled or failed after the call was issued has them dropped)."""
        n_acc, token, drafts, confidence, invalid, waited, ready = calls.read_output(call.out, self.config.gamma)
        row_of = {b: i for i, b in enumerate(call.rows.tolist())}
        live = {b: seq for b, seq in call.sequences.items() if self._slots[b] is seq}
        deltas = self._first_deltas(call.rows, call.prompts, token, invalid) if call.segment is None else \
            self._first_deltas(np.array([call.segment]), call.prompts, token[-1:], invalid[-1:])  # prompts ended in it
        if not live:  # every request it ran for ended before it was read: a call wasted, no step to record
            self._last_read = time.perf_counter()
            self.live.close_window()
            return deltas
        # Python lists, read once: numpy scalars row by row took twice as long (timeit, 64 rows: 46 against 22 us)
        accepted, tokens, failed = n_acc.tolist(), token.tolist(), invalid.tolist()
        proposed = drafts.tolist() if call.width else None
        for b, seq in live.items():
            i = row_of[b]
            new = [*proposed[i][:accepted[i]], tokens[i]] if call.width else [tokens[i]]
            deltas[seq.request_id] = self._emit(b, new, failed[i])
        records = tuple(RowRecord(seq.request_id, call.stale[b], accepted[row_of[b]], deltas[seq.request_id].tokens,
                                  call.widths.get(b, 0)) for b, seq in live.items())
        # the step's cost: from its choice, or (overlapped) from the end of the read before, to its tokens emitted
        seconds, self._last_read = (now := time.perf_counter()) - max(call.started, self._last_read), now
        record = StepRecord(call.width, seconds, records, call.costs["draft_cost_s"],
                            None if call.costs["verify_costs_s"] is None else tuple(call.costs["verify_costs_s"]),
                            call.bucket, drafted_call=call.drafted, waited_s=waited, ready=ready,
                            prompt_tokens=call.prompt_tokens)
        if confidence is None:
            for seq, row in zip(live.values(), records):
                seq.record(record, row, None)
        else:
            proposed = confidence[[row_of[b] for b in live]]  # the live rows' proposals, then their averages
            typical = moved_averages([seq.typical for seq in live.values()], proposed)
            for seq, row, c, t in zip(live.values(), records, proposed, typical):
                seq.record(record, row, c, t)
            self.prior.update(proposed)
            self.calibration.observe(records, [seq.greedy for seq in live.values()])
        self.live.observe(call.bucket, record.drafted_call, call.width, record.seconds, ready,
                          call.segment is not None, waited)
        self._publish(record)
        return deltas

    def _choose(self, stale: dict[int, np.ndarray], bucket: int, with_prompt: bool = False):
        """(executable width, {slot: width}, whether it drafts, executable) for this step (`widths.choose`;
        `with_prompt`: the executable with a prompt segment)."""
        speculating = {b: self._slots[b].speculates() for b in stale}
        calls, adaptive = self.exe.buckets[bucket], self._adaptive()
        stale, typical = judged(stale, self._slots, self.calibration, self.options, adaptive)
        switch = self.live.switch_price(bucket, with_prompt) if adaptive and self.options.price_switches else \
            (None, 0.0)
        width, widths = choose(stale, speculating, self._policy_at(bucket) if self.speculative else None, adaptive,
                               calls.step, self._slots, self.options, self._first_confidence(), switch, typical)
        if width is None:
            return 0, {}, False, calls.verify_call(None, with_prompt)
        return width, widths, True, calls.verify_call(width, with_prompt)

    def _publish(self, record: StepRecord) -> None:
        """Hand the step's record to the readers outside the requests: the log line, recorders."""
        self.last_step = record
        self._readers.publish(record, self.options.log_every)

    def _emit(self, b: int, new: list[int], invalid: bool = False) -> Delta:
        """Slot b's sequence takes the tokens; a finished request leaves its slot. An invalid
        verification (non-finite logits or draft probabilities) ends the request with an error
        instead of emitting a token."""
        seq = self._slots[b]
        delta = seq.finish("error", error=NON_FINITE) if invalid else seq.emit(new)
        if delta.final:
            self._slots[b] = None
            del self._slot_of[delta.request_id]
        return delta
