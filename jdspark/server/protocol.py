"""The OpenAI request bodies we accept, and their translation to `SamplingParams`.

One strict pydantic model per endpoint: no type coercion (`"5"`, `true` or `1.0` is not an integer,
`"yes"` or `1` not a boolean, `"0.5"` not a number; NaN and infinities are refused) and a bound on
every number, list and name, so that nothing out of range reaches the engine. Every field OpenAI
defines but we do not implement is still declared, so that its neutral value (what clients send by
default: `n=1`, `logprobs=null`, `echo=false`, ...) passes and any other value gets a 400 that names
the field; a field OpenAI does not define at all is rejected (`extra="forbid"`). `ignore_eos` and
`top_k` are the usual vLLM extensions; `allow_special_tokens` lets a completions prompt written as
text carry control tokens (without it, their strings are plain text).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jdspark.engine.errors import SamplingError
from jdspark.engine.request import SamplingParams
from jdspark.server.errors import APIError, from_validation_error, sampling_error

INT32_MAX = 2 ** 31 - 1
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # stop strings per request, characters per stop string
MAX_TOOLS = 128  # OpenAI's limit
MAX_NAME_CHARS = 256  # model names, ids, user tags
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class StreamOptions(BaseModel):
    model_config = STRICT
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

    model_config = STRICT
    model: str | None = None  # an unknown name is a 404 (clipped in the message)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    seed: int | None = Field(None, ge=0, lt=2 ** 32)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int | None = Field(None, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    user: Name | None = None

    def check_neutral(self) -> None:
        for name, allowed in NEUTRAL.items():
            value = getattr(self, name, None)
            if allowed is not None and value not in allowed:
                raise APIError(400, f"{name}={value!r} is not supported by jdspark (accepted: "
                               f"{', '.join(repr(a) for a in allowed if a is not None)} or omit it)", param=name,
                               code="unsupported_parameter")

    def sampling(self, max_tokens: int, vocab_size: int, renames: dict[str, str] | None = None) -> SamplingParams:
        """SamplingParams of this request (OpenAI defaults: temperature 1, top_p 1). A top_k of the
        vocabulary size or more keeps every token: it is off (0). `renames`: this request's names
        for SamplingParams fields, used in errors."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = self.top_k or 0
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                                  top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k if top_k < vocab_size else 0,
                                  seed=self.seed, stop=tuple(stop), ignore_eos=self.ignore_eos)
        except SamplingError as e:
            raise sampling_error(e, renames) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool | None = None
    suffix: str | None = None
    allow_special_tokens: bool = False

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
    model_config = ConfigDict(strict=True)
    name: Name
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: Name | None = None
    type: Literal["function"] = "function"
    function: ToolFunction


class Message(BaseModel):
    """A chat message; `content` may be a string or a list of text parts."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None
    name: Name | None = None

    def text(self, where: str) -> str:
        """The content as one string; only an assistant message (which may be all tool calls) may
        lack it."""
        if self.content is None:
            if self.role != "assistant":
                raise APIError(400, f"{where}.content: a {self.role} message needs content (a string or a list "
                               "of text parts)", param=f"{where}.content")
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.content.{i}: only text parts are supported, got type "
                               f"{part.get('type')!r}", param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]  # OpenAI's names (and dots)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionSpec


class ChatTemplateKwargs(BaseModel):
    """vLLM / SGLang's way to switch DSV4's thinking mode (`{"thinking": true}`)."""

    model_config = STRICT
    thinking: bool = False
    reasoning_effort: Literal["high", "max"] | None = None


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
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
    def max_tokens_field(self) -> str | None:
        """The name of the max-tokens field the client set (None if neither)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else \
            "max_tokens" if self.max_tokens is not None else None

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
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_body")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    request.check_neutral()
    return request
