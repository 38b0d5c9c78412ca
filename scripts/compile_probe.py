"""How long one tiny-model extend takes to compile here (device start-up cost probe)."""

import time

import jax
import jax.numpy as jnp
from flax import nnx

from jdspark.config import EngineConfig, tiny_config
from jdspark.model.model import Model

model = Model.random(tiny_config(), "bfloat16", seed=1)
decode = model.init_state(EngineConfig(max_seq_len=256, gamma=5, max_batch=1))
for s in (6, 1):
    f = jax.jit(lambda p, d, i, n: nnx.merge(model.graphdef, p).extend(i, d, n))
    start = time.perf_counter()
    lowered = f.lower(model.params, decode, jnp.zeros((1, s), jnp.int32), jnp.ones((1,), jnp.int32))
    mid = time.perf_counter()
    lowered.compile()
    print(f"S={s}: lower {mid - start:.1f}s compile {time.perf_counter() - mid:.1f}s", flush=True)
