"""The server's Prometheus counters from engine step records (`jdspark.server.metrics`)."""

import numpy as np

from jdspark.engine.stats import RowRecord, StepRecord
from jdspark.server.metrics import Metrics


def _value(metrics: Metrics, name: str) -> float:
    line = next(l for l in metrics.exposition().decode().splitlines() if l.startswith(name + " "))
    return float(line.split()[1])


def test_a_step_counts_its_drafts_acceptances_and_riding_prompt_tokens():
    metrics = Metrics(gamma=5)
    rows = (RowRecord(0, np.ones(5), 3, (1, 2, 3, 4), 5), RowRecord(1, np.ones(5), 0, (7,), 2))
    metrics.record_step(StepRecord(5, 0.01, rows, None, None, prompt_tokens=6))
    metrics.record_step(StepRecord(0, 0.01, (RowRecord(0, np.ones(5), 0, (5,), 0),), None, None, prompt_tokens=1))
    assert _value(metrics, "jdspark:spec_decode_num_drafts_total") == 2  # the decode step verified none
    assert _value(metrics, "jdspark:spec_decode_num_draft_tokens_total") == 7
    assert _value(metrics, "jdspark:spec_decode_num_accepted_tokens_total") == 3
    assert _value(metrics, "jdspark:prompt_tokens_riding_total") == 7  # riders of both steps
