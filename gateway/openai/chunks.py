"""A streamed answer's bytes: the SSE events of each output, in the endpoint's chunk format.

Chunks come from byte templates prepared once per request: per token only the text (one JSON string
encoding), the choice index and the finish reason are filled in, byte for byte what building the
pydantic chunk (`ChatCompletionChunk` / `CompletionResponse`), `model_dump` and
`json.dumps(..., separators=(",", ":"), ensure_ascii=False)` give (tests/gateway/test_chunks.py holds
them equal) at a tenth of the cost. An output the template cannot express (`templated` is False: one
that carries logprobs) takes the general path: the pydantic chunk, encoded by `sse_event`. A field
added to an output belongs in `templated` first, then in the general path. A request that asked for
tool calls or logprobs (its `AnswerShape` is not plain) takes the general path for every output
(`ShapedChatChunks`, `ShapedCompletionChunks`).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from engine import RequestOutput
from gateway import jsonio
from gateway.openai import tools
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.logprobs import chat_logprobs, completion_logprobs
from gateway.openai.schema import (
    SYSTEM_FINGERPRINT,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    FunctionCallDelta,
    ToolCallDelta,
)
from gateway.openai.shape import AnswerShape

DONE = b"data: [DONE]\n\n"


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


# ---------------------------------------------------------------- tool calls and logprobs (the general path)


class ShapedChatChunks(ChatChunks):
    """Chat chunks with tool-call deltas and per-token logprobs (the general path)."""

    def __init__(self, rid: str, created: int, model: str, include_usage: bool, shape: AnswerShape):
        super().__init__(rid, created, model, include_usage)
        self.shape = shape
        self._streamers: dict[int, tools.ToolCallStreamer] = {}

    def _chunk(self, index: int, delta: ChatDelta, finish: str | None = None,
               out: RequestOutput | None = None) -> bytes:
        t = self._t
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish)
        if out is not None and out.logprobs and self.shape.top_logprobs is not None and self.shape.pieces:
            choice.logprobs = chat_logprobs(self.shape.pieces, out.logprobs, self.shape.top_logprobs)
        d = ChatCompletionChunk(id=t.rid, created=t.created, model=t.model, choices=[choice]).model_dump()
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not t.include_usage:
            d.pop("usage")
        return sse_event(d)

    def events(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[bytes]:
        if self.shape.plain:
            return super().events(index, out, acc)
        events = []
        if not acc.started:
            acc.started = True
            events.append(self._chunk(index, ChatDelta(role="assistant", content="")))
        if self.shape.tools is None:
            if out.text or out.logprobs:
                events.append(self._chunk(index, ChatDelta(content=out.text), out=out))
            if out.finished:
                events.append(self._chunk(index, ChatDelta(), out.finish_reason))
            return events
        streamer = self._streamers.setdefault(index, tools.ToolCallStreamer(self.shape.ids(index),
                                                                            self.shape.call_names))
        parts = streamer.feed(out.text) if out.text else []
        if out.finished:
            parts += streamer.finish(cut=out.finish_reason == "length")
        for p in parts:
            if isinstance(p, tools.ContentDelta):
                events.append(self._chunk(index, ChatDelta(content=p.text)))
            else:
                events.append(self._chunk(index, ChatDelta(tool_calls=[ToolCallDelta(
                    index=p.index, id=p.id, type="function" if p.id else None,
                    function=FunctionCallDelta(name=p.name, arguments=p.arguments))])))
        if out.finished:
            reason = "tool_calls" if streamer.made_calls and out.finish_reason == "stop" else out.finish_reason
            events.append(self._chunk(index, ChatDelta(), reason))
        return events


class ShapedCompletionChunks(CompletionChunks):
    def __init__(self, rid: str, created: int, model: str, include_usage: bool, shape: AnswerShape):
        super().__init__(rid, created, model, include_usage)
        self.shape = shape
        self._offsets: dict[int, int] = {}

    def events(self, index: int, out: RequestOutput, acc: ChoiceAcc) -> list[bytes]:
        if self.shape.top_logprobs is None or self.shape.pieces is None:
            return super().events(index, out, acc)
        if not out.text and not out.finished and not out.logprobs:
            return []
        t = self._t
        offset = self._offsets.get(index, 0)
        lp = completion_logprobs(self.shape.pieces, out.logprobs or [], self.shape.top_logprobs, offset)
        self._offsets[index] = offset + len(out.text)
        d = CompletionResponse(id=t.rid, created=t.created, model=t.model, choices=[
            CompletionChoice(index=index, text=out.text, finish_reason=out.finish_reason if out.finished else None,
                             logprobs=lp)]).model_dump()
        if not t.include_usage:
            d.pop("usage")
        return [sse_event(d)]
