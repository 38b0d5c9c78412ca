"""The HTTP API through the official `openai` client and raw httpx: completions and chat, streamed
and not, exact usage, stop strings, seeds, token-id prompts, every bad-input case (an OpenAI error
object naming the field), API keys, /v1/models, /health, /metrics, and no compilation when warm."""

import httpx
import pytest

from jdspark.server.chat import BOS, encode_messages
from tests.server.conftest import API_KEY, MODEL

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def complete(client, prompt, stream=False, **kw):
    """(text, finish_reason, usage) of one completion, streamed (with include_usage) or not."""
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    text, finish, usage = "", None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    return text, finish, usage


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    server.idle()
    speculative = server.engine.speculative
    try:  # /health says whether the engine speculates now (not yet, while `defer_steps` builds)
        for value in (False, True):
            server.engine.set_policy(speculative=value)
            assert httpx.get(server.url + "/health").json()["speculative"] is value
    finally:
        server.engine.set_policy(speculative=speculative)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_usage_is_exact_and_stream_matches(client, char_tokenizer, stream):
    text, finish, usage = complete(client, "abcd", stream, max_tokens=12, **GREEDY)
    plain, _, _ = complete(client, "abcd", False, max_tokens=12, **GREEDY)
    assert finish == "length" and text == plain
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 12, 17)  # BOS + 4


def test_token_id_prompt_equals_text_prompt(client, char_tokenizer):
    ids = char_tokenizer.encode("abcd")
    assert complete(client, ids, max_tokens=8, **GREEDY)[0] == complete(client, "abcd", max_tokens=8, **GREEDY)[0]


def test_seed_reproduces_and_stop_string_ends_text(client):
    sampled = dict(temperature=1.0, max_tokens=30, extra_body={"ignore_eos": True})
    free = complete(client, "abc", seed=3, **sampled)[0]
    assert complete(client, "abc", True, seed=3, **sampled)[0] == free
    assert len({complete(client, "abc", seed=s, **sampled)[0] for s in (4, 5, 6)} | {free}) > 1
    stop = free[10:12]
    for stream in (False, True):
        text, finish, usage = complete(client, "abc", stream, seed=3, stop=[stop], **sampled)
        assert (text, finish) == (free[:free.find(stop)], "stop") and usage.completion_tokens < 30


def test_chat_usage_stream_and_thinking(client, char_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    prompt = encode_messages(messages)
    assert r.usage.prompt_tokens == len(char_tokenizer.encode(prompt.removeprefix(BOS)))
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].message.content) == 10
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, stream=True, **GREEDY) if c.choices)
    assert streamed == r.choices[0].message.content
    # thinking mode: the tiny vocabulary never writes </think>, so everything is reasoning
    thinking = {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body=thinking)
    assert r.choices[0].message.content == "" and len(r.choices[0].message.reasoning_content) == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body=thinking))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == \
        r.choices[0].message.reasoning_content


def test_chat_tool_results_are_accepted(client):
    """(Tool schemas would not fit this server's context; their layout is tested in test_chat.py.)"""
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "a"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


COMPLETION = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (path, body, status, param or code)
    ("completions", b"{not json", 400, "invalid_json"),
    ("completions", [1, 2], 400, None),
    ("completions", {**COMPLETION, "model": "gpt-4"}, 404, "model"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {**COMPLETION, "n": 2}, 400, "n"),
    ("completions", {**COMPLETION, "best_of": 3}, 400, "best_of"),
    ("completions", {**COMPLETION, "logprobs": 2}, 400, "logprobs"),
    ("completions", {**COMPLETION, "echo": True}, 400, "echo"),
    ("completions", {**COMPLETION, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("completions", {**COMPLETION, "bogus": 1}, 400, "bogus"),
    ("completions", {**COMPLETION, "temperature": -1}, 400, "temperature"),
    ("completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("completions", {**COMPLETION, "top_k": -1}, 400, "top_k"),
    ("completions", {**COMPLETION, "seed": -5}, 400, "seed"),
    ("completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "stop": [""]}, 400, "stop"),
    ("completions", {**COMPLETION, "max_tokens": 1000}, 400, "context_length_exceeded"),
    ("completions", {**COMPLETION, "prompt": [0, 99]}, 400, "prompt"),
    ("completions", {**COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 4}, 400, "max_completion_tokens"),
    ("chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {**CHAT, "reasoning_effort": "low"}, 400, "reasoning_effort"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
]


def test_bad_requests_get_openai_errors_naming_the_field(server):
    with server.http() as http:
        for path, body, status, name in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = http.post(f"/v1/{path}", **kw)
            error = r.json()["error"]
            assert r.status_code == status and name in (error["param"], error["code"]), (path, body, r.text)
            assert error["message"] and error["type"] == "invalid_request_error"
        assert http.post("/v1/nothing", json={}).status_code == 404
        ok = http.post("/v1/completions", json={**COMPLETION, "temperature": 0, "n": 1, "logprobs": None})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_metrics_and_no_compilation_when_warm(server, client, compile_counter):
    complete(client, "abc", max_tokens=6, **GREEDY)  # warm: every executable has run
    before = compile_counter.count
    for prompt, n, stream in (("a", 3, False), ("abcdefghijklmnabcdefghijklmn", 20, True), ("mn", 40, False)):
        complete(client, prompt, stream, max_tokens=n, **GREEDY)
    assert compile_counter.count == before
    server.idle()
    assert server.metric("jdspark:num_requests_running") == 0
    assert server.metric("jdspark:request_success_total", 'finished_reason="length"') >= 3
    assert server.metric("jdspark:generation_tokens_total") >= 63
    drafted = server.metric("jdspark:spec_decode_num_draft_tokens_total")
    accepted = server.metric("jdspark:spec_decode_num_accepted_tokens_total")
    per_pos = [server.metric("jdspark:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
               for i in range(5)]
    assert drafted == 5 * server.metric("jdspark:spec_decode_num_drafts_total") > 0
    assert 0 <= accepted == sum(per_pos) <= drafted and per_pos == sorted(per_pos, reverse=True)
    assert server.metric("jdspark:time_to_first_token_seconds_count") >= 4
