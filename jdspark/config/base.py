"""What every part of the config package shares: the error type, the storage format of the
non-expert linears and the value sets the validation checks against."""

from __future__ import annotations

import dataclasses

CSA_RATIO = 4  # the reference treats ratio 4 as overlapping CSA with an indexer, any other nonzero as HCA
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
EXPERT_DTYPES = (None, "fp4", "fp8")


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent; the message names the key."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Storage format of the non-expert linears (HF `quantization_config`)."""

    fmt: str = "e4m3"
    scale_fmt: str | None = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_dtype: str = "e8m0"  # "e8m0" (Flash/Pro) or "float32" (the -Base variants)
