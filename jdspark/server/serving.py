"""What both endpoints share: the served engine and its scheduler, the way a request gets from
bytes to a queued `Request`, and the way its updates come back.

A handler authorizes, reads the body within its size limit (event loop), then prepares the
request in a worker thread — JSON decoding, validation, chat encoding, tokenization and the
engine's own check (`Engine.check_prompt`: a 400 before anything is queued) are CPU work that must
not stall the event loop (`/health` keeps answering) — and queues it. It reads the request's
updates from the asyncio queue the engine thread fills; a client that goes away is noticed by
Starlette (cancelling the stream) or by polling `is_disconnected` while waiting, and the request is
cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio.to_thread
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request

from jdspark.engine.engine import Engine
from jdspark.engine.errors import EngineError
from jdspark.engine.request import SamplingParams
from jdspark.server import protocol, validation
from jdspark.server.errors import APIError, clip, engine_failed, from_engine_error, queue_full
from jdspark.server.scheduler import QueueFull, Scheduler, Update
from jdspark.server.scheduler import Request as Pending
from jdspark.tokenizer.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.5  # how often a handler waiting for tokens checks that its client is still there
T = TypeVar("T")


@dataclasses.dataclass
class Serving:
    engine: Engine
    tokenizer: Tokenizer
    scheduler: Scheduler
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = validation.MAX_BODY_BYTES
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    # ---- the event loop -------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                           "server was started with (--api-key)", code="invalid_api_key", type="authentication_error")

    async def prepare(self, request: Request, prepare: Callable[[bytes], T]) -> T:
        """`prepare(body)` of the authorized request's body, run in a worker thread."""
        self.authorize(request)
        raw = await validation.read_body(request, self.max_body_bytes)
        return await anyio.to_thread.run_sync(prepare, raw)

    def submit(self, ids: list[int], params: SamplingParams) -> Pending:
        """Queue a checked request; a 429 when every slot and queue place is taken."""
        try:
            return self.scheduler.submit(ids, params)
        except QueueFull as e:
            raise queue_full(str(e)) from None

    async def updates(self, pending: Pending, request: Request) -> AsyncIterator[Update]:
        """The request's updates until the final one; cancels it if the client leaves first."""
        getter, final = None, False
        try:
            while not final:
                getter = getter or asyncio.ensure_future(pending.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        return
                    continue
                update, getter = getter.result(), None
                final = update.final
                yield update
        finally:
            if getter is not None:
                getter.cancel()
            if not final:
                self.scheduler.cancel(pending)

    async def collect(self, pending: Pending, request: Request, sink: Callable[[str], Any]) -> Update | None:
        """Run a non-streamed request to its end, passing each text delta to `sink`; returns the final
        update, or None if the client left first. An engine failure becomes a 500."""
        u = None
        async for u in self.updates(pending, request):
            if u.error:
                raise engine_failed(u.error)
            sink(u.text)
        return u if u is not None and u.final else None

    # ---- worker threads -------------------------------------------------------------------------
    def parse(self, raw: bytes, model: type[BaseModel]) -> tuple[Any, dict]:
        """The validated request and its raw JSON (tool schemas are rendered in the client's key order)."""
        body = validation.decode_json(raw)
        req = protocol.parse(model, body)
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {clip(req.model, 64)!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        return req, body

    def check(self, ids: list[int], params: SamplingParams, prompt_param: str, length_param: str | None) -> list[int]:
        """The prompt as ints, checked against the engine's limits (typed errors -> HTTP codes)."""
        try:
            self.engine.check_prompt(ids, params)
        except EngineError as e:
            raise from_engine_error(e, prompt_param, length_param) from None
        return [int(t) for t in ids]


def client_gone() -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
