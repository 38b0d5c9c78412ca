"""`POST /v1/completions`: one prompt (text or token ids), streamed or not.

A text prompt is plain text unless the request sets `allow_special_tokens` (then control-token
strings in it become their ids); token ids are taken as they are.
"""

from __future__ import annotations

import dataclasses
import uuid

from starlette.requests import Request

from jdspark.engine.request import SamplingParams
from jdspark.server import responses
from jdspark.server.errors import engine_failed
from jdspark.server.protocol import CompletionRequest
from jdspark.server.serving import Serving, client_gone, event_stream

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class Prepared:
    req: CompletionRequest
    ids: list[int]
    params: SamplingParams


def prepare(serving: Serving, raw: bytes) -> Prepared:
    """Parse, tokenize and check one request (a worker thread)."""
    req, _ = serving.parse(raw, CompletionRequest)
    prompt = req.prompt_input()
    ids = serving.tokenizer.encode(prompt, special_tokens=req.allow_special_tokens) if isinstance(prompt, str) \
        else prompt
    params = req.sampling(DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens, serving.vocab_size)
    ids = serving.check(ids, params, "prompt", "max_tokens" if req.max_tokens is not None else None)
    return Prepared(req, ids, params)


async def create(serving: Serving, request: Request):
    p = await serving.prepare(request, lambda raw: prepare(serving, raw))
    pending, rid, model = serving.submit(p.ids, p.params), f"cmpl-{uuid.uuid4().hex}", serving.model_name
    if not p.req.stream:
        text: list[str] = []
        u = await serving.collect(pending, request, text.append)
        if u is None:
            return client_gone()
        return responses.completion(rid, model, "".join(text), u.finish_reason,
                                    responses.usage(u.prompt_tokens, u.completion_tokens))

    async def events():
        async for u in serving.updates(pending, request):
            if u.error:
                yield responses.sse_error(engine_failed(u.error))
                break
            if u.text or u.final:
                yield responses.completion_chunk(rid, model, u.text, u.finish_reason)
            if u.final and p.req.include_usage:
                yield responses.completion_usage_chunk(rid, model, responses.usage(u.prompt_tokens,
                                                                                   u.completion_tokens))
        yield responses.DONE

    return event_stream(events())
