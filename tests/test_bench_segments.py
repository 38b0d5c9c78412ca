"""scripts/bench_segments.py: its cases parse, and it times the four variants on the CPU."""

import argparse
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("bench_segments", SCRIPTS / "bench_segments.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_cases_parse_and_bad_ones_are_named():
    assert bench.parse_case("16x6+1x64") == [(16, 6), (1, 64)]
    for bad in ("16x6", "16x6+1x0", "16*6+1x64"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected VERIFY_SLOTSxROWS"):
            bench.parse_case(bad)


def test_the_four_variants_run_and_one_call_reads_less_than_two():
    rows = bench.main(["--preset", "tiny", "--cases", "2x3+1x5", "--context", "16", "--runs", "1"])
    floors = {r["variant"]: r["bytes"] for r in rows}
    assert list(floors) == ["verify", "prompt", "two calls", "one call"]
    assert floors["one call"] < floors["two calls"] == floors["verify"] + floors["prompt"]
    assert all(r["ms"] > 0 for r in rows)
