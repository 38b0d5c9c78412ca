"""The sharded `jdspark generate` case (cases_cli.py) in a process with 4 CPU devices."""

import pytest

from tests.parallel.devices import run_cases


@pytest.mark.slow
def test_generate_tp2_ep2_on_four_cpu_devices():
    run_cases("cases_cli.py", devices=4)
