"""The expert-parallel kernel cases (cases_experts.py) in a process with 8 CPU devices."""

import pytest

from tests.parallel.devices import run_cases


@pytest.mark.slow
def test_expert_parallel_kernel_on_eight_cpu_devices():
    run_cases("cases_experts.py", devices=8)
