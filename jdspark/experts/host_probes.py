"""What the host machine gives a benchmark: its memory, its read bandwidth, and how much of its CPU
time others took meanwhile (`jdspark bench bw`, `scripts/bench_flash.py`, `scripts/bench_hybrid.py`)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from jdspark.experts import cpu_gemv
from jdspark.experts.banks import aligned_empty

log = logging.getLogger(__name__)


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16 << 30


def cpu_ticks() -> np.ndarray | None:
    """The machine's CPU time so far by kind (/proc/stat: user nice system idle iowait irq softirq
    steal), then this process's own (user + system), in clock ticks; None where there is none. In a
    container without its own /proc/stat (LXCFS) the machine is the whole host: "others" then counts
    other containers too."""
    try:
        with open("/proc/stat") as stat:
            machine = [int(t) for t in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    machine += [0] * (8 - len(machine))  # kernels before 2.6.11 count no steal (nor irq and softirq before 2.6)
    mine = os.times()
    return np.array([*machine, round((mine.user + mine.system) * os.sysconf("SC_CLK_TCK"))], np.int64)


def interference(before: np.ndarray | None, after: np.ndarray | None) -> dict[str, float | None]:
    """Between two `cpu_ticks`, the shares of the machine's CPU time the hypervisor gave to other
    guests (steal: a virtual machine's neighbours, which its load average does not show) and that
    other processes of this machine used (busy time not this process's)."""
    if before is None or after is None or (after[:8] - before[:8]).sum() <= 0:
        return {"steal": None, "others": None}
    spent = after - before
    total, busy = spent[:8].sum(), spent[:8].sum() - spent[3] - spent[4] - spent[7]
    return {"steal": float(spent[7] / total), "others": float(max(busy - spent[8], 0) / total)}


def host_read(nbytes: int, threads: int, repeats: int) -> dict:
    """Streaming read bandwidth over `nbytes` with `threads` threads: median and best GB/s."""
    buf = aligned_empty((nbytes,))
    buf.view(np.uint64)[:] = 1  # touch every page
    try:
        lib = cpu_gemv.kernel()
        words = nbytes // 8

        def once():
            lib.jds_read_sum(buf.ctypes.data, words, 1, threads)
        how = f"C++ streaming sum, {threads} threads"
    except RuntimeError as e:  # no compiler: numpy's (single-threaded) sum
        log.warning("read test through numpy: %s", e)
        view = buf.view(np.uint64)

        def once():
            view.sum()
        how = "numpy sum, 1 thread"
    once()
    rates = []
    for _ in range(max(repeats, 3)):
        t = time.perf_counter()
        once()
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    return {"GBps": float(np.median(rates)), "best_GBps": float(max(rates)), "bytes": nbytes, "how": how}
