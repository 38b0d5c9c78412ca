"""The engine: slots of requests over one decode state; a step = choose the width, then draft and
verify in one executable call.

The host owns the bookkeeping (which slot holds which request, its tokens, stop conditions,
statistics); the device owns the model state. Per step only (n_accepted, token) per slot, the
drafted tokens and their confidences come back to the host, as one small array. Requests join a
free slot (prefill in chunks of `prefill_chunk`, other slots idle in that call) and leave it when
they finish.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jdspark.config import EngineConfig
from jdspark.drafter import dspark
from jdspark.engine import costs
from jdspark.engine.errors import CapacityError, ContextLengthError, EngineError, PromptError
from jdspark.engine.executables import Executables, read_output, slot_inputs
from jdspark.engine.request import CompletionStats, SamplingParams
from jdspark.model import state
from jdspark.model.model import Model
from jdspark.speculative.selector import AdaptiveWidth, FallbackBreaker

log = logging.getLogger(__name__)

WidthPolicy = Callable[[np.ndarray], int]  # stale confidences [gamma] of one slot -> width k


@dataclasses.dataclass
class Slot:
    """One running request."""

    prompt_len: int
    params: SamplingParams
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    anchor: int = 0  # the last emitted token: the next block's anchor (not yet in the state)
    confidence: np.ndarray | None = None  # the previous proposal's confidences (stale on purpose)
    finish_reason: str | None = None
    stats: CompletionStats = dataclasses.field(default_factory=CompletionStats)
    seed: int = 0
    started: float = 0.0
    steps: int = 0
    breaker: FallbackBreaker | None = None


@dataclasses.dataclass(frozen=True)
class SpecOptions:
    """How the engine speculates. `width=None` is adaptive (E(k)/(D+V(k)) from measured costs);
    an integer fixes the width. `fallback_threshold` > 0 turns on the acceptance breaker (0.60 /
    32 / 64 is the measured starting point of the reference). Costs are cached in `cost_cache_dir`
    (default ~/.cache/jdspark/costs) unless `reprofile`."""

    width: int | None = None
    fallback_threshold: float = 0.0
    fallback_min_drafted: int = 32
    fallback_cooldown: int = 64
    profile_runs: int = 7
    cost_cache_dir: str | None = None
    reprofile: bool = False
    log_every: int = 0  # steps between engine log lines (0: never)


class Engine:
    def __init__(self, model: Model, config: EngineConfig, *, speculative: bool = True, prefill_chunk: int = 256,
                 options: SpecOptions = SpecOptions(), width_policy: WidthPolicy | None = None,
                 widths: tuple[int, ...] | None = None, use_kernel: bool | None = None,
                 pack_params: bool | None = None):
        """`widths`: the step widths to compile (default 0..gamma; only 0 without speculation);
        `width_policy` overrides the width choice (a function of a slot's stale confidences);
        `use_kernel` (the Pallas rejection sampler) and `pack_params` (small parameters passed in a
        few buffers, `jdspark.engine.packed`) default to on exactly on the GPU."""
        if speculative and model.config.dspark is None:
            raise EngineError("speculative=True needs a checkpoint with a DSpark drafter (dspark_* config keys and "
                              "mtp.* drafter tensors); this one has none: use speculative=False")
        dspark_cfg = model.config.dspark
        if dspark_cfg is not None and dspark_cfg.block_size != config.gamma:
            raise EngineError(f"gamma={config.gamma} but the drafter was built for dspark_block_size="
                              f"{dspark_cfg.block_size}; use gamma={dspark_cfg.block_size}")
        self.model, self.config, self.speculative, self.options = model, config, speculative, options
        self._new_breaker()  # validates the fallback options before anything is compiled
        on_gpu = jax.default_backend() == "gpu"
        use_kernel = on_gpu if use_kernel is None else use_kernel
        pack_params = on_gpu if pack_params is None else pack_params
        if widths is None:
            widths = tuple(range(config.gamma + 1)) if speculative else (0,)
        bad = [k for k in widths if not 0 <= k <= config.gamma or (k and not speculative)]
        if bad or not widths:
            raise EngineError(f"widths={widths}: each must be in 0..gamma={config.gamma} (only 0 without speculation)")
        self.exe = Executables(model, config, min(prefill_chunk, config.max_seq_len), use_kernel,
                               widths if speculative else (), pack_params)
        self.decode, self.draft = self._fresh_state()
        self.slots: list[Slot | None] = [None] * config.max_batch
        start = time.perf_counter()
        self.exe.compile(self.decode, self.draft)
        log.info("compiled %d executables in %.1f s", 2 + len(self.exe.step), time.perf_counter() - start)
        self.selector: AdaptiveWidth | None = None
        if width_policy is None and speculative:
            if options.width is not None:
                if options.width not in widths:
                    raise EngineError(f"width={options.width}: must be one of the compiled widths {sorted(widths)}")
                width_policy = lambda confidence: options.width  # noqa: E731
            elif set(widths) == set(range(config.gamma + 1)):
                verify_costs, draft_cost = self._measure_costs()
                self.selector = AdaptiveWidth(verify_costs, draft_cost, config.gamma)
                width_policy = self.selector
            else:
                raise EngineError(f"adaptive width needs every width 0..{config.gamma} compiled, got {widths}")
        self.width_policy = width_policy or (lambda confidence: config.gamma)
        self.window = _Window()
        self.decisions: list[dict] | None = None  # set to [] to record every step's choice (profiling)

    def _fresh_state(self):
        """Empty decode state and draft cache (None without a drafter) for every slot."""
        draft = None
        if self.model.config.dspark is not None:
            draft = dspark.init_draft_cache(self.model.config, self.config.max_batch, self.model.dtype)
        return self.model.init_state(self.config), draft

    def reset(self) -> None:
        """Drop every request and start again from empty device state. An executable that raised
        may already have consumed the donated state, so a server calls this after a failed step to
        keep serving the next requests."""
        self.slots = [None] * self.config.max_batch
        self.decode, self.draft = self._fresh_state()

    def _measure_costs(self) -> tuple[list[float], float]:
        """(V(0..gamma), D) for the selector: a step[k] call drafts and verifies, so it costs
        S(k) = D + V(k) as a whole; D is S(0) less a plain decode call (the same verification without
        the draft), and V(k) = S(k) - D. The selector's E(k) / (D + V(k)) is then E(k) / S(k)."""
        measured = self.measure_call_costs()
        step = [measured[f"step{k}"] for k in sorted(self.exe.step)]
        draft = max(step[0] - measured["decode"], 0.0)
        return [s - draft for s in step], draft

    def measure_call_costs(self) -> dict[str, float]:
        """Seconds per synchronised call of `decode` and of each step[k] ("step{k}"), every slot
        active, each call on emptied state (`jdspark.engine.costs`: median of `profile_runs`, cached
        unless `reprofile`); runs before any request is admitted."""
        active = np.ones(self.config.max_batch, bool)
        slots = self._slot_inputs(np.zeros(self.config.max_batch, np.int32), active)
        calls = {"decode": self.exe.decode, **{f"step{k}": self.exe.step[k] for k in sorted(self.exe.step)}}

        def run(label):
            out, self.decode, self.draft = calls[label](self.exe.params.arrays, self.decode, self.draft, slots)
            jax.block_until_ready(out)

        def reset():
            self.decode = state.reset_slots(self.decode, active)
            self.draft = dspark.reset_draft_slots(self.draft, active)
            jax.block_until_ready((self.decode, self.draft))

        key = costs.cost_key(self.model.config.to_dict(), str(self.model.dtype), dataclasses.asdict(self.config))
        cache_dir = Path(self.options.cost_cache_dir) if self.options.cost_cache_dir else None
        measured = costs.load_or_measure(key, run, list(calls), self.options.profile_runs, cache_dir,
                                         self.options.reprofile, reset)
        reset()
        return measured

    # ---- requests -------------------------------------------------------------------------------
    def add(self, prompt_ids, params: SamplingParams) -> int:
        """Admit one request into a free slot and prefill it; returns the slot index."""
        return self.add_many([(prompt_ids, params)])[0]

    def add_many(self, requests: list[tuple[object, SamplingParams]]) -> list[int]:
        """Admit several requests at once (their prompts are prefilled together); returns their
        slots. Every request is checked before any is admitted."""
        prompts = [self.check_prompt(ids, params) for ids, params in requests]
        free = [i for i, s in enumerate(self.slots) if s is None]
        if len(free) < len(requests):
            raise CapacityError(f"{len(requests)} request(s) but only {len(free)} of {self.config.max_batch} slots are free")
        slots = free[:len(requests)]
        now = time.perf_counter()
        for b, ids, (_, params) in zip(slots, prompts, requests):
            seed = params.seed if params.seed is not None else int(np.random.default_rng().integers(2 ** 32))
            self.slots[b] = Slot(prompt_len=len(ids), params=params, seed=seed, started=now,
                                 confidence=np.ones(self.config.gamma, np.float32),  # inherits nothing
                                 stats=CompletionStats.empty(len(ids), self.config.gamma),
                                 breaker=self._new_breaker())
        chunk, batch = self.exe.prefill_chunk, self.config.max_batch
        first = np.zeros(batch, np.int32)
        sampling = self._slot_inputs(np.zeros(batch, np.int32), np.zeros(batch, bool))
        for start in range(0, max(len(p) for p in prompts), chunk):
            batch_ids = np.zeros((batch, chunk), np.int32)
            n_valid = np.zeros(batch, np.int32)
            reset = np.zeros(batch, bool)
            for b, ids in zip(slots, prompts):
                piece = ids[start:start + chunk]
                batch_ids[b, :len(piece)] = piece
                n_valid[b], reset[b] = len(piece), start == 0
            token, self.decode, self.draft = self.exe.prefill(self.exe.params.arrays, self.decode, self.draft, batch_ids,
                                                              n_valid, reset, sampling)
            token = np.asarray(token)
            for b, ids in zip(slots, prompts):
                if start < len(ids) <= start + chunk:  # this chunk held the prompt's last token
                    first[b] = token[b]
        for b in slots:
            self.slots[b].stats.time_to_first_token_s = time.perf_counter() - self.slots[b].started
            self._emit(b, [int(first[b])])
        return slots

    def check_prompt(self, prompt_ids, params: SamplingParams) -> np.ndarray:
        """The prompt as int32 ids, or EngineError if it cannot run here (empty, ids outside the
        vocabulary, or prompt + max_tokens + speculative rows over max_seq_len). Reads only the
        configuration, so a server can check a request before queueing it."""
        ids = np.asarray(prompt_ids)
        vocab = self.model.config.vocab_size
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise PromptError(f"the prompt must be a non-empty list of token ids, got {prompt_ids!r:.80}")
        if ids.min() < 0 or ids.max() >= vocab:
            raise PromptError(f"token id {int(ids[(ids < 0) | (ids >= vocab)][0])} is outside the vocabulary [0, {vocab})")
        if params.max_tokens > self.room(len(ids)):
            need = len(ids) + params.max_tokens + self.config.rollback_rows
            raise ContextLengthError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) + {self.config.rollback_rows} "
                              f"speculative rows = {need} exceeds max_seq_len={self.config.max_seq_len}; shorten the "
                              "prompt, lower max_tokens or raise max_seq_len")
        return ids.astype(np.int32)

    def room(self, prompt_len: int) -> int:
        """The most tokens a request with a prompt of `prompt_len` tokens may generate here."""
        return self.config.max_seq_len - self.config.rollback_rows - prompt_len

    def release(self, b: int) -> None:
        """Free slot b (its state is reset when the next request is prefilled into it)."""
        self.slots[b] = None

    @property
    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is not None and s.finish_reason is None]

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> dict[int, list[int]]:
        """One draft + verify (one executable call) for every active slot; returns the tokens each
        slot emitted.

        The width comes from confidences the host already holds (the previous step's), so the
        choice never waits on the device and never sees the block it applies to. Speculation is
        skipped (a plain decode step, no drafting) when every active slot's breaker is cooling down.
        """
        active = self.active
        if not active:
            return {}
        started = time.perf_counter()
        mask = np.zeros(self.config.max_batch, bool)
        mask[active] = True
        anchor = np.zeros(self.config.max_batch, np.int32)
        for b in active:
            anchor[b] = self.slots[b].anchor
        slots = self._slot_inputs(anchor, mask)
        stale = {b: self.slots[b].confidence for b in active}  # the previous step's: what the choice reads
        speculate = self.speculative and any([self._breaker_allows(self.slots[b]) for b in active])
        if speculate:
            width = max(self.width_policy(stale[b]) for b in active)
            if width not in self.exe.step:
                raise EngineError(f"the width policy chose k={width}, but only widths {sorted(self.exe.step)} "
                                  "were compiled")
            call = self.exe.step[width]
        else:
            width, call = 0, self.exe.decode
        out, self.decode, self.draft = call(self.exe.params.arrays, self.decode, self.draft, slots)
        n_acc, token, drafts, confidence = read_output(out, self.config.gamma)
        emitted, cost = {}, self.cost_summary()
        for b in active:
            slot = self.slots[b]
            slot.steps += 1
            slot.stats.draft_cost_s, slot.stats.verify_costs_s = cost["draft_cost_s"], cost["verify_costs_s"]
            slot.stats.record_step(width, int(n_acc[b]))
            if width and slot.breaker is not None:
                slot.breaker.record(int(n_acc[b]), width)
            if confidence is not None:
                slot.confidence = confidence[b]
            new = [*drafts[b, :n_acc[b]].tolist(), int(token[b])] if width else [int(token[b])]
            emitted[b] = self._emit(b, new)
        seconds = time.perf_counter() - started
        self.window.record(width, n_acc[active], sum(len(t) for t in emitted.values()), seconds)
        if self.decisions is not None:
            self.decisions.append({"width": width, "seconds": seconds, "slots": {
                b: {"stale_confidence": stale[b].tolist(), "n_accepted": int(n_acc[b]), "emitted": emitted[b]}
                for b in active}})
        if self.options.log_every and self.window.steps >= self.options.log_every:
            log.info("%s", self.window.summary(self.cost_summary()))
            self.window = _Window()
        return emitted

    def cost_summary(self) -> dict:
        """D and V(k) (seconds) the selector uses; None without a selector (fixed width)."""
        if self.selector is None:
            return {"draft_cost_s": None, "verify_costs_s": None}
        return {"draft_cost_s": self.selector.draft_cost, "verify_costs_s": self.selector.verify_costs.tolist()}

    def _breaker_allows(self, slot: Slot) -> bool:
        return slot.breaker is None or slot.breaker.should_speculate()

    def _new_breaker(self) -> FallbackBreaker | None:
        o = self.options
        return FallbackBreaker(o.fallback_threshold, o.fallback_min_drafted, o.fallback_cooldown) \
            if o.fallback_threshold else None

    def _emit(self, b: int, new: list[int]) -> list[int]:
        """Append tokens to slot b up to the first stop condition; returns what was appended."""
        slot, params = self.slots[b], self.slots[b].params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.model.config.eos_token_id})
        out = []
        for t in new:
            out.append(t)
            if t in stops:
                slot.finish_reason = "stop"
                break
            if len(slot.tokens) + len(out) >= params.max_tokens:
                slot.finish_reason = "length"
                break
        slot.tokens.extend(out)
        slot.anchor = out[-1]
        slot.stats.generated_tokens = len(slot.tokens)
        slot.stats.elapsed_s = time.perf_counter() - slot.started
        return out

    def _slot_inputs(self, anchor: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Every per-slot input of a call (`executables.slot_inputs`); idle slots get greedy
        defaults. The counter makes every call's noise fresh (it counts the slot's own steps, so a
        seeded request is reproducible)."""
        n = self.config.max_batch
        temperature, top_k, top_p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
        seed, counter = np.zeros(n, np.uint32), np.zeros(n, np.int32)
        for b, slot in enumerate(self.slots):
            if slot is not None:
                p = slot.params
                temperature[b], top_k[b], top_p[b] = p.temperature, p.top_k, p.top_p
                seed[b], counter[b] = slot.seed, slot.steps
        return slot_inputs(anchor=anchor, active=active, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, counter=counter)


class _Window:
    """Counters between two engine log lines."""

    def __init__(self):
        self.steps = self.tokens = self.drafted = self.accepted = 0
        self.seconds = 0.0
        self.widths: dict[int, int] = {}

    def record(self, width: int, n_accepted: np.ndarray, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += width * len(n_accepted)
        self.accepted += int(n_accepted.sum())
        self.widths[width] = self.widths.get(width, 0) + 1

    def summary(self, cost: dict) -> str:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        d, v = cost["draft_cost_s"], cost["verify_costs_s"]
        costs_text = "" if v is None else (f" D={d * 1e3:.2f}ms" if d else " D=?") + " V=[" + \
            ", ".join(f"{x * 1e3:.2f}" for x in v) + "]ms"
        widths = " ".join(f"{k}:{n}" for k, n in sorted(self.widths.items()))
        return (f"{self.steps} steps: {self.tokens / max(self.seconds, 1e-9):.1f} tok/s, acceptance {rate:.2f}, "
                f"widths {{{widths}}}{costs_text}")
