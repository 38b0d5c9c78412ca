"""Expert parallelism through the routed-expert kernel: each device runs the in-place kernel (interpret
mode here) over its own experts, the slot form for few rows and the grouped form for many, and the
sum over devices equals the unsharded gather path. Run with 8 CPU devices by
test_sharded_experts.py (see devices.py); not collected by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdspark.model.moe import GROUPED_MIN_ROWS
from jdspark.model.quantized import Storage
from jdspark.parallel.mesh import make_mesh
from pallas_kernels import moe as moe_kernels
from tests.model.test_quantized import BASE, FLASH, random_experts, routing

N_EXPERTS = 16


def run(experts, x, w, idx):
    return np.asarray(jax.jit(lambda m, x, w, i: m(x, w, i))(experts, x, jnp.asarray(w), jnp.asarray(idx)))


@pytest.mark.parametrize("storage", [Storage(), FLASH, BASE], ids=["float", "fp4", "fp8_f32"])
@pytest.mark.parametrize("ep", [2, 8])
@pytest.mark.parametrize("rows", [1, 6, 40], ids=["decode", "verify", "grouped"])
def test_expert_parallel_kernel_equals_unsharded_gather(storage, ep, rows, monkeypatch):
    """At EP 8 each device holds 2 experts: a call's rows select every one of them and others'
    experts too, so a device's slots must hold both (an expert lost there changes the sum)."""
    assert (rows >= GROUPED_MIN_ROWS) == (rows == 40)
    forms = []
    for form in ("moe", "grouped_moe"):
        kernel = getattr(moe_kernels, form)
        monkeypatch.setattr(moe_kernels, form, lambda *a, kernel=kernel, form=form, **k: (forms.append(form),
                                                                                        kernel(*a, **k))[1])
    experts = random_experts(storage, jnp.float32, seed=7, width=256, n_experts=N_EXPERTS)
    rng = np.random.default_rng(rows + ep)
    idx, w = routing(rng, rows, N_EXPERTS, 3, N_EXPERTS)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    want = run(experts, x, w, idx)  # unsharded, the XLA gather
    experts.implementation, experts.mesh = "pallas", make_mesh(1, ep)
    assert experts.reads_per_expert(256)  # whole experts on each device: the kernel path
    got = run(experts, x, w, idx)
    assert forms == ["grouped_moe" if rows == 40 else "moe"]  # traced once, on every device
    np.testing.assert_allclose(got, want, atol=1e-5 * float(np.abs(want).max()), rtol=0)


def test_split_experts_keep_the_gather():
    """Experts split over `tensor` (TP 2) round each expert's output after its width pieces are summed,
    which the kernel cannot: they keep the gather path, and equal the unsharded one."""
    experts = random_experts(FLASH, jnp.float32, seed=8, width=256, n_experts=N_EXPERTS)
    rng = np.random.default_rng(3)
    idx, w = routing(rng, 6, N_EXPERTS, 3, N_EXPERTS)
    x = jnp.asarray(rng.standard_normal((6, 256)), jnp.float32)
    want = run(experts, x, w, idx)
    experts.implementation, experts.mesh = "pallas", make_mesh(2, 4)
    assert not experts.reads_per_expert(256)
    np.testing.assert_allclose(run(experts, x, w, idx), want, atol=1e-5 * float(np.abs(want).max()), rtol=0)
