"""Shared test set-up: float32 matmuls at full precision, the `gpu` marker skipped without a GPU,
a compilation counter."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class CompileCounter:
    """Counts XLA backend compilations (jax.monitoring events), to prove a warm path never recompiles."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name, duration, **kwargs):
        if name.endswith("backend_compile_duration"):
            self.count += 1


_COMPILES = CompileCounter()


@pytest.fixture
def compile_counter() -> CompileCounter:
    return _COMPILES
