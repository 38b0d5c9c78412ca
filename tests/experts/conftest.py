"""The host expert kernel (jdspark/experts/cpu_gemv.py: g++ -O3 at first use, about 12 s) built
once per test run, not once per worker process: every process's cache keeps it in the run's
experts/ folder, and the first process to need it builds it while the others wait."""

import fcntl
import os

import pytest

from jdspark.experts import cpu_gemv


@pytest.fixture(scope="session", autouse=True)
def host_expert_kernel():
    shared = os.path.join(os.environ["JDSPARK_TEST_RUN_DIR"], "experts")
    os.makedirs(shared, exist_ok=True)
    mine = cpu_gemv._cache_dir()
    if not mine.exists():
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.symlink_to(shared)
    with open(os.path.join(shared, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cpu_gemv.build_kernel()
