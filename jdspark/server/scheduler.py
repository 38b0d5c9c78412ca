"""Continuous batching: one thread owns the Engine; requests join and leave between steps.

Each loop iteration: release slots of requests whose client went away, admit queued requests into
free slots (`add_many`: their prompts are prefilled together, each with its own sampling, seed and
stop conditions; the engine resets a slot's state and confidences on admission), run one engine
step for every active slot, and hand each request its new tokens. Text is detokenized here (the
Detokenizer holds back incomplete UTF-8 and partial stop strings, and a completed stop string must
end the request before the next step) and delivered to the request's asyncio queue with
`loop.call_soon_threadsafe`. An exception inside the engine fails the requests it was running,
resets the engine's device state and the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time

from jdspark.engine.engine import Engine
from jdspark.engine.request import CompletionStats, SamplingParams
from jdspark.server.metrics import Metrics
from jdspark.tokenizer.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is taken and the queue is at its limit."""


@dataclasses.dataclass
class Update:
    """What one request gets after an engine step. The last update has `finish_reason` ("stop",
    "length") and the usage counts, or `error` (the engine failed while running it)."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Request:
    """A request between the HTTP handler (reads `queue` in its event loop) and the engine thread."""

    def __init__(self, ids: list[int], params: SamplingParams, tokenizer: Tokenizer):
        self.ids, self.params = ids, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.detok = Detokenizer(tokenizer, params.stop)
        self.arrival = time.perf_counter()
        self.cancelled = False  # set by the handler (client gone); the engine thread reads it
        self.slot: int | None = None
        self.last_delivery: float | None = None
        self.seen = CompletionStats()  # statistics already counted in the metrics

    def post(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass


def _snapshot(stats: CompletionStats) -> CompletionStats:
    return CompletionStats(widths=list(stats.widths), verified_at=list(stats.verified_at),
                           accepted_at=list(stats.accepted_at))


class Scheduler:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics, max_queue: int):
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue}: must be >= 0")
        self.engine, self.tokenizer, self.metrics, self.max_queue = engine, tokenizer, metrics, max_queue
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}  # slot -> request; changed by the engine thread under _cond
        self._admitting: list[Request] = []  # taken from the queue, being prefilled
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jdspark-engine", daemon=True)

    # ---- called from the event loop ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def submit(self, ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (already checked with `engine.check_prompt`); QueueFull when running
        slots and queue are both full."""
        request = Request(ids, params, self.tokenizer)
        with self._cond:
            capacity = self.engine.config.max_batch + self.max_queue
            if len(self._running) + len(self._admitting) + len(self._waiting) >= capacity:
                raise QueueFull(f"all {self.engine.config.max_batch} slots are busy and {len(self._waiting)} "
                                f"request(s) are queued (--max-queue {self.max_queue}); retry later")
            self._waiting.append(request)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """The client is gone: free its slot (or queue place) before the next step."""
        request.cancelled = True
        with self._cond:
            self._cond.notify()

    @property
    def running(self) -> list[Request]:
        with self._cond:
            return [*self._running.values(), *self._admitting]

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    # ---- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._running):
                    self._cond.wait()
                if self._stopping:
                    break
                while self._waiting and len(self._running) + len(self._admitting) < self.engine.config.max_batch:
                    self._admitting.append(self._waiting.popleft())
                self.metrics.waiting.set(len(self._waiting))
            try:
                self._release_cancelled()
                self._admit()
                if self.engine.active:
                    self._deliver_all(self.engine.step())
            except Exception as e:  # an engine failure: fail what it was running, keep serving
                log.exception("engine step failed; failing %d running request(s)", len(self._running))
                self._fail_running(f"engine error: {type(e).__name__}: {e}")
        self._fail_running("the server is shutting down")

    def _aborted(self, r: Request) -> bool:
        if r.cancelled:
            self.metrics.requests.labels(finished_reason="abort").inc()
        return r.cancelled

    def _release_cancelled(self) -> None:
        for r in [r for r in self._running.values() if r.cancelled]:
            self._release(r)
            self._aborted(r)

    def _admit(self) -> None:
        requests = [r for r in self._admitting if not self._aborted(r)]
        slots = self.engine.add_many([(r.ids, r.params) for r in requests]) if requests else []
        with self._cond:
            self._admitting.clear()
            for r, b in zip(requests, slots):
                self._running[b] = r
                r.slot = b
            self.metrics.running.set(len(self._running))
        self.metrics.prompt_tokens.inc(sum(len(r.ids) for r in requests))
        self._deliver_all({b: list(self.engine.slots[b].tokens) for b in slots})

    def _deliver_all(self, emitted: dict[int, list[int]]) -> None:
        for b, tokens in emitted.items():
            self._deliver(self._running[b], tokens)

    def _deliver(self, r: Request, tokens: list[int]) -> None:
        slot, m, now = self.engine.slots[r.slot], self.metrics, time.perf_counter()
        if r.last_delivery is None:
            m.ttft.observe(now - r.arrival)
        else:
            m.itl.observe(now - r.last_delivery)
        r.last_delivery = now
        m.generation_tokens.inc(len(tokens))
        m.record_speculation(slot.stats, r.seen)
        r.seen = _snapshot(slot.stats)
        text = r.detok.add(tokens)
        if r.detok.stopped:
            slot.finish_reason = "stop"
        if slot.finish_reason is None:
            r.post(Update(text=text, tokens=len(tokens)))
            return
        text += r.detok.finish()
        self._release(r)
        m.requests.labels(finished_reason=slot.finish_reason).inc()
        m.e2e.observe(now - r.arrival)
        r.post(Update(text=text, tokens=len(tokens), finish_reason=slot.finish_reason, prompt_tokens=len(r.ids),
                      completion_tokens=len(slot.tokens)))

    def _release(self, r: Request) -> None:
        self.engine.release(r.slot)
        with self._cond:
            del self._running[r.slot]
            self.metrics.running.set(len(self._running))

    def _fail_running(self, message: str) -> None:
        with self._cond:
            failed = [*self._running.values(), *self._admitting]
            self._running.clear()
            self._admitting.clear()
            if self._stopping:
                failed += self._waiting
                self._waiting.clear()
            self.metrics.running.set(0)
        for r in failed:
            self.metrics.requests.labels(finished_reason="error").inc()
            r.post(Update(error=message))
        if failed:
            self.engine.reset()  # the failed call may have consumed the donated device state
