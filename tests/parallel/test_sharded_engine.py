"""The sharded engine cases (cases_engine.py) in a process with 4 CPU devices."""

import pytest

from tests.parallel.devices import run_cases


@pytest.mark.slow
def test_sharded_engine_on_four_cpu_devices():
    run_cases("cases_engine.py", devices=4)
