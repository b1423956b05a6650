"""What a chat or completion request asks of its answer beyond text, read once from the request: the
tool calls to parse out of it, the log-probabilities to attach, and the grammar (`Guide`) that
constrains it (tool calls, `response_format` or `guided_json`). A request whose parts contradict each
other is refused here, with the `param` OpenAI would name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine import Guide
from gateway.errors import APIError
from gateway.openai import tools
from gateway.openai.logprobs import TokenPieces
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormat


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
