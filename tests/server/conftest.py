"""One real server for the session: uvicorn on a free loopback port in a background thread, over
the tiny speculative model (tests/conftest.py) with 8 slots and the character tokenizer. The engine
compiles once (prefill, draft, verify at width 5); every server test shares it."""

import threading
import time

import httpx
import openai
import pytest
import uvicorn

from jdspark.config import EngineConfig
from jdspark.engine.engine import Engine, SpecOptions
from jdspark.server.app import create_app

API_KEY = "test-key"
MODEL = "tiny"
SLOTS, QUEUE = 8, 4


class EngineDouble:
    """The real engine behind the server, whose steps a test can hold or fail: `before_step()`, when
    set, runs at the start of every `step()` (on the engine thread); everything else is the engine's."""

    def __init__(self, engine: Engine):
        self._engine, self.before_step = engine, None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if self.before_step is not None:
            self.before_step()
        return self._engine.step()


class Server:
    def __init__(self, app, engine):
        self.app, self.engine = app, engine
        self.scheduler = app.state.scheduler
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the test server did not start"
            time.sleep(0.02)
        port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self._uvicorn.should_exit = True
        self._thread.join(timeout=30)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (0 if absent), e.g. metric("jdspark:num_requests_running")."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + (("{" + labels + "}") if labels else " ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def idle(self, timeout: float = 10.0) -> None:
        """Wait until no request holds a slot."""
        deadline = time.monotonic() + timeout
        while self.scheduler.running:
            assert time.monotonic() < deadline, f"{len(self.scheduler.running)} request(s) still running"
            time.sleep(0.01)


@pytest.fixture(scope="session")
def server(dspark_model, char_tokenizer):
    # One batch bucket: the API tests do not test buckets (tests/engine/test_buckets.py does), and
    # each bucket is a full set of executables to compile.
    config = EngineConfig(max_seq_len=320, gamma=5, max_batch=SLOTS, batch_buckets=(SLOTS,))
    engine = EngineDouble(Engine(dspark_model, config, prefill_chunk=16, options=SpecOptions(width=5), widths=(5,),
                                 tokenizer=char_tokenizer))
    s = Server(create_app(engine, char_tokenizer, MODEL, api_key=API_KEY, max_queue=QUEUE), engine)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
