"""Response assembly and error mapping as plain functions (no HTTP): bodies, SSE chunks, usage,
finish reasons, tool-call formatting, and the engine's typed errors as HTTP statuses."""

import json

import pytest

from jdspark.engine.errors import CapacityError, ContextLengthError, EngineError, PromptError, SamplingError
from jdspark.engine.request import SamplingParams
from jdspark.server import responses
from jdspark.server.errors import APIError, clip, field_path, from_engine_error, internal, sampling_error

CALL = {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def events(chunks: list[str]) -> list[dict]:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [json.loads(c[len("data: "):]) for c in chunks]


def test_usage_and_completion_body():
    assert responses.usage(5, 12) == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    body = responses.completion("cmpl-1", "m", "hello", "length", responses.usage(2, 3))
    assert body["id"] == "cmpl-1" and body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 5 and isinstance(body["created"], int)


def test_completion_chunks_are_sse_events():
    chunk, use = events([responses.completion_chunk("r", "m", "ab", None),
                         responses.completion_usage_chunk("r", "m", responses.usage(1, 2))])
    assert chunk["choices"][0]["text"] == "ab" and chunk["choices"][0]["finish_reason"] is None
    assert use["choices"] == [] and use["usage"]["completion_tokens"] == 2
    assert responses.DONE == "data: [DONE]\n\n"
    assert responses.sse({"t": "é"}) == 'data: {"t": "é"}\n\n'  # UTF-8, not \\u escapes


def test_chat_message_content_reasoning_and_tool_calls():
    plain = {"reasoning_content": "", "content": "hi", "tool_calls": []}
    assert responses.chat_message(plain, thinking=False) == {"role": "assistant", "content": "hi"}
    assert responses.chat_message(plain, thinking=True)["reasoning_content"] == ""
    only_calls = responses.chat_message({"reasoning_content": "r", "content": "", "tool_calls": [CALL]}, True)
    assert only_calls["content"] is None and only_calls["reasoning_content"] == "r"
    (call,) = only_calls["tool_calls"]
    assert call["type"] == "function" and call["function"] == CALL and call["id"].startswith("call_")
    assert len(call["id"]) == len("call_") + 24


def test_finish_reason_mapping():
    assert responses.chat_finish_reason("stop", []) == "stop"
    assert responses.chat_finish_reason("length", []) == "length"
    assert responses.chat_finish_reason("stop", [CALL]) == "tool_calls"
    body = responses.chat_completion("c", "m", {"reasoning_content": "", "content": "", "tool_calls": [CALL]},
                                     False, "stop", responses.usage(1, 1))
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_stream_chunks():
    assert responses.delta_fields("", "") == {}
    assert responses.delta_fields("r", "") == {"reasoning_content": "r"}
    assert responses.delta_fields("r", "c") == {"reasoning_content": "r", "content": "c"}
    final = events(responses.chat_final_chunks("c", "m", ("", "tail", [CALL]), "stop"))
    assert [e["object"] for e in final] == ["chat.completion.chunk"] * 3
    assert final[0]["choices"][0]["delta"] == {"content": "tail"}
    (call,) = final[1]["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == CALL
    assert final[2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    (last,) = events(responses.chat_final_chunks("c", "m", ("", "", []), "length"))
    assert last["choices"][0]["finish_reason"] == "length"
    (use,) = events([responses.chat_usage_chunk("c", "m", responses.usage(3, 4))])
    assert use["choices"] == [] and use["usage"]["total_tokens"] == 7


def test_engine_errors_map_to_statuses_by_type():
    e = from_engine_error(ContextLengthError("too long"), "messages", "max_completion_tokens")
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "max_completion_tokens")
    assert from_engine_error(ContextLengthError("x"), "prompt").param == "prompt"
    e = from_engine_error(PromptError("token id 99 is outside"), "prompt")
    assert (e.status, e.param, e.type) == (400, "prompt", "invalid_request_error")
    e = from_engine_error(CapacityError("busy"), "prompt")
    assert (e.status, e.type, e.headers) == (429, "rate_limit_error", {"Retry-After": "1"})
    assert from_engine_error(EngineError("other"), "prompt").status == 400


def test_errors_name_fields_and_hide_internals(caplog):
    assert field_path(("prompt", "list[int]", 0)) == "prompt.0"
    assert field_path(("messages", 1, "content", "str")) == "messages.1.content"
    assert field_path(()) is None
    with pytest.raises(SamplingError) as raised:
        SamplingParams(max_tokens=0)
    e = sampling_error(raised.value, {"max_tokens": "max_completion_tokens"})
    assert e.param == "max_completion_tokens" and e.message.startswith("max_completion_tokens=0")
    assert len(clip("x" * 10 ** 6)) < 120
    e = internal(RuntimeError("secret path /home/x"))
    assert e.status == 500 and "secret" not in json.dumps(e.body()) and e.body()["error"]["type"] == "server_error"
    assert "secret path" in caplog.text


@pytest.mark.parametrize("status,kind", [(400, "invalid_request_error"), (503, "server_error")])
def test_error_body_shape(status, kind):
    assert APIError(status, "m", param="p", code="c").body() == {
        "error": {"message": "m", "type": kind, "param": "p", "code": "c"}}
