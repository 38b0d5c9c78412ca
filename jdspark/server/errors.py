"""OpenAI error objects, and the one place where a failure becomes an HTTP status.

Every refusal the client sees is `{"error": {"message", "type", "param", "code"}}`. The engine's
typed errors (`jdspark.engine.errors`) map to statuses by type here, never by reading the message;
a 5xx carries a generic message (the detail goes to the server log).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from jdspark.engine.errors import CapacityError, ContextLengthError, EngineError, PromptError, SamplingError

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal server error; the server log has the detail"
# pydantic's names for the member of a union that failed (`prompt.list[int].0`): not field names
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def clip(text: str, limit: int = 80) -> str:
    """`text` shortened for an error message (a client's 1 MB string is never echoed back)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _fields(loc: tuple) -> list[str]:
    return [str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or "-" in p))]


def field_path(loc: tuple) -> str | None:
    """A pydantic error location as a dotted field path (`messages.1.role`), union tags left out."""
    return ".".join(_fields(loc)) or None


def from_validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the field (e.g. `messages.1.role`): the first of the
    deepest, so that a value no member of a union accepts names the element at fault (`prompt.0`)."""
    errors = e.errors()
    depth = [len(_fields(err["loc"])) for err in errors]
    err = errors[depth.index(max(depth))]
    param = field_path(err["loc"])
    kind = {"extra_forbidden": "unknown field", "missing": "missing field"}.get(err["type"], "invalid value")
    got = "" if err["type"] in ("extra_forbidden", "missing") else f" (got {clip(repr(err.get('input')), 60)})"
    return APIError(400, f"{kind} '{param}': {err['msg']}{got}", param=param, code=err["type"])


def sampling_error(e: SamplingError, renames: dict[str, str] | None = None) -> APIError:
    """A SamplingParams error as a 400 whose param is the parameter it names (or the request's own
    name for it: `renames`, e.g. max_tokens -> max_completion_tokens)."""
    param = (renames or {}).get(e.param, e.param)
    message = str(e)
    if param != e.param and message.startswith(e.param):
        message = param + message[len(e.param):]
    return APIError(400, clip(message, 300), param=param)


def from_engine_error(e: EngineError, prompt_param: str, length_param: str | None = None) -> APIError:
    """The engine's refusal as an HTTP error: a prompt it cannot run is a 400 on the prompt, one that
    does not fit the context a 400 `context_length_exceeded` (param: the max-tokens field the client
    set, else the prompt), a full engine a 429."""
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=length_param or prompt_param, code="context_length_exceeded")
    if isinstance(e, CapacityError):
        return APIError(429, str(e), code="capacity_exceeded", type="rate_limit_error", headers={"Retry-After": "1"})
    if isinstance(e, PromptError):
        return APIError(400, clip(str(e), 300), param=prompt_param)
    return APIError(400, clip(str(e), 300))


def queue_full(message: str) -> APIError:
    return APIError(429, message, code="queue_full", type="rate_limit_error", headers={"Retry-After": "1"})


def engine_failed(message: str) -> APIError:
    """A request that failed while the engine ran it; the scheduler wrote the message (and logged
    the detail)."""
    return APIError(500, message, code="engine_error")


def internal(e: BaseException) -> APIError:
    """An unexpected exception: logged with its traceback, answered with a generic 500."""
    log.error("internal error while serving a request", exc_info=e)
    return APIError(500, INTERNAL_MESSAGE, code="internal_error")
