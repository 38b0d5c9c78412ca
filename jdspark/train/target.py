"""Next-token training of the DSV4 target (the drafter stages `mtp.*` are left untouched)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdspark.model.dsv4 import DSV4
from jdspark.train import adamw

TARGET = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp")))


def split(module: DSV4, trainable=TARGET):
    """(graphdef, trainable params, everything else) of a module."""
    return nnx.split(module, trainable, ...)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) of fp32 logits [..., V] against labels [...]."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def loss_fn(trainable, frozen, graphdef, window: jax.Array) -> jax.Array:
    """window [B, S + 1]: predict tokens 1..S from 0..S-1."""
    logits, _, _ = nnx.merge(graphdef, trainable, frozen)(window[:, :-1])
    return cross_entropy(logits, window[:, 1:])


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("trainable", "opt"))
def train_step(trainable, frozen, opt: adamw.AdamWState, window, *, graphdef, config: adamw.AdamWConfig):
    loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, graphdef, window)
    trainable, opt, info = adamw.update(config, trainable, grads, opt)
    return trainable, opt, {"loss": loss, **info}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def eval_loss(trainable, frozen, window, *, graphdef) -> jax.Array:
    return loss_fn(trainable, frozen, graphdef, window)


def heldout_loss(trainable, frozen, graphdef, windows: np.ndarray, batch: int) -> float:
    """Mean cross-entropy over held-out windows [n, S + 1] (whole batches only: one shape)."""
    losses = [float(eval_loss(trainable, frozen, windows[i:i + batch], graphdef=graphdef))
              for i in range(0, len(windows) - batch + 1, batch)]
    return float(np.mean(losses))
