"""The edge without a server: body size, JSON decoding limits, and the strict request models."""

import asyncio

import pytest
from starlette.requests import Request

from jdspark.server import protocol, validation
from jdspark.server.errors import APIError
from jdspark.server.protocol import ChatCompletionRequest, CompletionRequest


def refused(f, *args) -> APIError:
    with pytest.raises(APIError) as e:
        f(*args)
    return e.value


def request(chunks: list[bytes], content_length: int | None = None) -> Request:
    headers = [] if content_length is None else [(b"content-length", str(content_length).encode())]
    messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def test_body_limit_from_the_header_and_while_streaming():
    assert asyncio.run(validation.read_body(request([b"ab", b"cd"]), limit=4)) == b"abcd"
    for r in (request([b"abcde"], content_length=5), request([b"abc", b"de"])):  # declared, or counted
        with pytest.raises(APIError) as e:
            asyncio.run(validation.read_body(r, limit=4))
        assert (e.value.status, e.value.code) == (413, "request_too_large")


def test_json_limits():
    assert validation.decode_json(b'{"a": [1, "\\ud83d\\ude00"]}') == {"a": [1, "\U0001F600"]}  # a proper pair
    assert refused(validation.decode_json, b"{").code == "invalid_json"
    assert refused(validation.decode_json, b"\xff").code == "invalid_json"
    assert refused(validation.decode_json, b"[" * 65 + b"]" * 65).code == "json_too_deep"
    assert validation.decode_json(b"[" * 64 + b"]" * 64) is not None
    assert refused(validation.decode_json, b"[" * 10 ** 5).code in ("json_too_deep", "invalid_json")
    e = refused(validation.decode_json, b'{"tools": [{"function": {"name": "\\udc00x"}}]}')
    assert (e.code, e.param) == ("invalid_unicode", "tools.0.function.name")
    e = refused(validation.decode_json, b'{"a": {"b": [0, -Infinity]}}')
    assert (e.code, e.param) == ("finite_number", "a.b.1")


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"), ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "top_k": 2 ** 31}, "top_k"), ({"prompt": "a", "stream": 0}, "stream"),
    ({"prompt": "a", "n": 2}, "n"), ({"prompt": [1, True]}, "prompt.1"), ({"prompt": "a", "wat": 1}, "wat"),
    ({"prompt": "a", "stop": ["s"] * 17}, "stop"),
])
def test_completion_request_is_strict(body, param):
    assert refused(protocol.parse, CompletionRequest, body).param == param


def test_chat_request_is_strict_and_max_completion_tokens_named():
    user = [{"role": "user", "content": "hi"}]
    assert refused(protocol.parse, ChatCompletionRequest, {"messages": user, "max_completion_tokens": "5"}).param == \
        "max_completion_tokens"
    req = protocol.parse(ChatCompletionRequest, {"messages": user, "max_completion_tokens": 5})
    assert req.requested_max_tokens() == 5 and req.max_tokens_field == "max_completion_tokens"
    both = protocol.parse(ChatCompletionRequest, {"messages": user, "max_completion_tokens": 5, "max_tokens": 5})
    assert refused(both.requested_max_tokens).param == "max_completion_tokens"
    assert refused(protocol.parse(ChatCompletionRequest, {"messages": [{"role": "user"}]}).messages[0].text,
                   "messages.0").param == "messages.0.content"
    too_many = {"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}] * 129}
    assert refused(protocol.parse, ChatCompletionRequest, too_many).param == "tools"


def test_sampling_clamps_top_k_to_off_past_the_vocabulary():
    req = protocol.parse(CompletionRequest, {"prompt": "a", "top_k": 2 ** 31 - 1})
    assert req.sampling(4, vocab_size=16).top_k == 0
    assert protocol.parse(CompletionRequest, {"prompt": "a", "top_k": 5}).sampling(4, vocab_size=16).top_k == 5
