"""What the engine refuses, as types: each face maps a type to its own answer (an HTTP code, a CLI
exit status) instead of reading the message."""


class EngineError(ValueError):
    """A request or setting the engine cannot take; the message names the value and the fix."""


class PromptError(EngineError):
    """The prompt itself cannot run: empty, not token ids, or an id outside the vocabulary."""


class ContextLengthError(EngineError):
    """Prompt + max_tokens + the speculative rows do not fit max_seq_len."""


class CapacityError(EngineError):
    """Every slot is taken."""
