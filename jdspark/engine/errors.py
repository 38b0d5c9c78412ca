"""What the engine refuses, as types: each face maps a type to its own answer (an HTTP code, a CLI
exit status) instead of reading the message."""


class EngineError(ValueError):
    """A request or setting the engine cannot take; the message names the value and the fix."""


class SamplingError(EngineError):
    """A sampling parameter outside its range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled and copied with both arguments (args holds the message alone)
        return type(self), (self.param, str(self))


class PromptError(EngineError):
    """The prompt itself cannot run: empty, not token ids, or an id outside the vocabulary."""


class ContextLengthError(EngineError):
    """Prompt + max_tokens + the speculative rows do not fit max_seq_len."""


class CapacityError(EngineError):
    """Every slot is taken."""
