"""Pallas kernels: one module per kernel, each with a plain-jnp `ref_<name>` (none yet)."""
