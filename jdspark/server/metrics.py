"""Prometheus metrics of one server, named like vLLM's (`vllm:` -> `jdspark:`).

Each server owns its registry (no process-global state), so several servers in one process — the
tests — count separately. The engine thread writes, `/metrics` reads; prometheus_client is
thread-safe. Speculative counters follow vLLM's `spec_decode_*`: a draft is one verification of
k >= 1 drafted tokens for one request; `num_accepted_tokens_per_pos{position=i}` counts acceptances
at draft position i (0-based), so acceptance at i = that / num_drafts reaching i.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jdspark.engine.stats import StepRecord

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
            20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, gamma: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jdspark:request_success", "Finished requests by finish reason "
                                "(stop, length, tool_calls, abort: client gone, error)", ["finished_reason"],
                                registry=r)
        self.prompt_tokens = Counter("jdspark:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.riding_tokens = Counter("jdspark:prompt_tokens_riding", "Prompt tokens prefilled in verify calls beside "
                                     "running requests (--ride-prompts, --prompt-segment), not in prefill calls",
                                     registry=r)
        self.generation_tokens = Counter("jdspark:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("jdspark:time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("jdspark:inter_token_latency_seconds", "Time between two deliveries to one request "
                             "(a delivery carries a whole accepted block)", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("jdspark:e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY,
                             registry=r)
        self.waiting = Gauge("jdspark:num_requests_waiting", "Requests queued for a slot", registry=r)
        self.running = Gauge("jdspark:num_requests_running", "Requests holding an engine slot", registry=r)
        self.num_drafts = Counter("jdspark:spec_decode_num_drafts", "Verifications with >= 1 drafted token, "
                                  "per request", registry=r)
        self.num_draft_tokens = Counter("jdspark:spec_decode_num_draft_tokens", "Drafted tokens verified",
                                        registry=r)
        self.num_accepted_tokens = Counter("jdspark:spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("jdspark:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted at each draft position", ["position"], registry=r)
        for i in range(gamma):
            self.accepted_per_pos.labels(position=str(i))

    def record_step(self, step: StepRecord) -> None:
        """Count one engine step's verifications and riding prompt tokens (its record is the engine's,
        `jdspark.engine.stats`)."""
        self.riding_tokens.inc(step.prompt_tokens)
        if not step.width:
            return
        accepted = [row.n_accepted for row in step.rows]
        self.num_drafts.inc(len(accepted))
        self.num_draft_tokens.inc(step.drafted)
        self.num_accepted_tokens.inc(sum(accepted))
        for i in range(max(accepted, default=0)):
            self.accepted_per_pos.labels(position=str(i)).inc(sum(n > i for n in accepted))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
