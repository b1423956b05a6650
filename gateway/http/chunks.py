"""The answer's bytes in the endpoint's format: SSE events for a stream, a dict for a JSON answer.

Streamed chunks come from byte templates prepared once per request: per token only the text (one
JSON string encoding), the choice index and the finish reason are filled in, byte for byte what
building the pydantic chunk (`ChatCompletionChunk` / `CompletionResponse`), `model_dump` and
`json.dumps(..., separators=(",", ":"), ensure_ascii=False)` give (tests/gateway/test_chunks.py holds
them equal) at a tenth of the cost. An output the template cannot express (`templated` is False: one
that carries logprobs, and later tool calls) takes the general path: the pydantic chunk, encoded by
`sse_event`. A field added to an output belongs in `templated` first, then in the general path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.request import RequestOutput, TokenLogprob
from gateway import jsonio
from gateway.http.openai_schema import (
    SYSTEM_FINGERPRINT,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)

DONE = b"data: [DONE]\n\n"


@dataclass
class ChoiceAcc:
    """What one choice produced so far."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    finished: bool = False
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


@dataclass(frozen=True)
class TokenUsage:
    """The `usage` object of an answer."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, accs: list[ChoiceAcc]) -> TokenUsage:
        return cls(prompt_tokens, sum(a.completion_tokens for a in accs),
                   max((a.cached_tokens for a in accs), default=0))

    def as_dict(self) -> dict[str, object]:
        """Equal to `Usage(...).model_dump()`."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def model(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def json(self) -> bytes:
        return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":' \
               b'{"cached_tokens":%d}}' % (self.prompt_tokens, self.completion_tokens,
                                           self.prompt_tokens + self.completion_tokens, self.cached_tokens)


def sse_event(obj: dict[str, Any] | str) -> bytes:
    """One SSE event, the general path: `json.dumps` compact, non-ASCII kept."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def templated(out: RequestOutput) -> bool:
    """True when the chunk template expresses everything `out` carries (text, finish reason)."""
    return out.logprobs is None


def _js(s: str) -> bytes:
    """A JSON string, as `json.dumps(s, ensure_ascii=False)` encodes it."""
    return jsonio.dumps(s)


def _finish(reason: str | None) -> bytes:
    return b"null" if reason is None else _js(reason)


class ChunkEncoder(Protocol):
    """One request's SSE events."""

    def events(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[bytes]: ...

    def usage_event(self, usage: TokenUsage) -> bytes: ...


class _Template:
    """`data: {"id":..,"object":..,"created":..,"model":..,"choices":[{"index":` ... tail."""

    def __init__(self, rid: str, created: int, model: str, obj: str, include_usage: bool):
        self.rid, self.created, self.model, self.include_usage = rid, created, model, include_usage
        self.head = (b'{"id":' + _js(rid) + b',"object":' + _js(obj) + b',"created":' + str(created).encode()
                     + b',"model":' + _js(model))
        self.choice = b"data: " + self.head + b',"choices":[{"index":'
        self.tail = (b',"logprobs":null}]' + (b',"usage":null' if include_usage else b"")
                     + b',"system_fingerprint":' + _js(SYSTEM_FINGERPRINT) + b"}\n\n")

    def usage_event(self, usage: TokenUsage) -> bytes:
        return (b"data: " + self.head + b',"choices":[],"usage":' + usage.json()
                + b',"system_fingerprint":' + _js(SYSTEM_FINGERPRINT) + b"}\n\n")


# ---------------------------------------------------------------- chat.completion.chunk

_ROLE_DELTA = b'{"role":"assistant","content":""}'


class ChatChunks:
    def __init__(self, rid: str, created: int, model: str, include_usage: bool):
        self._t = _Template(rid, created, model, "chat.completion.chunk", include_usage)

    def _event(self, index: int, delta: bytes, finish: str | None) -> bytes:
        t = self._t
        return b"".join((t.choice, b"%d" % index, b',"delta":', delta, b',"finish_reason":', _finish(finish), t.tail))

    def events(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[bytes]:
        if not templated(out):
            return [sse_event(d) for d in self.dicts(index, out, acc)]
        events = []
        if not acc.started:
            acc.started = True
            events.append(self._event(index, _ROLE_DELTA, None))
        if out.text:
            events.append(self._event(index, b'{"content":' + _js(out.text) + b"}", None))
        if out.finished:
            events.append(self._event(index, b"{}", out.finish_reason))
        return events

    def usage_event(self, usage: TokenUsage) -> bytes:
        return self._t.usage_event(usage)

    # the general path

    def _dict(self, index: int, delta: ChatDelta, finish: str | None = None) -> dict[str, Any]:
        t = self._t
        d = ChatCompletionChunk(id=t.rid, created=t.created, model=t.model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish)]).model_dump()
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not t.include_usage:
            d.pop("usage")
        return d

    def dicts(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[dict[str, Any]]:
        chunks = []
        if not acc.started:
            acc.started = True
            chunks.append(self._dict(index, ChatDelta(role="assistant", content="")))
        if out.text:
            chunks.append(self._dict(index, ChatDelta(content=out.text)))
        if out.finished:
            chunks.append(self._dict(index, ChatDelta(), out.finish_reason))
        return chunks

    def usage_dict(self, usage: TokenUsage) -> dict[str, Any]:
        t = self._t
        return ChatCompletionChunk(id=t.rid, created=t.created, model=t.model, choices=[],
                                   usage=usage.model()).model_dump()


# ---------------------------------------------------------------- text_completion (legacy completions)


class CompletionChunks:
    def __init__(self, rid: str, created: int, model: str, include_usage: bool):
        self._t = _Template(rid, created, model, "text_completion", include_usage)

    def events(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[bytes]:
        if not out.text and not out.finished:
            return []
        if not templated(out):
            return [sse_event(d) for d in self.dicts(index, out, acc)]
        t = self._t
        return [b"".join((t.choice, b"%d" % index, b',"text":', _js(out.text), b',"finish_reason":',
                          _finish(out.finish_reason if out.finished else None), t.tail))]

    def usage_event(self, usage: TokenUsage) -> bytes:
        return self._t.usage_event(usage)

    # the general path

    def dicts(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[dict[str, Any]]:  # noqa: ARG002
        if not out.text and not out.finished:
            return []
        t = self._t
        d = CompletionResponse(id=t.rid, created=t.created, model=t.model, choices=[
            CompletionChoice(index=index, text=out.text, finish_reason=out.finish_reason if out.finished else None)
        ]).model_dump()
        if not t.include_usage:
            d.pop("usage")
        return [d]

    def usage_dict(self, usage: TokenUsage) -> dict[str, Any]:
        t = self._t
        return CompletionResponse(id=t.rid, created=t.created, model=t.model, choices=[],
                                  usage=usage.model()).model_dump()


# ---------------------------------------------------------------- JSON answers (equal to the pydantic models' dumps)


def chat_response(rid: str, created: int, model: str, accs: list[ChoiceAcc], usage: TokenUsage) -> dict[str, object]:
    """`ChatCompletionResponse(...).model_dump()` (a message's `tool_calls` left out when None), built
    directly; a choice with logprobs or tool calls needs those fields added here."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": "".join(a.text), "refusal": None},
                         "finish_reason": a.finish_reason, "logprobs": None} for i, a in enumerate(accs)],
            "usage": usage.as_dict(), "system_fingerprint": SYSTEM_FINGERPRINT}


def completion_response(rid: str, created: int, model: str, accs: list[ChoiceAcc],
                        usage: TokenUsage) -> dict[str, object]:
    """`CompletionResponse(...).model_dump()`, built directly."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": "".join(a.text), "finish_reason": a.finish_reason, "logprobs": None}
                        for i, a in enumerate(accs)],
            "usage": usage.as_dict(), "system_fingerprint": SYSTEM_FINGERPRINT}
