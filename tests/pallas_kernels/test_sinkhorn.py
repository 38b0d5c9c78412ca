"""The Pallas Sinkhorn projection equals the jnp reference to float32 rounding on fresh random
logits of many shapes (interpret mode on CPU; the `gpu` test compiles it through Triton), and its
gradient is the reference's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.model import hyper
from jdspark.model.model import Model
from pallas_kernels import resolve_implementation
from pallas_kernels.sinkhorn import ref_sinkhorn, sinkhorn
from tests.conftest import DSPARK_CONFIG

EPS = 1e-6
kernel = jax.jit(sinkhorn, static_argnums=(1, 2, 3))
reference = jax.jit(ref_sinkhorn, static_argnums=(1, 2))


def logits(shape, seed, scale=3.0):
    return jnp.asarray(np.random.default_rng(seed).normal(scale=scale, size=shape), jnp.float32)


@pytest.mark.parametrize("lead, c, iters", [
    ((1,), 4, 20),          # one token (decode, batch 1)
    ((2, 3), 4, 20),        # 6 tokens: tile 4, the last tile shifted back
    ((1, 6), 4, 1),         # no iteration after the first normalisations
    ((17,), 4, 2),
    ((3, 86), 4, 20),       # 258 tokens: two full tiles of 128 and a shifted one
    ((5,), 2, 7),
    ((4, 2, 3), 3, 5),      # C need not be a power of two (vectors are per entry)
])
def test_kernel_equals_reference(lead, c, iters):
    x = logits((*lead, c, c), seed=sum(lead) + c + iters)
    got = kernel(x, iters, EPS, None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(x, iters, EPS)), rtol=2e-6, atol=1e-7)
    assert got.shape == x.shape and got.dtype == jnp.float32


def test_extreme_logits_stay_finite_and_match():
    x = logits((9, 4, 4), seed=3, scale=80.0)  # exp underflows to 0 in most entries of a row
    got = np.asarray(kernel(x, 20, EPS, None))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(reference(x, 20, EPS)), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got.sum(axis=-2), 1.0, atol=1e-4)  # columns sum to one after the last step


def test_gradient_is_the_reference_gradient():
    x = logits((6, 4, 4), seed=4)
    weights = logits((6, 4, 4), seed=5)
    loss = lambda f: lambda v: jnp.sum(f(v) * weights)  # noqa: E731
    got = jax.grad(loss(lambda v: sinkhorn(v, 20, EPS)))(x)
    want = jax.grad(loss(lambda v: ref_sinkhorn(v, 20, EPS)))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_a_model_with_the_kernel_computes_what_it_computes_with_the_loop():
    """Every mHC site of a small model (target layers and drafter stages' blocks) through the
    kernel (`hyper.with_implementation(..., "pallas")`, as "auto" is on the GPU) and through the
    jnp loop ("xla"): the same logits. The setting lives in the model graph, so the two models
    trace separately and nothing global changes."""
    model = Model.random(DSPARK_CONFIG, "float32", seed=2)
    ids = np.random.default_rng(2).integers(2, DSPARK_CONFIG.vocab_size, (2, 12))
    built = {name: Model(hyper.with_implementation(model.graphdef, model.params, name), model.params)
             for name in ("pallas", "xla")}
    sites = [m for _, m in nnx.iter_graph(built["pallas"].module()) if isinstance(m, hyper.HyperConnection)]
    assert sites and all(site.implementation == "pallas" for site in sites)
    want = np.asarray(built["xla"].forward(ids).logits)
    got = np.asarray(built["pallas"].forward(ids).logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_implementation_setting_is_validated_in_one_place():
    assert resolve_implementation("xla") == "xla" and resolve_implementation("pallas") == "pallas"
    assert resolve_implementation("auto") == ("pallas" if jax.default_backend() == "gpu" else "xla")
    model = Model.random(DSPARK_CONFIG, "float32", seed=2)
    with pytest.raises(ValueError, match="implementation='triton' is not one of"):
        hyper.with_implementation(model.graphdef, model.params, "triton")
    with pytest.raises(ValueError, match="implementation='kernel' is not one of"):
        hyper.sinkhorn(jnp.zeros((1, 4, 4)), 20, EPS, "kernel")


def test_non_square_logits_are_rejected():
    with pytest.raises(ValueError, match="C x C"):
        sinkhorn(jnp.zeros((2, 4, 3)), 20, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 6, 100, 4096])
def test_compiled_kernel_equals_reference_on_gpu(n):
    x = logits((n, 4, 4), seed=n)
    np.testing.assert_allclose(np.asarray(kernel(x, 20, EPS, False)), np.asarray(reference(x, 20, EPS)),
                               rtol=1e-5, atol=1e-7)
