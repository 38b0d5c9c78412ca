"""Load test of `jdspark serve`: throughput and latency percentiles at several concurrencies.

    python scripts/bench_serve.py                          # start a server on the embedded model
    python scripts/bench_serve.py --model /ckpt --start subprocess --max-running 16
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --requests 64 --out bench.json

For each concurrency (default 1, 4, 16) it sends `--requests` streamed completions (at most that
many in flight; no new request after `--max-seconds`), each with `ignore_eos` so every request
generates exactly `--max-tokens` tokens, and reports requests/s, output tokens/s and p50/p90/p99 of
time to first token, inter-token latency (gaps between streamed chunks: a chunk is a whole accepted
block under speculation) and end-to-end latency. Loopback only: it refuses any other host.
The engine itself under the same kind of load, per speculation mode (none, fixed k = 5, padded,
per-request and budget widths) and without HTTP: `scripts/bench_serve_engine.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import httpx
import numpy as np

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\n", "class Stack:\n    def __init__(self):",
           "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"", "for i in range(10):", "with open(path) as f:",
           "def parse_args():\n    parser = argparse.ArgumentParser(", "async def fetch(url):"]
LOOPBACK = ("127.0.0.1", "localhost", "::1")


async def one_request(http: httpx.AsyncClient, prompt: str, args) -> dict:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks, tokens = [], 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return {"error": data["error"]["message"]}
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if data.get("choices") and data["choices"][0]["text"]:
                chunks.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": chunks[0] - start if chunks else end - start, "itl": np.diff(chunks).tolist(),
            "e2e": end - start, "tokens": tokens}


async def run_level(url: str, concurrency: int, args) -> dict:
    results, next_index = [], 0
    started = time.perf_counter()
    deadline = started + args.max_seconds

    async def worker(http):
        nonlocal next_index
        while next_index < args.requests and time.perf_counter() < deadline:
            i, next_index = next_index, next_index + 1
            results.append(await one_request(http, PROMPTS[i % len(PROMPTS)], args))

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.max_seconds + 600, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    duration = time.perf_counter() - started
    ok = [r for r in results if "error" not in r]

    def pct(values):
        return {f"p{q}": float(np.percentile(values, q)) if values else None for q in (50, 90, 99)}
    return {"concurrency": concurrency, "requests": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if "error" in r})[:3], "duration_s": duration,
            "requests_per_s": len(ok) / duration, "output_tokens_per_s": sum(r["tokens"] for r in ok) / duration,
            "ttft_s": pct([r["ttft"] for r in ok]), "itl_s": pct([x for r in ok for x in r["itl"]]),
            "e2e_s": pct([r["e2e"] for r in ok])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(args, port: int) -> list[str]:
    out = ["--port", str(port), "--max-running", str(args.max_running or max(args.concurrency)),
           "--max-queue", str(max(args.concurrency)), "--dtype", args.dtype, "--max-seq-len", str(args.max_seq_len)]
    if args.model:
        out += ["--model", args.model]
    if args.api_key:
        out += ["--api-key", args.api_key]
    return out + (["--no-speculative"] if args.no_speculative else [])


def start_in_process(args, port: int):
    """Build the engine here and run uvicorn in a thread; returns a stop function."""
    import uvicorn

    from jdspark.cli import _generator, _model_dir, build_parser
    from jdspark.server.app import create_app
    cli = build_parser().parse_args(["serve", *serve_args(args, port)])
    gen = _generator(cli, max_batch=cli.max_running)
    app = create_app(gen.engine, gen.tokenizer, "bench", api_key=args.api_key, max_queue=cli.max_queue)
    print(f"serving {_model_dir(cli)} in-process on port {port}", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def stop():
        server.should_exit = True
        thread.join(30)
    return stop


def start_subprocess(args, port: int):
    proc = subprocess.Popen([sys.executable, "-m", "jdspark.cli", "serve", *serve_args(args, port)])

    def stop():
        proc.terminate()
        proc.wait(30)
    return stop, proc


def wait_ready(url: str, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no server answered {url}/health within {timeout:.0f} s")


def print_table(levels: list[dict]) -> None:
    head = f"{'conc':>4} {'reqs':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9}"
    for name in ("ttft", "itl", "e2e"):
        head += f" | {name + ' p50/p90/p99 (ms)':>26}"
    print(head)
    for lv in levels:
        row = f"{lv['concurrency']:>4} {lv['requests']:>5} {lv['failed']:>4} {lv['requests_per_s']:>7.2f} " \
              f"{lv['output_tokens_per_s']:>9.1f}"
        for name in ("ttft_s", "itl_s", "e2e_s"):
            p = lv[name]
            row += " | " + ("/".join("-" if v is None else f"{v * 1e3:.1f}" for v in p.values())).rjust(26)
        print(row)
        for e in lv["errors"]:
            print(f"     error: {e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="target a running server (loopback only) instead of starting one")
    p.add_argument("--start", choices=["inprocess", "subprocess"], default="inprocess",
                   help="how to start the server when no --url is given")
    p.add_argument("--model", help="checkpoint directory for the started server (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--max-running", type=int, help="slots of the started server (default: the largest concurrency)")
    p.add_argument("--no-speculative", action="store_true", help="start the server with target-only decoding")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-seconds", type=float, default=120, help="no new request after this long, per level")
    p.add_argument("--startup-timeout", type=float, default=1800, help="seconds to wait for a started server")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    stop, proc = None, None
    if args.url:
        url = args.url.rstrip("/")
        if urlparse(url).hostname not in LOOPBACK:
            raise SystemExit(f"--url {args.url}: only loopback servers ({', '.join(LOOPBACK)}) may be load-tested")
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if args.start == "inprocess":
            stop = start_in_process(args, port)
        else:
            stop, proc = start_subprocess(args, port)
    try:
        wait_ready(url, args.startup_timeout, proc)
        asyncio.run(run_level(url, 1, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
        levels = [asyncio.run(run_level(url, c, args)) for c in args.concurrency]
    finally:
        if stop is not None:
            stop()
    print_table(levels)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"url": url, "model": args.model or "embedded", "max_tokens": args.max_tokens,
                       "temperature": args.temperature, "levels": levels}, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if all(lv["requests"] for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
