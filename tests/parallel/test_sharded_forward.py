"""The sharded forward cases (cases_forward.py) in a process with 8 CPU devices."""

import pytest

from tests.parallel.devices import run_cases


@pytest.mark.slow
def test_sharded_forward_on_eight_cpu_devices():
    run_cases("cases_forward.py", devices=8)
