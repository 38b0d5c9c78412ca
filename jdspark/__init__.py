"""jdspark: a JAX/Pallas serving engine for DeepSeek-V4 with DSpark speculative decoding."""

from jdspark.checkpoint.loader import load_model
from jdspark.config import DSV4Config, EngineConfig
from jdspark.engine.request import Completion, SamplingParams
from jdspark.generator import Generator
from jdspark.model.model import Model

__all__ = ["Completion", "DSV4Config", "EngineConfig", "Generator", "Model", "SamplingParams", "load_model"]
__version__ = "0.1.0"
