"""`EngineConfig`: the serving-time sizes that fix the decode state's static shapes."""

from __future__ import annotations

import dataclasses

from jdspark.config.base import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving-time sizes that fix the decode state's static shapes.

    `max_seq_len` bounds prompt + generated tokens per slot; `gamma` is the DSpark block size, so one
    verification writes up to gamma + 1 rows ahead of the committed frontier; `max_batch` is the
    number of sequence slots. `batch_buckets` are the batch sizes the engine compiles executables
    for (each step runs the smallest that holds its requests); empty: 1, 4, 16, ... and max_batch
    (powers of 4, not 2: every bucket is a full set of executables, and start-up grows with them).

    `prefill_batch_buckets` are the batch sizes of the prefill executables (empty: `batch_buckets`').
    A prefill call's cost is its rows' dense work whatever they hold, so prompts that arrive a few at
    a time beside a large batch want small prefill buckets even where no small decode bucket pays for
    its full set of executables (one prefill program each): a speculating batch at Flash dims ends
    its requests steps apart, and its bucket-16 prefill cost ~50 ms beside a 21 ms step for the one
    or two prompts each took (17-22 ms since prompt chunks compute their logits at the last token alone;
    docs/BENCHMARKS.md, serving under load).

    `scripted_acceptance` is for benchmarks of models whose drafts mean nothing (random weights):
    each verified draft is accepted with this probability, from the verification's own uniforms
    (the accepted prefix of u_j < a), and the drafter's confidences read a. Calls then cost what
    they cost serving text that accepts a per position; the tokens are not the model's. None: exact
    verification, the only setting for serving.

    `twin_executables` loads every executable twice and alternates the two call by call, so that each
    sees the same buffer addresses every call under overlapped steps (no CUDA graph update;
    `twins.Twins`; on the CPU each is loaded once: there is no graph to update). Measured on the H200 (embedded
    model, docs/BENCHMARKS.md): the graph update on every call (0.39-0.42 ms of host time) gone, an
    overlapped speculative step 1.76 -> 1.65 ms and a target-only one 1.47 -> 1.24 ms.
    """

    max_seq_len: int = 4096
    gamma: int = 5
    max_batch: int = 1
    batch_buckets: tuple[int, ...] = ()
    prefill_batch_buckets: tuple[int, ...] = ()
    scripted_acceptance: float | None = None
    twin_executables: bool = True

    def __post_init__(self):
        for key, low in (("max_seq_len", 1), ("gamma", 0), ("max_batch", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"EngineConfig.{key}={value!r}: must be an integer >= {low}")
        for key in ("batch_buckets", "prefill_batch_buckets"):
            buckets = tuple(getattr(self, key))
            if buckets and (any(not isinstance(n, int) or not 1 <= n <= self.max_batch for n in buckets)
                            or self.max_batch not in buckets):
                raise ConfigError(f"EngineConfig.{key}={buckets!r}: each must be an integer in "
                                  f"1..max_batch={self.max_batch}, and max_batch itself must be one")
            object.__setattr__(self, key, buckets)
        a = self.scripted_acceptance
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
            raise ConfigError(f"EngineConfig.scripted_acceptance={a!r}: a probability in [0, 1] (benchmarks "
                              f"only), or None for exact verification")

    @property
    def buckets(self) -> tuple[int, ...]:
        """The compiled batch sizes, ascending (the last is max_batch)."""
        if self.batch_buckets:
            return tuple(sorted(set(self.batch_buckets)))
        powers = [4 ** i for i in range(self.max_batch.bit_length()) if 4 ** i < self.max_batch]
        return (*powers, self.max_batch)

    def bucket(self, n: int) -> int:
        """The smallest compiled batch size that holds n requests."""
        return next(b for b in self.buckets if b >= n)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prefill executables' batch sizes, ascending (the last is max_batch)."""
        return tuple(sorted(set(self.prefill_batch_buckets))) if self.prefill_batch_buckets else self.buckets

    def prefill_bucket(self, n: int) -> int:
        """The smallest prefill batch size that holds n prompts."""
        return next(b for b in self.prefill_buckets if b >= n)

    @property
    def rollback_rows(self) -> int:
        """Most rows one call may write and later roll back: a verification of the full block."""
        return self.gamma + 1
