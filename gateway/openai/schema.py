"""OpenAI request and response shapes (the subset Sluice serves), validated at the boundary.

Requests are parsed strictly from JSON (`"1"` is not a number) and every range follows OpenAI's spec
(openapi-subset.json). Nothing a client sends is silently dropped: a field is either applied or refused
with a 400 that names it. Fields of OpenAI's API that Sluice does not implement are declared here only
so that their harmless values (null, the documented default) pass; any other value is refused, and so is
any field that is not part of the API at all. What the local model cannot serve (an image part for a
text-only model) is named by `local_unsupported()`: the router sends such a request to a remote provider
that serves the model, else it is a 400 naming the field.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.openai import tools

MAX_N = 16
MAX_STOP = 4
MAX_STOP_CHARS = 1024  # one stop string; the output processor holds back this much text
MAX_STOP_TOKEN_IDS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

Number = Annotated[float, Field(allow_inf_nan=False)]
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: canonical ASCII decimal (`\d` takes any script's digits)


def _token_id_problem(key: str) -> str | None:
    """Why a logit_bias key is not a token id (None: it is one). One spelling per id: were "028" or "２８"
    read as 28, two keys could bias one token and one of them silently win."""
    if len(key) > len(str(INT32_MAX)) or not _TOKEN_ID.fullmatch(key):
        return 'write it in ASCII decimal digits without a sign, spaces or leading zeros (e.g. "28")'
    if int(key) > INT32_MAX:
        return f"the largest token id is {INT32_MAX}"
    return None


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _refuse_unless(value: Any, allowed: tuple[Any, ...], field: str, why: str = "") -> Any:
    """For OpenAI fields Sluice does not implement: only values that change nothing pass."""
    if value is not None and value not in allowed:
        raise ValueError(f"`{field}` is not supported by Sluice{why}; remove it"
                         + (f" or send one of {list(allowed)}" if allowed else ""))
    return value


CONTENT_PART_TYPES = ("text", "image_url", "input_audio", "file")


class ContentPart(_Request):
    """A message content part. Text is served locally; the other kinds only by a remote provider."""

    type: Literal["text", "image_url", "input_audio", "file"]
    text: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in CONTENT_PART_TYPES:
            raise ValueError(f"content part type {data.get('type')!r} is not supported; "
                             f"use one of {', '.join(CONTENT_PART_TYPES)}")
        return data

    @model_validator(mode="after")
    def _payload(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"a {self.type} content part needs its '{self.type}' field")
        return self


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCallParam(_Request):
    """A call an earlier assistant turn made (sent back by the client with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # What the SDK sends back when a client appends a response's message as is: only null passes.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id' (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        if self.annotations:
            raise ValueError("'annotations' on a message are not supported; remove them")
        return self

    def non_text_part(self) -> str | None:
        """The type of the first content part that is not text (None: all text)."""
        if isinstance(self.content, list):
            for p in self.content:
                if p.type != "text":
                    return p.type
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content if p.type == "text")

    def to_template(self) -> dict[str, str]:
        """The {role, content[, name]} dict the chat template takes; developer is the new name for system.
        The template decides what `name` means (many ignore it, as OpenAI's own models may). Tool calls
        and tool results are rendered in the Hermes format (gateway/openai/tools.py)."""
        role = "system" if self.role == "developer" else self.role
        content = self.text()
        if self.tool_calls:
            calls = "\n".join(tools.render_call(c.function.name, c.function.arguments) for c in self.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        if self.role == "tool":
            content = tools.render_tool_result(content)
        out = {"role": role, "content": content}
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
    # vLLM's extra: finish (reason "stop") on any of these ids (the engine refuses ids outside its vocabulary)
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
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    # token id (as a string, as OpenAI's JSON has it) -> bias added to its logit; -100 bans it
    logit_bias: dict[str, Annotated[Number, Field(ge=-100.0, le=100.0)]] | None = Field(None, max_length=1024)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=10.0)  # vLLM's extra (1: off)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)  # vLLM's extra: no end before this many tokens
    # An end-user id (OpenAI uses it for abuse monitoring): written to the access log, nothing else.
    user: str | None = Field(None, max_length=256)
    # vLLM's extra: share prefix-cache blocks only with requests of the same salt (within the key's scope)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            why = _token_id_problem(key)
            if why is not None:
                shown = repr(key) if len(key) <= 32 else repr(key[:32]) + "..."
                raise ValueError(f"logit_bias keys are token ids; {shown} is not one: {why}")
        return v

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

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


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")
        return self


# Chat fields of OpenAI's API that Sluice does not implement: the values that change nothing, and why.
_NOT_IMPLEMENTED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
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
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # In _NOT_IMPLEMENTED_CHAT: null or a value that changes nothing passes, anything else is a 400.
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
    # vLLM's extras: `continue_final_message` leaves the last (assistant) message open and continues its
    # text (how a stream broken on one engine replica is resumed on another); `add_generation_prompt`
    # false renders the conversation without the assistant turn's opening.
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = True

    @model_validator(mode="after")
    def _continue_an_assistant_message(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if self.add_generation_prompt is not False:
                raise ValueError("`continue_final_message` needs `add_generation_prompt: false` (the final message "
                                 "is continued, no new turn is opened)")
            if self.messages[-1].role != "assistant":
                raise ValueError("`continue_final_message` needs the last message to be the assistant's")
        return self

    @field_validator(*_NOT_IMPLEMENTED_CHAT)
    @classmethod
    def _not_implemented(cls, v: Any, info: Any) -> Any:
        allowed, why = _NOT_IMPLEMENTED_CHAT[info.field_name]
        return _refuse_unless(v, allowed, info.field_name, why)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: Any) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("`top_logprobs` needs `logprobs: true`")
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[ToolParam] | None) -> list[ToolParam] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("each function needs its own name")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, v: Any, info: Any) -> Any:
        names = {t.function.name for t in info.data.get("tools") or []}
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"`tool_choice` names `{v.function.name}`, which is not in `tools`")
        if v == "required" and not names:
            raise ValueError("`tool_choice` `required` needs `tools`")
        return v

    def unanswered_tool_message(self) -> tuple[int, str] | None:
        """(index, why) of the first `tool` message that answers no call of the assistant message it
        follows, else None. OpenAI's rule: tool messages come right after an assistant message with
        `tool_calls` (other tool messages between), each naming one of its calls."""
        calls: set[str] | None = None  # the call ids of the assistant message the current tool messages follow
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                if calls is None:
                    return i, (f"no call {m.tool_call_id!r} precedes this tool message: a tool message must "
                               "follow an assistant message with `tool_calls` and answer one of its calls")
                if m.tool_call_id not in calls:
                    return i, (f"{m.tool_call_id!r} is not the id of a call in the `tool_calls` of the assistant "
                               f"message before it (those are: {', '.join(sorted(calls))})")
            elif m.role == "assistant" and m.tool_calls:
                calls = {c.id for c in m.tool_calls}
            else:
                calls = None
        return None

    def local_unsupported(self) -> str | None:
        """The first field the local text model cannot serve (a request with one goes remote or is a 400)."""
        for i, m in enumerate(self.messages):
            kind = m.non_text_part()
            if kind is not None:
                return f"messages.{i}.content ({kind} part)"
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [m.to_template() for m in self.messages]

    def template_options(self) -> dict[str, bool]:
        """How the chat template renders the conversation (vLLM's two extras), for the tokenizer."""
        return {"add_generation_prompt": self.add_generation_prompt is not False,
                "continue_final_message": bool(self.continue_final_message)}


TokenIds = list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    # Structured output on legacy completions (vLLM's extras): a JSON schema, or OpenAI's response_format.
    guided_json: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

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
        if self.guided_json is not None and self.response_format is not None:
            raise ValueError("send `guided_json` or `response_format`, not both")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("`best_of` is not supported by Sluice; remove it")
        if self.suffix:
            raise ValueError("`suffix` is not supported by Sluice; remove it")
        return self

    def local_unsupported(self) -> str | None:
        return None

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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None  # left out of the JSON when None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str = SYSTEM_FINGERPRINT


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


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


def engine_only_fields(api: BaseModel | None) -> list[str]:
    """The fields of vLLM's and Sluice's extras this request sets to a value that changes its answer: an
    engine applies them (the local one, a vLLM/SGLang/Sluice replica), an OpenAI-style provider does not
    know them, so a request that sets one is never relayed to a provider with the field dropped."""
    if api is None:
        return []
    v = api.__dict__
    out = []
    if v.get("top_k") not in (None, 0, -1):
        out.append("top_k")
    if v.get("stop_token_ids"):
        out.append("stop_token_ids")
    if v.get("ignore_eos"):
        out.append("ignore_eos")
    if v.get("prompt_truncation") == "middle":
        out.append("prompt_truncation")
    if v.get("repetition_penalty") not in (None, 1, 1.0):
        out.append("repetition_penalty")
    if v.get("min_tokens"):
        out.append("min_tokens")
    if v.get("guided_json") is not None:
        out.append("guided_json")
    if v.get("continue_final_message"):
        out.append("continue_final_message")
    if v.get("add_generation_prompt") is False:
        out.append("add_generation_prompt")
    return out
