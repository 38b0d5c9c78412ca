"""The hand-written AdamW against a direct numpy transcription of the update rule."""

import jax.numpy as jnp
import numpy as np

from jdspark.train import adamw


def numpy_adamw(config, params, grads_seq, total):
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    params = {k: v.copy() for k, v in params.items()}
    for step, grads in enumerate(grads_seq):
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
        scale = min(1.0, config.clip_norm / (norm + 1e-6))
        lr = float(config.learning_rate(step, total))
        for k in params:
            g = grads[k] * scale
            mu[k] = config.b1 * mu[k] + (1 - config.b1) * g
            nu[k] = config.b2 * nu[k] + (1 - config.b2) * g * g
            delta = (mu[k] / (1 - config.b1 ** (step + 1))) / (np.sqrt(nu[k] / (1 - config.b2 ** (step + 1))) + config.eps)
            if params[k].ndim >= 2:
                delta = delta + config.weight_decay * params[k]
            params[k] = params[k] - lr * delta
    return params


def test_update_matches_the_rule_with_clipping_decay_and_schedule():
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    grads_seq = [{k: (5 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
                 for _ in range(6)]
    config = adamw.AdamWConfig(lr=1e-2, warmup_steps=2, clip_norm=1.0, weight_decay=0.1)
    state = adamw.init({k: jnp.asarray(v) for k, v in params.items()}, total_steps=6)
    current = {k: jnp.asarray(v) for k, v in params.items()}
    for grads in grads_seq:
        current, state, info = adamw.update(config, current, {k: jnp.asarray(g) for k, g in grads.items()}, state)
        assert float(info["grad_norm"]) > 1.0  # clipping is active in this test
    expected = numpy_adamw(config, params, grads_seq, 6)
    for k in params:
        np.testing.assert_allclose(np.asarray(current[k]), expected[k], rtol=1e-5, atol=1e-6)


def test_schedule_warms_up_then_decays_to_the_floor():
    config = adamw.AdamWConfig(lr=1.0, warmup_steps=10, final_lr_fraction=0.1)
    lr = [float(config.learning_rate(s, 110)) for s in (0, 5, 10, 60, 110, 200)]
    assert lr[0] == 0.0 and abs(lr[1] - 0.5) < 1e-6 and abs(lr[2] - 1.0) < 1e-6
    assert abs(lr[3] - 0.55) < 1e-6 and abs(lr[4] - 0.1) < 1e-6 and abs(lr[5] - 0.1) < 1e-6
