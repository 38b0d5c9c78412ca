"""Continuous batching: one thread owns the Engine; requests join and leave between steps.

Each loop iteration: drop requests whose client went away, admit queued requests into free slots
(`Engine.admit`: no device work; the engine's steps prefill their prompts a budget of tokens at a
time while the running requests keep decoding, and a request's first Delta comes with the step
that ends its prompt), run one engine step, and hand each request its Delta — the
engine has already detokenized it and decided whether the request ended — through its asyncio
queue with `loop.call_soon_threadsafe`. An exception inside the engine fails the requests it was
running, resets the engine's device state and the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import logging
import threading
import time

from jdspark.engine.engine import Engine
from jdspark.engine.errors import EngineError
from jdspark.engine.request import Delta, SamplingParams
from jdspark.server.metrics import Metrics

log = logging.getLogger(__name__)
BUILD_POLL_S = 0.25  # while the step executables build (defer_steps), how often an idle engine thread looks


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

    def __init__(self, ids: list[int], params: SamplingParams):
        self.ids, self.params = ids, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self.cancelled = False  # set by the handler (client gone); the engine thread reads it
        self.request_id: int | None = None  # the engine's, once admitted
        self.last_delivery: float | None = None

    def post(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass


class Scheduler:
    def __init__(self, engine: Engine, metrics: Metrics, max_queue: int):
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue}: must be >= 0")
        if engine.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer (text deltas and stop strings)")
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: dict[int, Request] = {}  # request id -> request; changed by the engine thread under _cond
        self._admitting: list[Request] = []  # taken from the queue, being prefilled
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jdspark-engine", daemon=True)

    # ---- called from the event loop ---------------------------------------------------------------
    def start(self) -> None:
        """Serve. What start-up built (~0.5M objects: the model, executables, tracing's leftovers)
        first leaves the cyclic garbage collector (`gc.freeze`): a full collection scanned it in 270 ms
        on the 2-core CPU, paid by the step it fell in."""
        gc.collect()
        gc.freeze()
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def submit(self, ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (already checked with `engine.check_prompt`); QueueFull when running
        slots and queue are both full."""
        request = Request(ids, params)
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
        """The client is gone: a queued request leaves the queue now; a running one frees its slot
        before the next step."""
        request.cancelled = True
        with self._cond:
            if request in self._waiting:
                self._waiting.remove(request)
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.requests.labels(finished_reason="abort").inc()
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
                queued = bool(self._waiting)
            try:  # takes the step executables once built (defer_steps), outside the lock, never past a queue
                building = self.engine.poll(queued=queued)
            except Exception:  # the engine thread must live on: it serves every request
                log.exception("taking the step executables failed")
                building = False
            with self._cond:
                if not (self._stopping or self._waiting or self._running):
                    self._cond.wait(BUILD_POLL_S if building else None)
                    continue
                if self._stopping:
                    break
                while self._waiting and len(self._running) + len(self._admitting) < self.engine.config.max_batch:
                    self._admitting.append(self._waiting.popleft())
                self.metrics.waiting.set(len(self._waiting))
            try:
                self._drop_cancelled()
                self._admit()
                if self._running:
                    deltas = self.engine.step()
                    if self.engine.last_step is not None:  # None: the step only prefilled
                        self.metrics.record_step(self.engine.last_step)
                    self._deliver_all(deltas)
            except Exception:  # an engine failure: fail what it was running, keep serving
                log.exception("engine step failed; failing %d running request(s)", len(self._running))
                self._fail_running("the engine failed while running this request")
        self._fail_running("the server is shutting down")

    def _aborted(self, r: Request) -> bool:
        if r.cancelled:
            self.metrics.requests.labels(finished_reason="abort").inc()
        return r.cancelled

    def _drop_cancelled(self) -> None:
        for r in [r for r in self._running.values() if self._aborted(r)]:
            self.engine.cancel(r.request_id)
            with self._cond:
                del self._running[r.request_id]
                self.metrics.running.set(len(self._running))

    def _admit(self) -> None:
        requests = [r for r in self._admitting if not self._aborted(r)]
        admitted = self._add(requests)
        with self._cond:
            self._admitting.clear()
            for r, request_id in admitted:
                self._running[request_id] = r
                r.request_id = request_id
            self.metrics.running.set(len(self._running))
        self.metrics.prompt_tokens.inc(sum(len(r.ids) for r, _ in admitted))

    def _add(self, requests: list[Request]) -> list[tuple[Request, int]]:
        """Admit the requests together; if one of them cannot run, each alone, so only it fails."""
        if not requests:
            return []
        try:
            return list(zip(requests, self.engine.admit([(r.ids, r.params) for r in requests])))
        except EngineError:
            admitted = []
            for r in requests:
                try:
                    admitted.append((r, *self.engine.admit([(r.ids, r.params)])))
                except EngineError as e:
                    self.metrics.requests.labels(finished_reason="error").inc()
                    r.post(Update(error=str(e)))
            return admitted

    def _deliver_all(self, deltas: dict[int, Delta]) -> None:
        for rid, delta in deltas.items():
            self._deliver(self._running[rid], delta)

    def _deliver(self, r: Request, delta: Delta) -> None:
        m, now = self.metrics, time.perf_counter()
        if r.last_delivery is None:
            m.ttft.observe(now - r.arrival)
        else:
            m.itl.observe(now - r.last_delivery)
        r.last_delivery = now
        m.generation_tokens.inc(len(delta.tokens))
        if not delta.final:
            r.post(Update(text=delta.text, tokens=len(delta.tokens)))
            return
        with self._cond:
            del self._running[delta.request_id]
            m.running.set(len(self._running))
        m.requests.labels(finished_reason=delta.finish_reason).inc()
        m.e2e.observe(now - r.arrival)
        if delta.error is not None:
            r.post(Update(error=delta.error))
            return
        r.post(Update(text=delta.text, tokens=len(delta.tokens), finish_reason=delta.finish_reason,
                      prompt_tokens=len(r.ids), completion_tokens=len(delta.completion.token_ids)))

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
