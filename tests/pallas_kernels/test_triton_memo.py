"""The Triton compile memo: the same arguments compile once, other arguments compile anew, other
attributes are the module's; installed once on import of the kernels; off with JDSPARK_TRITON_MEMO=0;
on the GPU, a program with two sites of the same kernel compiles it once."""

import types

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels  # noqa: F401 - installs the memo
from pallas_kernels import triton_memo
from pallas_kernels.sinkhorn import sinkhorn


def fake_triton():
    calls = []

    def compile(platform, module, arch, *, num_warps, num_ctas, num_stages):
        calls.append(module)
        return types.SimpleNamespace(asm=f"ptx of {module!r} for {arch}", smem_bytes=len(calls))
    return types.SimpleNamespace(compile=compile, dialect="the dialect"), calls


def test_the_same_arguments_compile_once():
    module, calls = fake_triton()
    memo = triton_memo.MemoisedTriton(module)
    first = memo.compile("cuda", b"kernel a", "9.0", num_warps=4, num_ctas=1, num_stages=3)
    assert memo.compile("cuda", b"kernel a", "9.0", num_warps=4, num_ctas=1, num_stages=3) is first
    other_warps = memo.compile("cuda", b"kernel a", "9.0", num_warps=8, num_ctas=1, num_stages=3)
    other_module = memo.compile("cuda", b"kernel b", "9.0", num_warps=4, num_ctas=1, num_stages=3)
    assert calls == [b"kernel a", b"kernel a", b"kernel b"] and len({id(first), id(other_warps), id(other_module)}) == 3
    assert (memo.hits, memo.misses) == (1, 3)
    assert memo.dialect == "the dialect"  # everything else is the module's


def test_installed_once_on_import_and_off_by_environment(monkeypatch):
    from jax._src.pallas.triton import pallas_call_registration as registration
    memo = triton_memo.install()
    assert isinstance(registration.triton, triton_memo.MemoisedTriton) and registration.triton is memo
    assert triton_memo.install() is memo  # not wrapped twice
    monkeypatch.setenv("JDSPARK_TRITON_MEMO", "0")
    assert triton_memo.install() is None and registration.triton is memo


@pytest.mark.gpu
def test_two_sites_of_one_kernel_compile_once_on_the_gpu():
    """jaxlib >= 0.10.3 compiles Triton while lowering: the second identical site is a hit."""
    memo = triton_memo.install()
    assert memo is not None, "this jax's Pallas GPU lowering has no jax._src.lib.triton to memoise"
    hits, misses = memo.hits, memo.misses

    def twice(logits):
        return sinkhorn(sinkhorn(logits, 20, 1e-6) * 2.0, 20, 1e-6)
    jax.jit(twice).lower(jnp.ones((3, 4, 4), jnp.float32))
    assert memo.misses - misses <= 1 and memo.hits - hits >= 1
