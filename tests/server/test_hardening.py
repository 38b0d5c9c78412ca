"""Issue 27 at the HTTP edge: strict types and bounds (a 400 whose `param` names the field), body
size (413) and JSON depth limits, invalid Unicode, stop-string and tool limits, the model endpoint,
no internals in 5xx bodies, the OpenAPI pages behind the key, plain-text prompts, and /health
answering while a prompt is tokenized; a huge body refused from its Content-Length, unread."""

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL

COMPLETION = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
STRICT = [  # (path, body, param): each a 400 naming param; OpenAI's API rejects them too
    ("completions", {**COMPLETION, "max_tokens": "5"}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": True}, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": 5.0}, "max_tokens"),
    ("completions", {**COMPLETION, "temperature": "0.5"}, "temperature"),
    ("completions", {**COMPLETION, "temperature": True}, "temperature"),
    ("completions", {**COMPLETION, "temperature": 2.5}, "temperature"),
    ("completions", {**COMPLETION, "top_p": True}, "top_p"),
    ("completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("completions", {**COMPLETION, "top_k": True}, "top_k"),
    ("completions", {**COMPLETION, "top_k": 2 ** 31}, "top_k"),
    ("completions", {**COMPLETION, "top_k": 2 ** 70}, "top_k"),
    ("completions", {**COMPLETION, "seed": "1"}, "seed"),
    ("completions", {**COMPLETION, "seed": 2 ** 32}, "seed"),
    ("completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("completions", {**COMPLETION, "stream": 1}, "stream"),
    ("completions", {**COMPLETION, "stream": 0}, "stream"),
    ("completions", {**COMPLETION, "n": "1"}, "n"),
    ("completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("completions", {**COMPLETION, "prompt": [True, False]}, "prompt.0"),
    ("completions", {**COMPLETION, "prompt": [2 ** 40]}, "prompt.0"),
    ("completions", {**COMPLETION, "prompt": 5}, "prompt"),
    ("completions", {**COMPLETION, "ignore_eos": "true"}, "ignore_eos"),
    ("completions", {**COMPLETION, "stop": ["x"] * 17}, "stop"),
    ("completions", {**COMPLETION, "stop": "x" * 257}, "stop"),
    ("completions", {**COMPLETION, "stop": ["ab", "x" * 257]}, "stop.1"),
    ("completions", {**COMPLETION, "user": "u" * 10 ** 5}, "user"),
    ("completions", {**COMPLETION, "max_tokens": 2 ** 31}, "max_tokens"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("chat/completions", {**CHAT, "messages": [{"role": "system"}, {"role": "user", "content": "x"}]},
     "messages.0.content"),
    ("chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": "5"}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "max_tokens": None, "max_completion_tokens": 10 ** 6}, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "tools": [TOOL] * 129}, "tools"),
    ("chat/completions", {**CHAT, "tools": [{**TOOL, "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
]
RAW = [  # (path, raw body, param or code)
    ("completions", b'{"model": "tiny", "prompt": "abc", "temperature": Infinity}', "temperature"),
    ("completions", b'{"model": "tiny", "prompt": "abc", "temperature": NaN}', "temperature"),
    ("completions", b'{"model": "tiny", "prompt": "abc", "temperature": 1e999}', "temperature"),
    ("completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("completions", b'{"model": "tiny", "prompt": "a\\udc00\\ud800b"}', "prompt"),
    ("completions", b'{"model": "tiny", "prompt": "a\xed\xa0\x80b"}', "prompt"),  # a surrogate as UTF-8
    ("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     b'"function", "function": {"name": "f\\udfff"}}]}', "tools.0.function.name"),
    ("completions", b"[" * 1000 + b"]" * 1000, "json_too_deep"),
    ("completions", b"[" * 100_000 + b"]" * 100_000, "json_too_deep"),
    ("completions", b'{"model": "tiny", "prompt": "abc", "x": ' + b'{"a": ' * 70 + b"1" + b"}" * 70 + b"}",
     "json_too_deep"),
]


def post(http, path, body):
    return http.post(f"/v1/{path}", **({"content": body} if isinstance(body, bytes) else {"json": body}))


@pytest.mark.parametrize("path,body,param", STRICT + RAW)
def test_types_and_bounds_get_a_400_naming_the_field(server, path, body, param):
    with server.http() as http:
        r = post(http, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and param in (error["param"], error["code"]), r.text[:300]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_a_huge_body_is_refused_from_its_content_length_unread(server):
    """A request that declares 16 MiB gets its 413 before a byte of its body is sent: the server
    refuses it from Content-Length and reads nothing. Mutation caught: reading the body first (the
    response would never come; the socket times out)."""
    url = urlsplit(server.url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {16 * 2 ** 20}\r\n\r\n")
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"request_too_large" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]


def test_tokenizing_a_prompt_does_not_block_health(server, monkeypatch):
    """A chat prompt is tokenized in a worker thread: while its tokenization is held (until /health
    has answered), /health answers. Mutation caught: tokenizing on the event loop (/health would
    wait behind the held tokenization and time out). No wall-time threshold."""
    serving = server.app.state.serving
    entered, answered = threading.Event(), threading.Event()
    encode_pieces = serving.tokenizer.encode_pieces

    def held(*args, **kwargs):
        entered.set()
        answered.wait(timeout=30)
        return encode_pieces(*args, **kwargs)
    monkeypatch.setattr(serving.tokenizer, "encode_pieces", held)
    with ThreadPoolExecutor(1) as pool, server.http() as http, \
            httpx.Client(base_url=server.url, timeout=5) as health:
        chat = pool.submit(http.post, "/v1/chat/completions", json=CHAT)
        assert entered.wait(timeout=30)
        try:
            assert health.get("/health").status_code == 200
        finally:
            answered.set()
        assert chat.result(timeout=60).status_code == 200


def test_a_long_prompt_is_tokenized_then_refused_as_too_long(server):
    """A 500k-character chat prompt is tokenized (seconds of CPU), then refused, naming its length."""
    long = {**CHAT, "messages": [{"role": "user", "content": "abcdefgh" * 62_500}]}
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "prompt (5000" in r.text, r.text


def test_models_retrieve_and_unknown_model_is_not_echoed(server, client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    huge = "m" * 2 ** 20
    with server.http() as http:
        for r in (http.post("/v1/completions", json={**COMPLETION, "model": huge}), http.get(f"/v1/models/{huge[:4000]}")):
            assert r.status_code == 404 and len(r.text) < 400 and r.json()["error"]["code"] == "model_not_found"


def test_docs_are_off_with_an_api_key_and_health_metrics_stay_open(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 404
    assert httpx.get(server.url + "/health").status_code == 200 and httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401 and httpx.get(server.url + f"/v1/models/{MODEL}").status_code == 401


def test_internal_errors_carry_a_generic_message(server, monkeypatch, caplog):
    serving = server.app.state.serving

    def broken(*a, **kw):
        raise RuntimeError("secret detail /etc/passwd")
    monkeypatch.setattr(serving.tokenizer, "encode", broken)
    with server.http() as http:
        r = http.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"
    assert "secret detail" in caplog.text
    monkeypatch.undo()
    with server.http() as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_text_prompts_are_plain_text_unless_special_tokens_are_allowed(server):
    """`<bos>` is the character tokenizer's control token: as plain text it is five characters."""
    with server.http() as http:
        plain = http.post("/v1/completions", json={**COMPLETION, "prompt": "ab<bos>"}).json()
        special = http.post("/v1/completions", json={**COMPLETION, "prompt": "ab<bos>",
                                                      "allow_special_tokens": True}).json()
    assert plain["usage"]["prompt_tokens"] == 1 + 7 and special["usage"]["prompt_tokens"] == 1 + 3


def test_top_k_past_the_vocabulary_is_off_and_runs(server):
    with server.http() as http:
        big = http.post("/v1/completions", json={**COMPLETION, "top_k": 2 ** 31 - 1, "seed": 1, "max_tokens": 6,
                                                 "ignore_eos": True})
        off = http.post("/v1/completions", json={**COMPLETION, "seed": 1, "max_tokens": 6, "ignore_eos": True})
    assert big.status_code == 200 and big.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
