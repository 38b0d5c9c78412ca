"""The FastAPI application: OpenAI routes over one `Scheduler`.

Handlers validate and tokenize in the event loop, check the request against the engine's limits
(`Engine.check_prompt`: a 400 before anything is queued), queue it, and read its updates from an
asyncio queue that the engine thread fills. A client that goes away is noticed by Starlette
(cancelling the stream) or by polling `is_disconnected` while waiting; either way the request is
cancelled and its slot freed before the next engine step. Every error is an OpenAI error object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jdspark.engine.engine import Engine, EngineError
from jdspark.server import chat, protocol
from jdspark.server.metrics import Metrics
from jdspark.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from jdspark.server.scheduler import QueueFull, Scheduler, Update
from jdspark.server.scheduler import Request as Pending
from jdspark.tokenizer.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.5  # how often a handler waiting for tokens checks that its client is still there
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, *, api_key: str | None = None,
               max_queue: int = 64) -> FastAPI:
    """The server for one compiled engine. The engine thread starts with the app and stops with it."""
    metrics = Metrics(engine.config.gamma)
    scheduler = Scheduler(engine, tokenizer, metrics, max_queue)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="jdspark", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    def authorize(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                           "server was started with (--api-key)", code="invalid_api_key", type="authentication_error")

    async def body_of(request: Request, model: type) -> tuple[protocol.BaseModel, dict]:
        """The validated request and its raw JSON (tool schemas are rendered in the client's key order)."""
        authorize(request)
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        req = protocol.parse(model, body)
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return req, body

    def submit(ids: list[int], params) -> Pending:
        try:
            engine.check_prompt(ids, params)
        except EngineError as e:
            too_long = "max_seq_len" in str(e)
            raise APIError(400, str(e), param=None if too_long else "prompt",
                           code="context_length_exceeded" if too_long else None) from None
        try:
            return scheduler.submit([int(t) for t in ids], params)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", type="rate_limit_error", headers={"Retry-After": "1"}) \
                from None

    async def updates(pending: Pending, request: Request) -> AsyncIterator[Update]:
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
                scheduler.cancel(pending)

    async def collect(pending: Pending, request: Request, sink) -> Update | None:
        """Run a non-streamed request to its end, passing each text delta to `sink`; returns the final
        update, or None if the client left first. An engine failure becomes a 500."""
        u = None
        async for u in updates(pending, request):
            if u.error:
                raise failed(u)
            sink(u.text)
        return u if u is not None and u.final else None

    def envelope(kind: str, rid: str, **fields) -> dict:
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name, **fields}

    def usage(u: Update) -> dict:
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def sse(data) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def failed(u: Update) -> APIError:
        return APIError(500, u.error, code="engine_error")

    def client_gone() -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ---- routes ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "running": len(scheduler.running)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jdspark", "max_model_len": engine.config.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, _ = await body_of(request, CompletionRequest)
        prompt = req.prompt_input()
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        params = req.sampling(COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens)
        pending, rid = submit(ids, params), f"cmpl-{uuid.uuid4().hex}"

        def choice(text: str, finish_reason: str | None) -> dict:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

        if not req.stream:
            text = []
            u = await collect(pending, request, text.append)
            if u is None:
                return client_gone()
            return envelope("text_completion", rid, choices=[choice("".join(text), u.finish_reason)], usage=usage(u))

        async def events():
            async for u in updates(pending, request):
                if u.error:
                    yield sse(failed(u).body())
                    break
                if u.text or u.final:
                    yield sse(envelope("text_completion", rid, choices=[choice(u.text, u.finish_reason)]))
                if u.final and req.stream_options and req.stream_options.include_usage:
                    yield sse(envelope("text_completion", rid, choices=[], usage=usage(u)))
            yield "data: [DONE]\n\n"

        return event_stream(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, body = await body_of(request, ChatCompletionRequest)
        if not req.messages or req.messages[-1].role not in ("user", "tool", "developer"):
            raise APIError(400, "messages must end with a user, developer or tool message (the assistant answers "
                           "it); continuing an assistant message is not supported", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            d = {"role": m.role, "content": m.text(f"messages.{i}"), "reasoning_content": m.reasoning_content,
                 "tool_call_id": m.tool_call_id}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            messages.append(d)
        tools = [t["function"] for t in body["tools"]] if req.tools_enabled else None
        text = chat.encode_messages(messages, thinking=req.thinking, reasoning_effort=req.effort, tools=tools)
        ids = tokenizer.encode(text.removeprefix(chat.BOS))  # the tokenizer adds BOS as its id
        room = engine.config.max_seq_len - engine.config.rollback_rows - len(ids)
        max_tokens = req.requested_max_tokens()
        params = req.sampling(max(room, 1) if max_tokens is None else max_tokens)
        pending, rid = submit(ids, params), f"chatcmpl-{uuid.uuid4().hex}"
        out = chat.ChatOutput(req.thinking, req.tools_enabled)

        def delta_fields(reasoning: str, content: str) -> dict:
            return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}

        def openai_calls(calls: list[dict]) -> list[dict]:
            return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c} for c in calls]

        def finish_reason(u: Update, calls: list) -> str:
            return "tool_calls" if calls else u.finish_reason

        if not req.stream:
            u = await collect(pending, request, out.add)
            if u is None:
                return client_gone()
            parsed = chat.parse_completion(out.text, req.thinking, req.tools_enabled)
            message = {"role": "assistant", "content": parsed["content"] or None if parsed["tool_calls"] else
                       parsed["content"]}
            if req.thinking:
                message["reasoning_content"] = parsed["reasoning_content"]
            if parsed["tool_calls"]:
                message["tool_calls"] = openai_calls(parsed["tool_calls"])
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason(u, parsed["tool_calls"])}
            return envelope("chat.completion", rid, choices=[choice], usage=usage(u))

        def chunk(delta: dict, finish: str | None = None) -> str:
            return sse(envelope("chat.completion.chunk", rid,
                                choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]))

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            async for u in updates(pending, request):
                if u.error:
                    yield sse(failed(u).body())
                    break
                fields = delta_fields(*out.add(u.text))
                if fields:
                    yield chunk(fields)
                if not u.final:
                    continue
                reasoning, content, calls = out.finish()
                if delta_fields(reasoning, content):
                    yield chunk(delta_fields(reasoning, content))
                if calls:
                    yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(openai_calls(calls))]})
                yield chunk({}, finish_reason(u, calls))
                if req.stream_options and req.stream_options.include_usage:
                    yield sse(envelope("chat.completion.chunk", rid, choices=[], usage=usage(u)))
            yield "data: [DONE]\n\n"

        return event_stream(events())

    return app
