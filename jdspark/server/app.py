"""The FastAPI application: OpenAI routes over one `Scheduler`, wired here and written elsewhere.

- `completions` and `chat_completions` serve the two generation endpoints, `responses` assembles
  their bodies and SSE chunks, `serving` holds what they share (body limits, the worker thread
  that parses and tokenizes, the request's updates), `protocol` validates, `errors` maps every
  failure to an OpenAI error object and an HTTP status.
- With `--api-key`, every `/v1` route needs `Authorization: Bearer <key>` and the OpenAPI pages
  (`/docs`, `/redoc`, `/openapi.json`) are off. `/health` and `/metrics` stay open (as vLLM's do):
  they are for load balancers and Prometheus, and carry no request content.
- A 5xx never carries an exception's text; the traceback goes to the log.
"""

from __future__ import annotations

import contextlib

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jdspark.engine.engine import Engine
from jdspark.server import chat_completions, completions, responses, validation
from jdspark.server.errors import APIError, clip, internal
from jdspark.server.metrics import Metrics
from jdspark.server.scheduler import Scheduler
from jdspark.server.serving import Serving
from jdspark.tokenizer.tokenizer import Tokenizer


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, *, api_key: str | None = None,
               max_queue: int = 64, max_body_bytes: int = validation.MAX_BODY_BYTES) -> FastAPI:
    """The server for one compiled engine. The engine thread starts with the app and stops with it."""
    metrics = Metrics(engine.config.gamma)
    serving = Serving(engine, tokenizer, Scheduler(engine, metrics, max_queue), model_name, api_key, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # build the plain-text encoder now, not in the first request
        await anyio.to_thread.run_sync(lambda: tokenizer.encode_pieces([("", True), ("", False)]))
        serving.scheduler.start()
        yield
        serving.scheduler.close()

    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="jdspark", lifespan=lifespan, **docs)
    app.state.scheduler, app.state.metrics, app.state.serving = serving.scheduler, metrics, serving
    add_error_handlers(app)
    add_routes(app, serving, metrics)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, clip(str(e.detail), 200)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        error = internal(e)
        return JSONResponse(error.body(), status_code=error.status)


def add_routes(app: FastAPI, serving: Serving, metrics: Metrics) -> None:
    def card() -> dict:
        return responses.model_card(serving.model_name, serving.created, serving.engine.config.max_seq_len)

    @app.get("/health")
    async def health():
        # speculative: drafting and verifying now (False while the step executables build: defer_steps)
        return {"status": "ok", "running": len(serving.scheduler.running), "speculative": serving.engine.speculative}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        serving.authorize(request)
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        serving.authorize(request)
        if model_id != serving.model_name:
            raise APIError(404, f"model {clip(model_id, 64)!r} does not exist; this server serves "
                           f"{serving.model_name!r}", param="model", code="model_not_found")
        return card()

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        return await completions.create(serving, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await chat_completions.create(serving, request)
