"""Runs a module of sharded test cases in a fresh pytest process with N fake CPU devices.

XLA reads `--xla_force_host_platform_device_count` once, when the backend starts, and the test
session's conftest starts it (and other test files need the default single device), so the cases
live in modules that pytest does not collect by name (`cases_*.py`) and run here in a subprocess
whose environment sets the flag before jax starts."""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def device_env(devices: int) -> dict[str, str]:
    """This environment with `devices` CPU devices and without the xdist worker's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_cases(module: str, devices: int, timeout: int = 1500) -> str:
    """pytest -x on tests/parallel/`module` with `devices` CPU devices; fails with its output."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                             str(HERE / module)], cwd=ROOT, env=device_env(devices), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{module} on {devices} CPU devices failed:\n{result.stdout[-8000:]}\n" \
                                   f"{result.stderr[-4000:]}"
    return result.stdout
