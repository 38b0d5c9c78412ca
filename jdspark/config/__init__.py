"""Configuration: the model config read from a checkpoint, the drafter's settings, the engine sizes.

- `model_config`: `DSV4Config` (HF names) and its validation;
- `vocab`, `vocab_hf`, `vocab_transformers`, `vocab_official`: the readers (and writers) of the
  checkpoint vocabularies;
- `dspark`: `DSparkConfig`, parsed once into `DSV4Config.dspark`;
- `engine`: `EngineConfig`;
- `presets`: `tiny_config`, `tiny_dspark_config`, `tiny_code_config`, `flash_config`, `pro_config`;
- `base`: `ConfigError`, `QuantConfig` and the value sets.
"""

from jdspark.config.base import CSA_RATIO, EXPERT_DTYPES, SCORING_FUNCS, ConfigError, QuantConfig
from jdspark.config.dspark import DSparkConfig
from jdspark.config.engine import EngineConfig
from jdspark.config.model_config import DSV4Config
from jdspark.config.presets import flash_config, pro_config, tiny_code_config, tiny_config, tiny_dspark_config

__all__ = [
    "CSA_RATIO", "EXPERT_DTYPES", "SCORING_FUNCS", "ConfigError", "DSV4Config", "DSparkConfig", "EngineConfig",
    "QuantConfig", "flash_config", "pro_config", "tiny_code_config", "tiny_config", "tiny_dspark_config",
]
