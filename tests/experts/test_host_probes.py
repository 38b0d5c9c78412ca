import io

import numpy as np

from jdspark.experts import host_probes


def test_interference_splits_steal_and_other_processes():
    """Ticks: user nice system idle iowait irq softirq steal, then this process's: of 150 ticks 30 were
    stolen, 70 busy of which 40 this process's."""
    before, after = np.array([100, 0, 50, 800, 0, 0, 0, 10, 60]), np.array([150, 0, 70, 850, 0, 0, 0, 40, 100])
    assert host_probes.interference(before, after) == {"steal": 30 / 150, "others": 30 / 150}
    assert host_probes.interference(None, after) == {"steal": None, "others": None}
    ticks = host_probes.cpu_ticks()
    assert ticks is None or (len(ticks) == 9 and ticks[:8].sum() > 0)


def test_a_kernel_that_counts_no_steal_reads_as_none_stolen(monkeypatch):
    """/proc/stat of kernels before 2.6.11 has 7 CPU-time fields: steal reads as 0, not this process's ticks."""
    monkeypatch.setattr(host_probes, "open", lambda path: io.StringIO("cpu  100 0 50 800 0 0 0\ncpu0 1 2 3\n"),
                        raising=False)
    ticks = host_probes.cpu_ticks()
    assert len(ticks) == 9 and list(ticks[:8]) == [100, 0, 50, 800, 0, 0, 0, 0]


def test_host_read_measures_a_rate():
    read = host_probes.host_read(8 << 20, 1, 3)
    assert read["GBps"] > 0 and read["best_GBps"] >= read["GBps"] and read["bytes"] == 8 << 20
