"""What a request asks of its answer beyond text: tool calls parsed out of it and log-probabilities.
Requests that ask for neither keep the byte-template fast path (http/chunks.py); these take the general
path, built from the pydantic chunk models."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.request import Guide, RequestOutput
from gateway.errors import APIError
from gateway.http import tools
from gateway.http.chunks import ChatChunks, ChoiceAcc, CompletionChunks, TokenUsage, chat_response, sse_event
from gateway.http.logprobs import TokenPieces, chat_logprobs, completion_logprobs
from gateway.http.openai_schema import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionCallDelta,
    NamedToolChoice,
    ResponseFormat,
    ToolCallDelta,
)


@dataclass
class AnswerShape:
    tools: list[tools.ToolSpec] | None = None  # answers are parsed for tool calls
    call_names: list[str] = field(default_factory=list)  # the functions the grammar lets an answer call
    tool_grammar: bool = False  # the answer's grammar is the tool calls' (not response_format's)
    top_logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    pieces: TokenPieces | None = None
    call_ids: list[list[str]] = field(default_factory=list)  # per choice: ids, equal in stream and JSON

    @property
    def plain(self) -> bool:
        return self.tools is None and self.top_logprobs is None

    def ids(self, index: int) -> list[str]:
        while len(self.call_ids) <= index:
            self.call_ids.append([tools.new_call_id() for _ in range(16)])
        return self.call_ids[index]


def _format_guide(rf: ResponseFormat | None, no_schema: dict[str, Any]) -> Guide | None:
    """The grammar of a `response_format` (None for text); `no_schema`: a json_schema sent without one."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Guide(kind="json_object")
    schema = rf.json_schema.schema_ if rf.json_schema is not None else None
    return Guide(kind="json_schema", spec=json.dumps(schema or no_schema))


def _refuse_incoherent(req: ChatCompletionRequest) -> None:
    """The request-wide rules a field validator cannot refuse with the field's own `param`."""
    if req.tools and req.response_format is not None and req.response_format.type != "text" \
            and req.tool_choice not in (None, "none"):
        raise APIError(400, "response_format: response_format and tool calls cannot both constrain one answer; "
                            "send one of them", param="response_format", code="unsupported_parameter")
    unanswered = req.unanswered_tool_message()
    if unanswered is not None:
        index, why = unanswered
        param = f"messages.{index}.tool_call_id"
        raise APIError(400, f"{param}: {why}", param=param, code="invalid_value")


def chat_shape(req: ChatCompletionRequest, pieces: TokenPieces | None) -> tuple[AnswerShape, Guide | None,
                                                                                list[tools.ToolSpec] | None]:
    """The answer's shape, the grammar that constrains it, and the tools to render into the prompt
    (a 400 for a request whose parts contradict each other)."""
    _refuse_incoherent(req)
    top = (req.top_logprobs or 0) if req.logprobs else None
    guide: Guide | None = None
    specs = None
    names: list[str] = []
    if req.tools and req.tool_choice != "none":
        specs = [tools.ToolSpec(t.function.name, t.function.description or "",
                                t.function.parameters or {"type": "object", "properties": {}}) for t in req.tools]
        parallel = req.parallel_tool_calls is not False
        if isinstance(req.tool_choice, NamedToolChoice):
            named = [s for s in specs if s.name == req.tool_choice.function.name]
            guide = tools.tool_guide(named, required=True, parallel=False)
        else:
            named = specs
            guide = tools.tool_guide(specs, required=req.tool_choice == "required", parallel=parallel)
        names = [s.name for s in named]
    format_guide = _format_guide(req.response_format, {"type": "object"})
    shape = AnswerShape(tools=specs, call_names=names, tool_grammar=guide is not None and format_guide is None,
                        top_logprobs=top, pieces=pieces if top is not None else None)
    return shape, format_guide or guide, specs


def completion_shape(req: CompletionRequest, pieces: TokenPieces | None) -> tuple[AnswerShape, Guide | None]:
    if req.guided_json is not None:
        guide: Guide | None = Guide(kind="json_schema", spec=json.dumps(req.guided_json))
    else:
        guide = _format_guide(req.response_format, {})
    top = req.logprobs
    return AnswerShape(top_logprobs=top, pieces=pieces if top is not None else None), guide


# ---------------------------------------------------------------- JSON answers


def chat_answer(rid: str, created: int, model: str, accs: list[ChoiceAcc], usage: TokenUsage,
                shape: AnswerShape) -> dict[str, object]:
    body = chat_response(rid, created, model, accs, usage)
    if shape.plain:
        return body
    choices: list[dict[str, Any]] = body["choices"]  # type: ignore[assignment]
    for i, (choice, acc) in enumerate(zip(choices, accs)):
        if shape.tools is not None:
            content, calls = tools.parse_tool_calls("".join(acc.text), shape.ids(i),
                                                    cut=acc.finish_reason == "length", names=shape.call_names)
            choice["message"]["content"] = content
            if calls:
                choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
                if acc.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        if shape.top_logprobs is not None and shape.pieces is not None:
            choice["logprobs"] = chat_logprobs(shape.pieces, acc.logprobs, shape.top_logprobs).model_dump()
    return body


def completion_answer(body: dict[str, object], accs: list[ChoiceAcc], shape: AnswerShape) -> dict[str, object]:
    if shape.top_logprobs is None or shape.pieces is None:
        return body
    choices: list[dict[str, Any]] = body["choices"]  # type: ignore[assignment]
    for choice, acc in zip(choices, accs):
        choice["logprobs"] = completion_logprobs(shape.pieces, acc.logprobs, shape.top_logprobs).model_dump()
    return body


# ---------------------------------------------------------------- streamed answers


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
