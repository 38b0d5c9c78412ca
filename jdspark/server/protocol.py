"""The OpenAI request bodies we accept, their translation to `SamplingParams`, and OpenAI error objects.

Every field OpenAI defines but we do not implement is still declared, so that its neutral value
(what clients send by default: `n=1`, `logprobs=null`, `echo=false`, ...) passes and any other value
gets a 400 that names the field; a field OpenAI does not define at all is rejected by pydantic
(`extra="forbid"`). `ignore_eos` and `top_k` are the usual vLLM extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from jdspark.engine.request import SamplingParams


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (e.g. `messages.1.role`)."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    kind = "unknown field" if err["type"] == "extra_forbidden" else "invalid value"
    got = "" if err["type"] in ("extra_forbidden", "missing") else f" (got {err.get('input')!r:.60})"
    return APIError(400, f"{kind} '{param}': {err['msg']}{got}", param=param, code=err["type"])


def sampling_error(e: ValueError) -> APIError:
    """SamplingParams' ValueError ('name=value: must be ...') as a 400 whose param is that name."""
    message = str(e)
    param = message.split("=", 1)[0] if "=" in message.split(":", 1)[0] else None
    return APIError(400, message, param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


# fields OpenAI defines that we accept only at their neutral value: name -> allowed values
NEUTRAL = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "suffix": (None, ""), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "user": None, "parallel_tool_calls": None, "response_format": (None, {"type": "text"}),
}


class _Common(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int | None = None
    best_of: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_neutral(self) -> None:
        for name, allowed in NEUTRAL.items():
            value = getattr(self, name, None)
            if allowed is not None and value not in allowed:
                raise APIError(400, f"{name}={value!r} is not supported by jdspark (accepted: "
                               f"{', '.join(repr(a) for a in allowed if a is not None)} or omit it)", param=name,
                               code="unsupported_parameter")

    def sampling(self, max_tokens: int) -> SamplingParams:
        """SamplingParams of this request (OpenAI defaults: temperature 1, top_p 1)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                                  stop=tuple(stop), ignore_eos=self.ignore_eos)
        except ValueError as e:
            raise sampling_error(e) from None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: a batch of {len(p)} prompts is not supported; send one prompt per "
                               "request", param="prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return p


class ToolFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class Message(BaseModel):
    """A chat message; `content` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self, where: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.content.{i}: only text parts are supported, got type "
                               f"{part.get('type')!r}", param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class ChatTemplateKwargs(BaseModel):
    """vLLM / SGLang's way to switch DSV4's thinking mode (`{"thinking": true}`)."""

    model_config = ConfigDict(extra="forbid")
    thinking: bool = False
    reasoning_effort: Literal["high", "max"] | None = None


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    reasoning_effort: Literal["high", "max"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def thinking(self) -> bool:
        return self.chat_template_kwargs is not None and self.chat_template_kwargs.thinking

    @property
    def effort(self) -> str | None:
        kwargs = self.chat_template_kwargs
        return self.reasoning_effort or (kwargs.reasoning_effort if kwargs else None)

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    request.check_neutral()
    return request
