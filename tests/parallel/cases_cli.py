"""`jdspark generate --tensor-parallel-size 2 --expert-parallel-size 2` on the embedded model
prints the greedy text of an unsharded run (float32; the unsharded run is target-only, which
greedy speculation equals). Run with 4 CPU devices by test_sharded_cli.py (see devices.py)."""

from jdspark.cli import main

COMMON = ["generate", "def fib(n):", "--dtype", "float32", "--temperature", "0", "--max-tokens", "24",
          "--max-seq-len", "128", "--width", "3"]


def test_generate_on_tp2_ep2_prints_the_unsharded_greedy_text(capsys):
    assert main([*COMMON, "--no-speculative"]) == 0
    unsharded = capsys.readouterr().out
    assert main([*COMMON, "--tensor-parallel-size", "2", "--expert-parallel-size", "2"]) == 0
    sharded = capsys.readouterr().out
    assert len(unsharded.strip()) > 10 and sharded == unsharded
