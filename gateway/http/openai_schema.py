"""OpenAI request and response shapes (the subset Sluice serves), validated at the boundary.

Requests are parsed strictly from JSON (`"1"` is not a number) and every range follows OpenAI's spec
(openapi-subset.json). Nothing a client sends is silently dropped: a field is either applied or refused
with a 400 that names it. Fields of OpenAI's API that Sluice does not implement yet are declared here
only so that their harmless values (null, the documented default) pass; any other value is refused, and
so is any field that is not part of the API at all. Only text is supported: a non-text content part is
a 400 too.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_STOP = 4
MAX_STOP_CHARS = 1024  # one stop string; the output processor holds back this much text
MAX_STOP_TOKEN_IDS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

Number = Annotated[float, Field(allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _refuse_unless(value: Any, allowed: tuple[Any, ...], field: str, why: str = "") -> Any:
    """For OpenAI fields Sluice does not implement: only values that change nothing pass."""
    if value is not None and value not in allowed:
        raise ValueError(f"`{field}` is not supported by Sluice{why}; remove it"
                         + (f" or send one of {list(allowed)}" if allowed else ""))
    return value


class TextPart(_Request):
    type: str
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(f"content part type {data.get('type')!r} is not supported; only 'text' parts are")
        return data


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def to_template(self) -> dict[str, str]:
        """The {role, content[, name]} dict the chat template takes; developer is the new name for system.
        The template decides what `name` means (many ignore it, as OpenAI's own models may)."""
        role = "system" if self.role == "developer" else self.role
        out = {"role": role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by chat and legacy completions."""

    model: str
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # vLLM's extra; 0 or -1: off; above the vocabulary: off
    # vLLM's extra: finish (reason "stop") on any of these ids (checked against the vocabulary later)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = False  # vLLM's extra: keep generating past the end-of-sequence token
    # Sluice's extra: what to do with a prompt longer than the context. "error" (default): 400
    # context_length_exceeded. "middle": cut the middle, insert a marker, keep the head and the tail.
    prompt_truncation: Literal["error", "middle"] | None = "error"
    n: int | None = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Not applied by the local engine yet: only 0 (no penalty) passes.
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None
    # An end-user id (OpenAI uses it for abuse monitoring): written to the access log, nothing else.
    user: str | None = Field(None, max_length=256)
    # vLLM's extra: share prefix-cache blocks only with requests of the same salt (within the key's scope)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float | None, info: Any) -> float | None:
        return _refuse_unless(v, (0.0,), info.field_name, " yet (penalties are not applied by the local engine)")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v:
            raise ValueError("`logit_bias` is not supported by Sluice yet; remove it")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
            if any(s == "" for s in v):
                raise ValueError("stop sequences must not be empty")
        for one in [v] if isinstance(v, str) else v or []:
            if len(one) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop] if self.stop else []
        return list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# Chat fields of OpenAI's API that Sluice does not implement yet: the values that change nothing, and why.
_NOT_IMPLEMENTED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((False,), " yet"),
    "top_logprobs": ((0,), " yet"),
    "response_format": (({"type": "text"},), " yet"),
    "tools": (([],), " yet"),
    "tool_choice": (("none",), " yet"),
    "parallel_tool_calls": ((), " without tools"),
    "functions": (([],), ""),
    "function_call": (("none",), ""),
    "audio": ((), ""),
    "modalities": ((["text"],), " beyond text"),
    "prediction": ((), ""),
    "reasoning_effort": ((), ""),
    "verbosity": ((), ""),
    "web_search_options": ((), ""),
    "store": ((False,), " (completions are never stored)"),
    "metadata": (({},), " (it goes with `store`)"),
    "service_tier": (("auto", "default"), " (the tier comes from the API key)"),
    "prompt_cache_key": ((), " (prefix caching is automatic; see `cache_salt`)"),
    "prompt_cache_retention": ((), ""),
    "prompt_cache_options": ((), ""),
    "moderation": ((), ""),
}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # In _NOT_IMPLEMENTED_CHAT: null or a value that changes nothing passes, anything else is a 400.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    safety_identifier: str | None = Field(None, max_length=256)  # like `user`: logged, nothing else

    @field_validator(*_NOT_IMPLEMENTED_CHAT)
    @classmethod
    def _not_implemented(cls, v: Any, info: Any) -> Any:
        allowed, why = _NOT_IMPLEMENTED_CHAT[info.field_name]
        return _refuse_unless(v, allowed, info.field_name, why)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [m.to_template() for m in self.messages]


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)) and len(v) != 1:
                raise ValueError("only one prompt per request is supported; send one request per prompt")
            if isinstance(v[0], list) and len(v[0]) == 0:
                raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("`echo` is not supported by Sluice; remove it")
        if self.logprobs is not None:
            raise ValueError("`logprobs` is not supported by Sluice yet; remove it")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("`best_of` is not supported by Sluice; remove it")
        if self.suffix:
            raise ValueError("`suffix` is not supported by Sluice; remove it")
        return self

    def prompt_text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return list(p)  # type: ignore[arg-type]


# ---------------------------------------------------------------- responses

# OpenAI's field for "the backend configuration that answered"; its schema wants a string, never null.
SYSTEM_FINGERPRINT = "fp_sluice"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str = SYSTEM_FINGERPRINT


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Used for both the full response and stream chunks (OpenAI uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
