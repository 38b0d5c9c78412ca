"""Trace reading for the benchmark scripts: busy time is the union of kernel intervals, and a trace
without a GPU yields no kernels (the scripts then skip their device columns)."""

import jax
import jax.numpy as jnp
import pytest

from jdspark.profile import busy_us, gpu_kernels


@pytest.mark.parametrize("kernels, busy", [
    ([], 0.0),
    ([(0.0, 2.0, "a"), (1.0, 2.0, "b"), (5.0, 1.0, "c")], 4.0),  # overlap counted once, the gap not at all
    ([(0.0, 10.0, "a"), (2.0, 3.0, "b")], 10.0),  # a kernel inside another adds nothing
    ([(0.0, 1.0, "a"), (1.0, 1.0, "b")], 2.0),  # back to back
])
def test_busy_time_is_the_union_of_kernel_intervals(kernels, busy):
    assert busy_us(kernels) == busy


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU has no GPU streams")
def test_no_gpu_kernels_on_the_cpu():
    assert gpu_kernels(lambda: jax.block_until_ready(jnp.ones(3) + 1)) == []


@pytest.mark.gpu
def test_gpu_kernels_are_seen_on_the_gpu():
    x = jnp.ones((1024, 1024))
    add = jax.jit(lambda a: a + 1)
    jax.block_until_ready(add(x))
    kernels = gpu_kernels(lambda: jax.block_until_ready(add(x)))
    assert len(kernels) >= 1 and busy_us(kernels) > 0
