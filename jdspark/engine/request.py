"""What a user asks for (`SamplingParams`) and what they get back: a `Delta` per engine call, the
last one carrying the whole `Completion`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jdspark.config import EngineConfig
from jdspark.engine.errors import ContextLengthError, PromptError, SamplingError
from jdspark.engine.stats import CompletionStats


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy, and so is any temperature below 1e-5
    (`speculative.sampling.MIN_TEMPERATURE`, vLLM's floor); top_k 0 and top_p 1 are off. `stop` strings
    end the text (needs a tokenizer); `stop_token_ids` and the model's EOS end the token stream."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _number(self.temperature) and self.temperature >= 0, "a number >= 0 (< 1e-5 is greedy)"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and 0 <= self.top_k < 2 ** 31, "an integer in [0, 2**31) (0 is off)"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 32),
             "None or an integer in [0, 2**32)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise SamplingError(name, f"{name}={getattr(self, name)!r}: must be {expected}")


def _number(x) -> bool:
    """A real, finite number (bools, NaN and infinities are not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    text: str | None  # None without a tokenizer
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length" (max_tokens)
    stats: CompletionStats


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one request received from one engine call: its new tokens and the text they complete.
    The last delta of a request has `finish_reason` ("stop", "length" or "error", with `error`) and
    the `completion`; the engine has then released the request's slot."""

    request_id: int
    tokens: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    completion: Completion | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: "Delta") -> "Delta":
        """This delta and the request's next one as one (two calls read in one step)."""
        return dataclasses.replace(later, tokens=self.tokens + later.tokens, text=self.text + later.text)


def room(config: EngineConfig, prompt_len: int) -> int:
    """The most tokens a request with a prompt of `prompt_len` tokens may generate under `config`."""
    return config.max_seq_len - config.rollback_rows - prompt_len


def check_prompt(prompt_ids, params: SamplingParams, vocab_size: int, config: EngineConfig) -> np.ndarray:
    """The prompt as int32 ids, or PromptError (empty, not ids, an id outside the vocabulary) or
    ContextLengthError (prompt + max_tokens + speculative rows over max_seq_len)."""
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise PromptError(f"the prompt must be a non-empty list of token ids, got {prompt_ids!r:.80}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise PromptError(f"token id {int(ids[(ids < 0) | (ids >= vocab_size)][0])} is outside the vocabulary "
                          f"[0, {vocab_size})")
    if params.max_tokens > room(config, len(ids)):
        need = len(ids) + params.max_tokens + config.rollback_rows
        raise ContextLengthError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) + "
                                 f"{config.rollback_rows} speculative rows = {need} exceeds max_seq_len="
                                 f"{config.max_seq_len}; shorten the prompt, lower max_tokens or raise max_seq_len")
    return ids.astype(np.int32)
