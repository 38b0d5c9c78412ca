"""Pallas kernels: one module per kernel, each with its plain-jnp reference `ref_<name>`.

- `rejection_sampler`: `race` / `ref_race`, the vocabulary-wide exponential race of exact verification;
- `sinkhorn`: `sinkhorn` / `ref_sinkhorn`, the mHC Sinkhorn projection;
- `moe`: `moe` / `ref_moe`, routed experts read in place (from device memory, or from pinned host
  memory over PCIe: the PCIe share of `jdspark.experts.hybrid`);
- `fp8_linear`: `fp8_linear` / `ref_fp8_linear`, FP8 block-scaled linears read in place.

Kernels are the bottom layer: nothing here imports `jdspark`. The choice between a kernel and its
reference is one setting, `implementation`, validated and resolved here for every kernel:
"pallas" (the kernel), "xla" (the jnp reference) or "auto" (the kernel on the GPU, the reference
elsewhere). A Pallas kernel run on a CPU runs in interpret mode (`interpret_mode`). Callers resolve
the setting once (`resolve_implementation`) and call the kernel or its reference; the engine takes
it as `Engine(..., implementation=...)` and applies it to the sampler and, through the model graph
(`jdspark.model.hyper.with_implementation`), to Sinkhorn, the routed experts and the FP8 linears.
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("auto", "pallas", "xla")


def resolve_implementation(implementation: str) -> str:
    """"pallas" or "xla" for a setting in IMPLEMENTATIONS ("auto": "pallas" exactly when JAX's default
    backend is the GPU); ValueError naming the value otherwise."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS} (\"auto\": the Pallas "
                         "kernels on the GPU, their jnp references elsewhere)")
    if implementation == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return implementation


def interpret_mode(interpret: bool | None = None) -> bool:
    """Whether a Pallas kernel runs in interpret mode: `interpret` if given, else exactly when JAX's
    default backend is the CPU (Triton needs a GPU)."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)
