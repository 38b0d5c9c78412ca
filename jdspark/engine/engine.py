"""The engine: slots of requests over one decode state; a step = prefill one chunk of the prompts
still coming in (if any), then choose each running request's width and draft + verify them all in
one executable call of the smallest batch bucket that holds them.

The host owns the bookkeeping (which slot holds which request, its tokens, stop conditions,
statistics); the device owns the model state. Per call only (n_accepted, token) per row, the
drafted tokens and their confidences come back to the host, as one small array. Requests join a
free slot and leave it when they finish. `add_many` prefills its prompts at once (offline use);
`admit` spreads them over the coming steps, `prefill_budget` prompt tokens per step, so running
requests keep decoding while a new one is prefilled (serving), and new prompts may wait to share a
call (`batch.prefill_waits`) or, short ones, ride in the verify calls (`ride_prompts`). With overlap
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
from jdspark.engine import calls, costs, deferred
from jdspark.engine.batch import (IssuedPrefill, IssuedVerify, PendingPrompt, advance_prompts, call_inputs, call_slots,
                                  prefill_inputs, prompts_this_step)
from jdspark.engine.errors import CapacityError, EngineError
from jdspark.engine.executables import Executables
from jdspark.engine.options import RIDE_PROMPTS, SpecOptions, WidthPolicy
from jdspark.engine.policy import SpeculationPolicy
from jdspark.engine.request import Completion, Delta, SamplingParams, check_prompt, room
from jdspark.engine.sequence import NON_FINITE, ConfidencePrior, Sequence
from jdspark.engine.stats import RowRecord, StepReaders, StepRecord
from jdspark.engine.widths import choose, compiled_widths, judged
from jdspark.model.model import Model
from jdspark.speculative.calibration import Calibration
from jdspark.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine(SpeculationPolicy):
    """Slots of running requests over one decode state. Faces hand it prompts and read `Delta`s:
    `add` / `add_many` admit (and prefill), `step` advances every running request, `cancel` drops
    one. A request's end (EOS, stop ids, stop strings, max_tokens) is decided here, in its
    `Sequence`, and a finished request's slot is free when its last Delta is returned."""

    def __init__(self, model: Model, config: EngineConfig, *, tokenizer: Tokenizer | None = None,
                 speculative: bool = True, prefill_chunk: int = 256, options: SpecOptions = SpecOptions(),
                 width_policy: WidthPolicy | None = None, widths: tuple[int, ...] | None = None,
                 implementation: str = "auto", pack_params: bool | None = None, prefill_budget: int | None = None,
                 overlap: bool = True, batch_prefills: bool = True, defer_steps: bool = False,
                 ride_prompts: int = RIDE_PROMPTS):
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
        the step's width + 1 tokens a call, instead of taking prefill calls of its own (0: never; `step`)."""
        widths = compiled_widths(model.config, config, speculative, widths, options.width)
        self.model, self.config, self.speculative, self.options = model, config, speculative, options
        self.overlap, self.batch_prefills, self.ride_prompts = overlap, batch_prefills, ride_prompts
        self._last_width = None  # the executable width of the last verify call (0: a decode; None: none yet)
        self._unread: list[IssuedPrefill | IssuedVerify] = []  # calls issued and not yet read (the previous step's)
        self._last_read = 0.0  # when a call was last read (perf_counter): where an overlapped step's time starts
        self.tokenizer = tokenizer
        options.breaker()  # validates the fallback options before anything is compiled
        on_gpu = jax.default_backend() == "gpu"
        pack_params = on_gpu if pack_params is None else pack_params
        chunk = min(prefill_chunk, config.max_seq_len)
        default_rows = config.max_batch if on_gpu else 1  # prompts prefilled beside running requests
        self.prefill_rows = default_rows if prefill_budget is None else max(1, prefill_budget // chunk)
        self.exe = Executables(model, config, chunk, implementation, widths if speculative else (), pack_params)
        self.state, self.draft_cache = self._fresh_state()
        self._slots: list[Sequence | None] = [None] * config.max_batch
        self._slot_of: dict[int, int] = {}  # request id -> slot
        self._pending: dict[int, PendingPrompt] = {}  # slot -> prompt still being prefilled, oldest first
        self._next_id, self.prior, self.calibration = 0, ConfidencePrior(config.gamma), Calibration(config.gamma)
        # several processes must issue the same calls: none takes executables a step apart from the others
        start, defer = time.perf_counter(), defer_steps and speculative and jax.process_count() == 1
        which = "serving" if defer else "all"
        if defer:
            self._width_policy(width_policy, widths, True, measure=False)  # a bad choice fails now, not when taken
        self.exe.compile(self.state, self.draft_cache, which)
        self.state, self.draft_cache = self.exe.warm_up(self.state, self.draft_cache, which)
        self.selector, self.selectors, self.live = None, {}, costs.LiveCosts({})  # the measured selectors: the
        # largest bucket's, every bucket's, and as the steps take them (`costs.LiveCosts`), once measured
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

    def reset(self) -> list[Delta]:
        """Fail every request and start again from empty device state. An executable that raised
        may already have consumed the donated state, so a server calls this after a failed step to
        keep serving the next requests. Returns the failed requests' last Deltas."""
        failed = [seq.finish("error", error="the engine failed while running this request")
                  for seq in self._slots if seq is not None]
        self._slots = [None] * self.config.max_batch
        self._slot_of.clear()
        self._pending.clear()
        self._unread = []
        self.state, self.draft_cache = self._fresh_state()
        return failed

    # ---- requests -------------------------------------------------------------------------------
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
        return [self._admit(b, ids, params) for b, ids, (_, params) in zip(free, prompts, requests)]

    def _admit(self, b: int, prompt: np.ndarray, params: SamplingParams) -> int:
        seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(2 ** 32))
        rid, self._next_id = self._next_id, self._next_id + 1
        self._slots[b] = Sequence(rid, len(prompt), params, seed=seed, gamma=self.config.gamma,
                                  eos_token_id=self.model.config.eos_token_id, tokenizer=self.tokenizer,
                                  breaker=self.options.breaker(), confidence=self._first_confidence())
        self._slot_of[rid] = b
        self._pending[b] = PendingPrompt(prompt)
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
        prompts that ride in it (`ride_prompts`: their next width + 1 tokens, no prefill call), then read
        calls: with `overlap` the previous step's (these run meanwhile; a request that ended in them has its
        extra call's tokens dropped), else these. Returns each request's Delta by request id (a request whose
        prompt ended gets its first, with what its first verify emitted); finished requests' slots are then
        free; `last_step`: the verify call's record (None when only a prefill was read)."""
        self.last_step = None
        self.poll()
        running = [b for b, seq in enumerate(self._slots)
                   if seq is not None and b not in self._pending and seq.may_issue()]
        riders = self._riders(len(running))
        waiting = {b: prompt for b, prompt in self._pending.items() if b not in riders}
        rows = prompts_this_step(waiting, len(running), self.prefill_rows, self.config.prefill_buckets,
                                 self.live.prefill_s if self.batch_prefills else {}, self.live.prefill_row_s)
        issued = [self._issue_prefill(list(waiting)[:rows])] if rows else []
        running += [b for call in issued for b, (seq, _, last) in call.prompts.items() if last and seq.may_issue()]
        if running:
            issued.append(self._issue_verify(sorted(running), riders))
        if self.overlap:
            issued, self._unread = self._unread, issued
        deltas: dict[int, Delta] = {}
        for call in issued:
            read = self._read_prefill(call) if isinstance(call, IssuedPrefill) else self._read_verify(call)
            deltas.update({rid: deltas[rid].then(d) if rid in deltas else d for rid, d in read.items()})
        return deltas

    def _riders(self, running: int) -> list[int]:
        """The pending prompts that ride in this step's verify call (`ride_prompts`): beside running
        requests, while the last verify call verified drafts (width > 0: a decode call would carry one token
        of each; on the 2-core CPU target-only riding cost 8% of tok/s), those with at most `ride_prompts`
        tokens left. The width is the last call's: this step's, chosen for the bucket the riders fill, may
        be 0 (they then carry a token each). A prompt begun riding goes on in prefill calls when it stops."""
        if not self.ride_prompts or not running or not self._last_width:
            return []
        return [b for b, prompt in self._pending.items() if len(prompt.ids) - prompt.done <= self.ride_prompts]

    def _issue_verify(self, active: list[int], riders: list[int] = ()) -> IssuedVerify:
        started = time.perf_counter()
        bucket = self.config.bucket(len(active) + len(riders))
        stale = {b: self._slots[b].confidence for b in active}  # the last read proposal's: what the choice reads
        width, widths, call = self._choose(stale, bucket)
        self._last_width = width
        rows = call_slots(sorted([*active, *riders]), bucket, self.config.max_batch)
        chunks = {b: self._pending[b].chunk(width + 1) for b in riders}
        reset = np.array([b in chunks and self._pending[b].done == 0 for b in rows.tolist()])
        inputs = call_inputs(rows, self._slots, set(active), widths, gamma=self.config.gamma, prompts=chunks,
                             reset=reset)
        out, self.state, self.draft_cache = calls.fetch_early(call(self.exe.params.arrays, self.state, self.draft_cache,
                                                                   inputs))
        ridden = np.array([len(chunks[b]) if b in chunks else 0 for b in rows])
        prompts = advance_prompts(rows, riders, ridden, self._pending, self._slots)
        for seq, _, last in prompts.values():
            if last:
                seq.issued(None)  # its first token, unread until this call is
        drafted = call is not self.exe.buckets[bucket].decode
        self.live.issued(bucket, width if drafted else "decode")
        sequences = {b: self._slots[b] for b in active}
        for b, seq in sequences.items():
            seq.issued(widths.get(b, 0))
        return IssuedVerify(out, rows, sequences, stale, width, widths, bucket, drafted, started,
                            self.cost_summary(bucket), prompts, int(ridden.sum()))

    def _read_verify(self, call: IssuedVerify) -> dict[int, Delta]:
        """Emit a verify call's tokens to the requests it ran for that still hold their slots (one
        finished, cancelled or failed after the call was issued has them dropped)."""
        n_acc, token, drafts, confidence, invalid, waited, ready = calls.read_output(call.out, self.config.gamma)
        row_of = {b: i for i, b in enumerate(call.rows.tolist())}
        live = {b: seq for b, seq in call.sequences.items() if self._slots[b] is seq}
        deltas = self._first_deltas(call.rows, call.prompts, token, invalid)  # prompts that ended riding in it
        if not live:  # every request it ran for ended before it was read: a call wasted, no step to record
            self._last_read = time.perf_counter()
            self.live.close_window()
            return deltas
        for b, seq in live.items():
            i = row_of[b]
            new = [*drafts[i, :n_acc[i]].tolist(), int(token[i])] if call.width else [int(token[i])]
            deltas[seq.request_id] = self._emit(b, new, bool(invalid[i]))
        records = tuple(RowRecord(seq.request_id, call.stale[b], int(n_acc[row_of[b]]), deltas[seq.request_id].tokens,
                                  call.widths.get(b, 0)) for b, seq in live.items())
        # the step's cost: from its choice, or (overlapped) from the end of the read before, to its tokens emitted
        seconds, self._last_read = (now := time.perf_counter()) - max(call.started, self._last_read), now
        record = StepRecord(call.width, seconds, records, call.costs["draft_cost_s"],
                            None if call.costs["verify_costs_s"] is None else tuple(call.costs["verify_costs_s"]),
                            call.bucket, drafted_call=call.drafted, waited_s=waited, ready=ready,
                            prompt_tokens=call.prompt_tokens)
        for (b, seq), row in zip(live.items(), records):
            seq.record(record, row, None if confidence is None else confidence[row_of[b]])
        if confidence is not None:
            self.prior.update(confidence[[row_of[b] for b in live]])
            self.calibration.observe(records, [seq.greedy for seq in live.values()])
        self.live.observe(call.bucket, record.drafted_call, call.width, record.seconds, ready)
        self._publish(record)
        return deltas

    def _choose(self, stale: dict[int, np.ndarray], bucket: int):
        """(executable width, {slot: width}, executable) for this step (`widths.choose`)."""
        speculating = {b: self._slots[b].speculates() for b in stale}
        calls, adaptive = self.exe.buckets[bucket], self._adaptive()
        stale, typical = judged(stale, self._slots, self.calibration, self.options, adaptive)
        switch = self.live.switch_price(bucket) if adaptive and self.options.price_switches else (None, 0.0)
        width, widths = choose(stale, speculating, self._policy_at(bucket) if self.speculative else None, adaptive,
                               calls.step, self._slots, self.options, self._first_confidence(), switch, typical)
        return (0, {}, calls.decode) if width is None else (width, widths, calls.step[width])

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
