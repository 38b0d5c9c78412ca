"""`POST /v1/chat/completions`: DSV4 chat encoding in, reasoning / content / tool calls out.

The prompt is built by `chat.prompt_pieces` and tokenized with `Tokenizer.encode_pieces`: the
template's control tokens become their ids, every text the client sent is plain text, so a role
marker written inside a message cannot open a turn. Without max_tokens a request may generate
what the context has room for (`Engine.room`).
"""

from __future__ import annotations

import dataclasses
import uuid

from starlette.requests import Request

from jdspark.engine.request import SamplingParams
from jdspark.server import chat, responses
from jdspark.server.errors import APIError, engine_failed
from jdspark.server.protocol import ChatCompletionRequest
from jdspark.server.serving import Serving, client_gone, event_stream


@dataclasses.dataclass
class Prepared:
    req: ChatCompletionRequest
    ids: list[int]
    params: SamplingParams


def messages_of(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the dicts `chat.prompt_pieces` reads."""
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
    return messages


def prompt_ids(serving: Serving, req: ChatCompletionRequest, body: dict) -> list[int]:
    tools = [t["function"] for t in body["tools"]] if req.tools_enabled else None
    pieces = chat.prompt_pieces(messages_of(req), thinking=req.thinking, reasoning_effort=req.effort, tools=tools)
    if pieces and pieces[0] == (chat.BOS, True):
        pieces = pieces[1:]  # the tokenizer adds BOS as its id
    return serving.tokenizer.encode_pieces(pieces)


def prepare(serving: Serving, raw: bytes) -> Prepared:
    """Parse, encode, tokenize and check one request (a worker thread)."""
    req, body = serving.parse(raw, ChatCompletionRequest)
    max_tokens = req.requested_max_tokens()
    ids = prompt_ids(serving, req, body)
    renames = {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else None
    params = req.sampling(max(serving.engine.room(len(ids)), 1) if max_tokens is None else max_tokens,
                          serving.vocab_size, renames)
    ids = serving.check(ids, params, "messages", req.max_tokens_field)
    return Prepared(req, ids, params)


async def create(serving: Serving, request: Request):
    p = await serving.prepare(request, lambda raw: prepare(serving, raw))
    pending, rid, model = serving.submit(p.ids, p.params), f"chatcmpl-{uuid.uuid4().hex}", serving.model_name
    out = chat.ChatOutput(p.req.thinking, p.req.tools_enabled)
    if not p.req.stream:
        u = await serving.collect(pending, request, out.add)
        if u is None:
            return client_gone()
        parsed = chat.parse_completion(out.text, p.req.thinking, p.req.tools_enabled)
        return responses.chat_completion(rid, model, parsed, p.req.thinking, u.finish_reason,
                                         responses.usage(u.prompt_tokens, u.completion_tokens))

    async def events():
        yield responses.chat_chunk(rid, model, {"role": "assistant", "content": ""})
        async for u in serving.updates(pending, request):
            if u.error:
                yield responses.sse_error(engine_failed(u.error))
                break
            fields = responses.delta_fields(*out.add(u.text))
            if fields:
                yield responses.chat_chunk(rid, model, fields)
            if not u.final:
                continue
            for chunk in responses.chat_final_chunks(rid, model, out.finish(), u.finish_reason):
                yield chunk
            if p.req.include_usage:
                yield responses.chat_usage_chunk(rid, model, responses.usage(u.prompt_tokens, u.completion_tokens))
        yield responses.DONE

    return event_stream(events())
