"""Two processes through jax.distributed (CPU collectives over gloo): a sharded forward over 2 x 2
CPU devices equals the unsharded one, and process 0's figures reach both (two_process_worker.py)."""

import json
import socket
import subprocess
import sys

import pytest

from tests.parallel.devices import ROOT, device_env

WORKER = ROOT / "tests" / "parallel" / "two_process_worker.py"


def gloo_missing() -> str | None:
    """What this jaxlib lacks for CPU collectives across processes, or None."""
    import jax
    from jaxlib import _jax
    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        return "the jax_cpu_collectives_implementation option (jax too old)"
    if not hasattr(_jax, "make_gloo_tcp_collectives"):
        return "gloo CPU collectives in the installed jaxlib (jaxlib._jax.make_gloo_tcp_collectives)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sharded_forward_across_two_processes():
    missing = gloo_missing()
    if missing:
        pytest.skip(f"needs {missing}")
    port, env = str(free_port()), {**device_env(2), "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen([sys.executable, str(WORKER), port, str(rank)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = [w.communicate(timeout=600) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, f"worker failed:\n{out[-3000:]}\n{err[-5000:]}"
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for rank, report in enumerate(reports):
        assert (report["process"], report["processes"], report["devices"]) == (rank, 2, 4)
        assert report["max_abs_diff"] <= 1e-5
        assert report["from_process_0"] == [0.5]
