"""Several processes (one per host, or one per GPU): `jax.distributed` started from flags or the
usual environment variables, and process 0's figures shared with all, so that every process
makes the same choices (the verify width is chosen on the host from measured costs, and every
device of the mesh must run the same executable)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Start `jax.distributed` when a coordinator is named (an argument, else JAX_COORDINATOR_ADDRESS,
    with JAX_NUM_PROCESSES and JAX_PROCESS_ID); returns whether it did. Call it before anything
    else touches jax's devices. On the CPU, cross-process collectives go through gloo."""
    address = coordinator_address or os.environ.get(ENV["coordinator_address"])
    if not address:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError(f"num_processes={num_processes}, process_id={process_id} need a coordinator: pass "
                             f"--coordinator-address HOST:PORT (or set {ENV['coordinator_address']})")
        return False
    count = _number("num_processes", num_processes)
    rank = _number("process_id", process_id)
    if count < 1 or not 0 <= rank < count:
        raise ValueError(f"process_id={rank} with num_processes={count}: need num_processes >= 1 and "
                         f"0 <= process_id < num_processes (one distinct id per process)")
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):  # CPU only; gloo is the default where present
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=count, process_id=rank)
    return True


def _number(name: str, value: int | None) -> int:
    if value is not None:
        return int(value)
    text = os.environ.get(ENV[name])
    if text is None or not text.strip().lstrip("-").isdigit():
        raise ValueError(f"{name} is needed with a coordinator: pass --{name.replace('_', '-')} N "
                         f"(or set {ENV[name]}), got {text!r}")
    return int(text)


def from_process_0(values: list[float]) -> list[float]:
    """`values` as process 0 has them, in every process (unchanged in a single process)."""
    if jax.process_count() == 1:
        return list(values)
    shared = multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))
    return [float(v) for v in np.asarray(shared)]
