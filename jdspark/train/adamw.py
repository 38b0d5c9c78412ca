"""AdamW with linear warm-up, cosine decay and global-norm clipping, over any pytree of fp32 params.

Hand-written (the project uses no optax): the whole optimiser is the four lines of `update`.
Weight decay applies to matrices only (ndim >= 2), not to norms, biases or scalars.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1

    def learning_rate(self, step: jax.Array, total_steps: jax.Array) -> jax.Array:
        """Linear warm-up to `lr`, then cosine to `final_lr_fraction * lr` at `total_steps` (a
        traced value, so a time-budgeted run can set it after timing its first steps)."""
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(self.warmup_steps, 1)
        decay_steps = jnp.maximum(jnp.asarray(total_steps, jnp.float32) - self.warmup_steps, 1.0)
        progress = jnp.clip((step - self.warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = self.final_lr_fraction + (1 - self.final_lr_fraction) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return self.lr * jnp.where(step < self.warmup_steps, warm, cosine)


@struct.dataclass
class AdamWState:
    step: jax.Array
    total_steps: jax.Array  # where the cosine ends
    mu: object
    nu: object


def init(params, total_steps: int) -> AdamWState:
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    return AdamWState(step=jnp.zeros((), jnp.int32), total_steps=jnp.asarray(total_steps, jnp.int32), mu=zeros,
                      nu=jax.tree.map(jnp.copy, zeros))


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def update(config: AdamWConfig, params, grads, state: AdamWState):
    """One step: returns (new params, new state, {"grad_norm", "lr"})."""
    norm = global_norm(grads)
    scale = jnp.minimum(1.0, config.clip_norm / (norm + 1e-6)) if config.clip_norm else 1.0
    step = state.step + 1
    lr = config.learning_rate(state.step, state.total_steps)
    mu = jax.tree.map(lambda m, g: config.b1 * m + (1 - config.b1) * g * scale, state.mu, grads)
    nu = jax.tree.map(lambda v, g: config.b2 * v + (1 - config.b2) * jnp.square(g * scale), state.nu, grads)
    c1, c2 = 1 - config.b1 ** step, 1 - config.b2 ** step

    def apply(p, m, v):
        delta = (m / c1) / (jnp.sqrt(v / c2) + config.eps)
        if p.ndim >= 2:
            delta = delta + config.weight_decay * p
        return (p - lr * delta).astype(p.dtype)

    new = jax.tree.map(apply, params, mu, nu)
    return new, state.replace(step=step, mu=mu, nu=nu), {"grad_norm": norm, "lr": lr}
