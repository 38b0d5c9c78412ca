"""Trace reading for the benchmark scripts: busy time is the union of kernel intervals, and a trace
without a GPU yields no kernels (the scripts then skip their device columns)."""

import jax
import jax.numpy as jnp
import pytest

from jdspark.profile import busy_us, gap_lines, gpu_kernels, idle_gaps


@pytest.mark.parametrize("kernels, busy", [
    ([], 0.0),
    ([(0.0, 2.0, "a"), (1.0, 2.0, "b"), (5.0, 1.0, "c")], 4.0),  # overlap counted once, the gap not at all
    ([(0.0, 10.0, "a"), (2.0, 3.0, "b")], 10.0),  # a kernel inside another adds nothing
    ([(0.0, 1.0, "a"), (1.0, 1.0, "b")], 2.0),  # back to back
])
def test_busy_time_is_the_union_of_kernel_intervals(kernels, busy):
    assert busy_us(kernels) == busy


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU has no GPU streams")
def test_idle_gaps_bucket_the_idle_time_between_kernels():
    def kernel(ts, dur, name, graph="1"):
        return {"ts": ts, "dur": dur, "name": name, "args": {} if graph is None else {"cuda_graph_id": graph}}
    # a: 0-10, b: 11-15 (gap 1), c: 12-30 overlaps b (no gap), d: 33-34 (gap 3), e: 134-135 (gap 100)
    gaps = idle_gaps([kernel(0, 10, "a"), kernel(11, 4, "b"), kernel(12, 18, "c"), kernel(33, 1, "d", "2"),
                      kernel(134, 1, "e", None)])
    assert gaps["idle_us"]["<2"] == {"gaps": 1, "us": 1.0}
    assert gaps["idle_us"]["<4"] == {"gaps": 1, "us": 3.0}
    assert gaps["idle_us"][">=50"] == {"gaps": 1, "us": 100.0}
    assert gaps["longest"][0] == {"us": 100.0, "after": "d", "before": "e"}
    assert gaps["longest"][1]["after"] == "c"  # the kernel that ended last, not the one that started last
    assert (gaps["cuda_graphs"], gaps["outside_graphs"]) == (2, 1)
    lines = gap_lines(gaps, longest=2)
    assert len(lines) == 3 and "CUDA graphs 2, kernels outside them 1" in lines[0]
    assert lines[1].split() == ["gap", "100.0", "us", "after", "d", "before", "e"]


def test_no_gpu_kernels_on_the_cpu():
    assert gpu_kernels(lambda: jax.block_until_ready(jnp.ones(3) + 1)) == []


@pytest.mark.gpu
def test_gpu_kernels_are_seen_on_the_gpu():
    x = jnp.ones((1024, 1024))
    add = jax.jit(lambda a: a + 1)
    jax.block_until_ready(add(x))
    kernels = gpu_kernels(lambda: jax.block_until_ready(add(x)))
    assert len(kernels) >= 1 and busy_us(kernels) > 0
