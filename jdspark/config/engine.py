"""`EngineConfig`: the serving-time sizes that fix the decode state's static shapes."""

from __future__ import annotations

import dataclasses

from jdspark.config.base import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving-time sizes that fix the decode state's static shapes.

    `max_seq_len` bounds prompt + generated tokens per slot; `gamma` is the DSpark block size, so one
    verification writes up to gamma + 1 rows ahead of the committed frontier; `max_batch` is the
    number of sequence slots.
    """

    max_seq_len: int = 4096
    gamma: int = 5
    max_batch: int = 1

    def __post_init__(self):
        for key, low in (("max_seq_len", 1), ("gamma", 0), ("max_batch", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"EngineConfig.{key}={value!r}: must be an integer >= {low}")

    @property
    def rollback_rows(self) -> int:
        """Most rows one call may write and later roll back: a verification of the full block."""
        return self.gamma + 1
