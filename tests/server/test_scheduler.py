"""Continuous batching under load: concurrent greedy streams equal one-at-a-time results, a client
that disconnects frees its slot, a full queue answers 429 + Retry-After, and an engine failure fails
only the requests it was running while the server keeps serving (without recompiling), and serving
starts with start-up's objects frozen out of the garbage collector."""

import contextlib
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, QUEUE, SLOTS

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@contextlib.contextmanager
def paused(engine, free_steps: int = 0):
    """Hold the engine thread inside its next step, after `free_steps` more, until the block ends
    (requests pile up). A prompt's first token comes from the step that reads its prefill call (the
    one after the step that issued it), so a test that wants it first lets two steps through."""
    gate, calls = threading.Event(), iter(range(free_steps))

    def hold():
        if next(calls, None) is None and not gate.wait(60):
            raise TimeoutError("the held step was never released: a test waited on the engine it held")
    engine.before_step = hold
    try:
        yield gate
    finally:
        gate.set()
        engine.before_step = None


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def stream_text(client, prompt, **kw) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def in_threads(fn, args_list):
    results = [None] * len(args_list)

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # surfaced by the caller's asserts
            results[i] = e
    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    return threads, results


def test_concurrent_greedy_streams_equal_one_at_a_time(server, client):
    prompts = ["a", "bcd", "mnmnmn", "hello", "abcdefghijklmn", "nmlk", "gg", "fedcba"]
    lengths = [24, 17, 30, 9, 21, 28, 12, 25]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, **GREEDY).choices[0].text
             for p, n in zip(prompts, lengths)]
    with paused(server.engine):  # all 8 queue up, then run batched, joining between steps
        threads, together = in_threads(lambda p, n: stream_text(client, p, max_tokens=n, **GREEDY),
                                       list(zip(prompts, lengths)))
        wait_for(lambda: len(server.scheduler.running) + server.scheduler.waiting == SLOTS)
    for t in threads:
        t.join(60)
    assert together == alone


def test_disconnect_mid_stream_frees_the_slot(server):
    aborted = server.metric("jdspark:request_success_total", 'finished_reason="abort"')
    generated = server.metric("jdspark:generation_tokens_total")
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 120, "stream": True, "temperature": 0, "ignore_eos": True}
    # the step that prefills "abc", then (overlapped) the one that reads its call and streams its first token
    with paused(server.engine, free_steps=2):
        with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ") and '"text"' in first
        wait_for(lambda: all(p.cancelled for p in server.scheduler.running))  # the server noticed
    server.idle()
    assert server.metric("jdspark:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert server.metric("jdspark:generation_tokens_total") - generated < 120
    assert server.metric("jdspark:num_requests_running") == 0


def test_full_queue_answers_429_with_retry_after(server, client):
    with paused(server.engine):
        threads, results = in_threads(lambda p: stream_text(client, p, max_tokens=5, **GREEDY),
                                      [("abc",)] * (SLOTS + QUEUE))
        wait_for(lambda: len(server.scheduler.running) + server.scheduler.waiting == SLOTS + QUEUE)
        with server.http() as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 5})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join(60)
    assert all(isinstance(x, str) and x == results[0] for x in results)
    server.idle()


def test_a_disconnected_queued_request_leaves_the_queue_at_once(server, client):
    """Clients that give up while queued free their queue places while the engine is still held (the
    handler polls its connection every 0.5 s; no engine step is needed): the waiting gauge drops back
    and as many new requests queue again, with no 429. No wall-time bound beyond wait_for's 5 s, which
    a loaded CI machine cannot trip the way a 1 s bound could."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0}
    with paused(server.engine):
        running, _ = in_threads(lambda p: stream_text(client, p, max_tokens=5, **GREEDY), [("abc",)] * SLOTS)
        wait_for(lambda: len(server.scheduler.running) + server.scheduler.waiting == SLOTS)
        before = server.scheduler.waiting  # the ones the paused engine thread has not admitted yet
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.3) as http:
            for _ in range(QUEUE):
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json=body)
        wait_for(lambda: server.scheduler.waiting == before, timeout=5.0)
        assert server.metric("jdspark:num_requests_waiting") == before
        queued, results = in_threads(lambda p: stream_text(client, p, max_tokens=5, **GREEDY), [("abc",)] * QUEUE)
        wait_for(lambda: server.scheduler.waiting == before + QUEUE)
    for t in running + queued:
        t.join(60)
    assert all(isinstance(r, str) for r in results)
    server.idle()


def test_engine_failure_fails_running_requests_and_server_recovers(server, client, compile_counter):
    expected = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, **GREEDY).choices[0].text
    failures = iter([RuntimeError("device on fire")])

    def fail_once():
        failure = next(failures, None)
        if failure is not None:
            raise failure
    server.engine.before_step = fail_once
    try:
        with pytest.raises(openai.InternalServerError, match="the engine failed while running this request") as e:
            client.completions.create(model=MODEL, prompt="abc", max_tokens=10, **GREEDY)
        assert "device on fire" not in str(e.value)  # the detail goes to the log, not to the client
        failures = iter([RuntimeError("device on fire again")])
        with server.http() as http:
            lines = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 10,
                                                       "stream": True, "temperature": 0}).text.splitlines()
        assert any('"error"' in line and "the engine failed" in line for line in lines)
        assert not any("device on fire" in line for line in lines)
        assert lines[-2] == "data: [DONE]"
    finally:
        server.engine.before_step = None
    before = compile_counter.count  # the reset state has the compiled shapes: nothing recompiles
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=10, **GREEDY).choices[0].text == expected
    assert compile_counter.count == before
    server.idle()
    assert server.metric("jdspark:request_success_total", 'finished_reason="error"') == 2
    assert server.metric("jdspark:num_requests_running") == 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "running": 0,
                                                         "speculative": server.engine.speculative}


def test_serving_starts_with_start_ups_objects_frozen_out_of_the_collector(server, monkeypatch):
    """`Scheduler.start` collects, then freezes what is left (`gc.freeze`), before the engine thread
    runs: a full collection over the start-up's objects would stall the step it fell in."""
    import gc
    import types

    from jdspark.server.metrics import Metrics
    from jdspark.server.scheduler import Scheduler
    scheduler = Scheduler(server.engine, Metrics(server.engine.config.gamma), QUEUE)
    monkeypatch.setattr(scheduler, "_thread", types.SimpleNamespace(start=lambda: None))  # no second engine thread
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    scheduler.start()
    assert gc.get_freeze_count() > 0


def test_an_idle_engine_thread_takes_the_step_executables_once_built(monkeypatch):
    """While the step executables build (`Engine(defer_steps=True)`), an idle engine thread calls
    `engine.poll` every BUILD_POLL_S, so speculation comes online before any request; once `poll` says
    the build was taken, the thread sleeps until there is work."""
    import types

    from jdspark.server import scheduler
    from jdspark.server.metrics import Metrics
    monkeypatch.setattr(scheduler, "BUILD_POLL_S", 0.01)
    polls = []

    class Building:  # an engine whose build is taken at its fifth poll
        tokenizer, config = object(), types.SimpleNamespace(max_batch=1, gamma=5)

        def poll(self, queued=False):
            polls.append(time.monotonic())
            return len(polls) < 5

    serving = scheduler.Scheduler(Building(), Metrics(5), QUEUE)
    serving.start()
    try:
        wait_for(lambda: len(polls) >= 5)
        time.sleep(0.2)
        assert len(polls) == 5
    finally:
        serving.close()


def test_the_engine_thread_outlives_a_failure_taking_the_step_executables(monkeypatch):
    """An exception out of `engine.poll` is logged; the engine thread lives on (it serves every request)."""
    import types

    from jdspark.server import scheduler
    from jdspark.server.metrics import Metrics
    polls = []

    class Failing:
        tokenizer, config = object(), types.SimpleNamespace(max_batch=1, gamma=5)

        def poll(self, queued=False):
            polls.append(1)
            raise RuntimeError("failed on purpose")

    serving = scheduler.Scheduler(Failing(), Metrics(5), QUEUE)
    serving.start()
    try:
        wait_for(lambda: polls)
        time.sleep(0.1)
        assert serving._thread.is_alive()
    finally:
        serving.close()


def test_requests_waiting_to_be_admitted_keep_the_engine_from_looking_idle():
    """The engine thread tells `engine.poll` whether requests wait in its queue: with one slot and two
    requests one always waits, so a build whose take measures costs is not taken as if at idle (the
    measurement would hold the waiting request). Mutation caught: polling with queued=False."""
    import asyncio
    import types

    from jdspark.engine.request import SamplingParams
    from jdspark.server import scheduler
    from jdspark.server.metrics import Metrics
    queued_at = []

    class Busy:  # one slot; its request never ends
        tokenizer, config, last_step = object(), types.SimpleNamespace(max_batch=1, gamma=5), None

        def poll(self, queued=False):
            queued_at.append(queued)
            return True

        def admit(self, requests):
            return list(range(len(requests)))

        def step(self):
            time.sleep(0.005)
            return {}

        def reset(self):  # the shutdown fails what runs
            pass

    serving = scheduler.Scheduler(Busy(), Metrics(5), QUEUE)

    async def submit_two():
        for _ in range(2):
            serving.submit([1, 2], SamplingParams(max_tokens=4))
    asyncio.run(submit_two())
    serving.start()
    try:
        wait_for(lambda: len(queued_at) >= 3)
    finally:
        serving.close()
    assert all(queued_at)
