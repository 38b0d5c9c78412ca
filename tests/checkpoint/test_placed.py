"""Routed experts read straight into their placement (`SplitLayer`): fed per expert in any order or
stacked, the bank and the device part hold exactly what a split of the whole layer holds, and the
hybrid layer built from them computes the same outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdspark.checkpoint.placed import SplitLayer
from jdspark.experts.hybrid import HybridExperts
from jdspark.model.quantized import Storage
from tests.model.test_quantized import BASE, FLASH, random_experts, routing

HOST = [0, 3, 4, 9]
PREFIX = ("layers", 0, "ffn", "experts")


@pytest.mark.parametrize("storage,dtype", [(FLASH, jnp.float32), (BASE, jnp.float32), (Storage(), jnp.bfloat16)],
                         ids=["fp4", "fp8_f32", "bf16"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_split_layer_equals_the_split_of_the_whole_layer(storage, dtype, stacked):
    experts = random_experts(storage, dtype, seed=5)
    arrays = {(*PREFIX, name, key): np.asarray(value) for name in ("w1", "w3", "w2")
              for key, value in nnx.to_pure_dict(nnx.state(getattr(experts, name))).items()}
    split = SplitLayer({path: jax.ShapeDtypeStruct(a.shape, a.dtype) for path, a in arrays.items()}, 0, HOST)
    pieces = [(path, None) for path in arrays] if stacked else \
        [(path, e) for e in np.random.default_rng(0).permutation(experts.n_experts) for path in arrays]
    device = {}
    for i, (path, e) in enumerate(pieces):
        value = split.put(path, e, arrays[path] if e is None else arrays[path][e])
        assert (value is None) == (path in device or any(p == path for p, _ in pieces[i + 1:])), (path, e)
        if value is not None:
            device[path] = value
    bank = split.finish()

    whole = HybridExperts(experts, HOST, dtype=dtype)
    assert bank.offsets == whole.bank.offsets and list(bank.expert_ids) == HOST
    for name in bank.offsets:
        np.testing.assert_array_equal(bank.view(name), whole.bank.view(name))
    for path, value in device.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(getattr(getattr(whole, path[4]), path[5])[...]))

    for name in ("w1", "w3", "w2"):  # the layer holds only its device experts now
        nnx.replace_by_pure_dict(nnx.state(getattr(experts, name)),
                                 {key: device[(*PREFIX, name, key)] for key in ("weight", "scale")
                                  if (*PREFIX, name, key) in device})
    placed = HybridExperts(experts, HOST, dtype=dtype, bank=bank)
    rng = np.random.default_rng(1)
    idx, weights = routing(rng, 6, experts.n_experts, 3, pool=8)
    x = jnp.asarray(rng.normal(size=(6, 256)), dtype)
    np.testing.assert_array_equal(np.asarray(placed(x, jnp.asarray(weights), jnp.asarray(idx))),
                                  np.asarray(whole(x, jnp.asarray(weights), jnp.asarray(idx))))
