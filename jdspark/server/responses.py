"""Response assembly: the JSON bodies and SSE chunks of both endpoints, as plain functions of what
the engine produced (no HTTP here). `rid` is the response id, `model` the served model's name.

- A completion's finish_reason is the engine's ("stop": EOS, a stop token or a stop string;
  "length": max_tokens); a chat answer that ends in well-formed tool calls finishes "tool_calls".
- Usage is exact: the prompt's tokens and the tokens generated.
- Streams are `data: <json>\\n\\n` events ending in `data: [DONE]`; an error inside a stream is an
  error object as one event.
"""

from __future__ import annotations

import json
import time
import uuid

from jdspark.server.errors import APIError

DONE = "data: [DONE]\n\n"


def envelope(kind: str, rid: str, model: str, **fields) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, **fields}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_error(error: APIError) -> str:
    return sse(error.body())


# ---- /v1/completions ---------------------------------------------------------------------------
def completion_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def completion(rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return envelope("text_completion", rid, model, choices=[completion_choice(text, finish_reason)], usage=use)


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None) -> str:
    return sse(envelope("text_completion", rid, model, choices=[completion_choice(text, finish_reason)]))


def completion_usage_chunk(rid: str, model: str, use: dict) -> str:
    return sse(envelope("text_completion", rid, model, choices=[], usage=use))


# ---- /v1/chat/completions ----------------------------------------------------------------------
def chat_finish_reason(engine_reason: str, calls: list) -> str:
    """The engine's finish reason, or "tool_calls" when the answer ends in tool calls."""
    return "tool_calls" if calls else engine_reason


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed DSML calls ({"name", "arguments"}) as OpenAI tool calls, each with a fresh id."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c} for c in calls]


def chat_message(parsed: dict, thinking: bool) -> dict:
    """The assistant message of a parsed completion (`chat.parse_completion`): content is null
    when the answer is only tool calls; reasoning_content only in thinking mode."""
    calls = parsed["tool_calls"]
    message = {"role": "assistant", "content": (parsed["content"] or None) if calls else parsed["content"]}
    if thinking:
        message["reasoning_content"] = parsed["reasoning_content"]
    if calls:
        message["tool_calls"] = openai_tool_calls(calls)
    return message


def chat_completion(rid: str, model: str, parsed: dict, thinking: bool, engine_reason: str, use: dict) -> dict:
    choice = {"index": 0, "message": chat_message(parsed, thinking), "logprobs": None,
              "finish_reason": chat_finish_reason(engine_reason, parsed["tool_calls"])}
    return envelope("chat.completion", rid, model, choices=[choice], usage=use)


def delta_fields(reasoning: str, content: str) -> dict:
    """A streamed delta's text fields, each only when it has text."""
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {})}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None) -> str:
    return sse(envelope("chat.completion.chunk", rid, model,
                        choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]))


def chat_usage_chunk(rid: str, model: str, use: dict) -> str:
    return sse(envelope("chat.completion.chunk", rid, model, choices=[], usage=use))


def chat_final_chunks(rid: str, model: str, rest: tuple[str, str, list[dict]], engine_reason: str) -> list[str]:
    """The chunks that end a chat stream: the held-back text, the tool calls, the finish reason.
    `rest` is what `ChatOutput.finish` returns (reasoning, content, calls)."""
    reasoning, content, calls = rest
    out = []
    if delta_fields(reasoning, content):
        out.append(chat_chunk(rid, model, delta_fields(reasoning, content)))
    if calls:
        out.append(chat_chunk(rid, model, {"tool_calls": [{"index": i, **c}
                                                          for i, c in enumerate(openai_tool_calls(calls))]}))
    out.append(chat_chunk(rid, model, {}, chat_finish_reason(engine_reason, calls)))
    return out


def model_card(model: str, created: int, max_model_len: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "jdspark", "max_model_len": max_model_len}
