"""Host memory viewed as jax arrays (jdspark/experts/mapped.py): the DLPack producer aliases the
numpy memory it is given (checked on the CPU, where the view is a CPU array of the same bytes); on a
CUDA GPU (gpu) a view reads the pinned host memory in place: the values, a write on the host seen by
the next read, and no device copy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jdspark.experts import mapped
from jdspark.experts.banks import aligned_empty


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.float32, ml_dtypes.bfloat16,
                                   ml_dtypes.float8_e4m3fn])
def test_the_dlpack_producer_aliases_the_memory(dtype):
    a = aligned_empty((3, 4, 64), dtype)
    a[...] = np.random.default_rng(0).integers(0, 100, a.shape).astype(np.float32).astype(dtype)
    view = mapped.cpu_view(a)
    assert view.dtype == a.dtype and view.shape == a.shape
    np.testing.assert_array_equal(np.asarray(view).view(np.uint8), a.view(np.uint8))
    a[1, 2, 3] = a.dtype.type(7)
    assert np.asarray(view)[1, 2, 3] == a.dtype.type(7)  # the same memory, not a copy


def test_a_view_on_a_cpu_backend_holds_the_values():
    a = aligned_empty((2, 128), np.int8)
    a[...] = np.arange(256).reshape(2, 128) - 128
    np.testing.assert_array_equal(mapped.device_view(a[1], jax.devices("cpu")[0], a), a[1])
    with pytest.raises(ValueError, match="C-contiguous part"):
        mapped.device_view(np.zeros(8, np.int8), jax.devices("gpu")[0] if jax.default_backend() == "gpu"
                           else _FakeCuda(), a)


class _FakeCuda:
    """A device that says it is a CUDA GPU (device_view checks its argument before touching CUDA)."""
    platform = "gpu"
    local_hardware_id = 0

    class client:
        platform_version = "cuda"


@pytest.mark.gpu
def test_a_gpu_reads_pinned_host_memory_in_place():
    gpu = jax.devices("gpu")[0]
    base = aligned_empty((1 << 22,), np.uint8)
    base[...] = np.random.default_rng(1).integers(0, 256, base.size, dtype=np.uint8)
    part = base[4096:4096 + (1 << 20)].view(np.int8).reshape(256, 4096)
    view = mapped.device_view(part, gpu, base)
    total = jax.jit(lambda v: jnp.sum(v.astype(jnp.int32)))
    assert int(total(view)) == int(part.astype(np.int64).sum())
    assert view.unsafe_buffer_pointer() == mapped.pin(base, gpu) + 4096  # the host memory's own device address
    part[0, 0] = np.int8(part[0, 0]) ^ 1
    assert int(total(view)) == int(part.astype(np.int64).sum())  # the next read sees the host's write
