"""OpenAI request and response shapes (the subset Sluice serves), validated at the boundary.

Requests are parsed strictly from JSON (`"1"` is not a number), unknown fields are ignored because
the SDK sends some we do not use, and every range follows OpenAI's spec (openapi-subset.json).
Only text is supported: a non-text content part is a 400, never silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_STOP = 4

Number = Annotated[float, Field(allow_inf_nan=False)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Request):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "TextPart":
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported; only 'text' parts are")
        if self.text is None:
            raise ValueError("a text content part needs a 'text' string")
        return self


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
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
        """The plain {role, content} dict the chat template takes; developer is the new name for system."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by chat and legacy completions."""

    model: str
    temperature: Number | None = Field(None, ge=0.0, le=2.0)
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None  # vLLM's extra; 0 or less: off
    stop_token_ids: list[int] | None = None  # vLLM's extra: finish (reason "stop") on any of these ids
    ignore_eos: bool | None = False  # vLLM's extra: keep generating past the end-of-sequence token
    # Sluice's extra: what to do with a prompt longer than the context. "error" (default): 400
    # context_length_exceeded. "middle": cut the middle, insert a marker, keep the head and the tail.
    prompt_truncation: Literal["error", "middle"] | None = "error"
    n: int | None = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
            if any(s == "" for s in v):
                raise ValueError("stop sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [m.to_template() for m in self.messages]


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
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
    def _unsupported(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
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
    system_fingerprint: str | None = None


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
    system_fingerprint: str | None = None


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
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
