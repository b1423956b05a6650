"""Tool calling on the local engine, in one documented format (Hermes style) for models whose chat
template does not render tools itself (SmolLM2's does not).

The prompt: the system turn gains the tool list as JSON inside `<tools></tools>` and the instruction to
answer a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier assistant calls are
rendered the same way and tool results as `tool` turns wrapped in `<tool_response></tool_response>`.
A model whose template takes a `tools` variable gets the tools through its template instead.

The answer: with `tool_choice` "required" or a named function, decoding is constrained by a grammar
(`<tool_call>` + the JSON schema of {name, arguments} for the allowed functions + `</tool_call>`), so a
call always parses and its arguments validate; with "auto", the grammar lets the model write free text
(not starting with "<") or calls that then must be valid. The text is parsed into OpenAI's
`tool_calls` (ids `call_...`, `arguments` a JSON string), streamed as tool-call deltas (index, id and
name first, then the arguments). An answer cut by max_tokens inside a call still carries it as a call:
the name as far as it is known and the arguments' JSON text so far (OpenAI, too, returns a truncated
`arguments` string with finish_reason "length"), never the raw markup as content.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from engine import Guide

MAX_PARALLEL = 4  # tool calls in one answer when parallel_tool_calls is on
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>{tools}</tools> "
    "For each function call return a json object with function name and arguments within <tool_call>"
    "</tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------- the prompt


def system_block(tools: list[ToolSpec]) -> str:
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return SYSTEM_PROMPT.format(tools="\n" + listed + "\n")


def render_call(name: str, arguments: str) -> str:
    """An earlier assistant call, as the model is asked to write one."""
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        args = arguments  # what the client sent back, verbatim
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def with_tool_system(messages: list[dict[str, str]], tools: list[ToolSpec]) -> list[dict[str, str]]:
    """The conversation with the tool list in its system turn (added when there is none)."""
    block = system_block(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = (first.get("content") or "") + "\n\n" + block
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


# ---------------------------------------------------------------- the grammar


# The JSON layout json.dumps writes: a small model given free whitespace may pad forever.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _call_schema(tools: list[ToolSpec]) -> dict[str, Any]:
    variants = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters or
                                                  {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "x-guidance": _JSON_LAYOUT}


# ---------------------------------------------------------------- a grammar the engine refused


@functools.lru_cache(maxsize=64)
def _schema_problem(call_schema: str) -> str:
    """llguidance's reason a call schema does not compile ("" when it does). It releases the GIL, so a
    large schema checked in a thread leaves the event loop running; cached, so a repeated bad tool costs
    one check."""
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(call_schema))


# A schema llguidance cannot compile reads "at L(C): failed to compile JSON schema: <why>", then a listing
# of the Lark grammar around line L ("   3 | call: ..."), which is Sluice's, not the client's.
_COMPILE_FAILED = "failed to compile JSON schema: "
_WHY = re.compile(re.escape(_COMPILE_FAILED) + r"(?P<why>.*?)(?:\n\s*\d+ \|.*)?\Z", re.S)
_OURS = re.compile(r"^(?:the grammar is not supported: )?(?:.*?at \d+\(\d+\): )?")  # the engine's framing


def _engine_reason(message: str) -> str:
    """The engine's reason for refusing the tools' grammar, in terms of the client's schemas."""
    found = _WHY.search(message)
    if found is not None:
        return found["why"].strip()
    return _OURS.sub("", message.split("\n", 1)[0]).strip()


async def invalid_tool(tools: list[ToolSpec], engine_message: str) -> tuple[str, str]:
    """(param, message) for a tool grammar the engine refused. When a schema did not compile: the first
    function whose `parameters` do not compile on their own, with the reason (checked in the order the
    engine compiled them, so this costs at most what its compile did). Otherwise, or when none fails
    alone: `tools` and the engine's reason, without the grammar listing (the client wrote JSON schemas,
    not that grammar). Run only once the engine refused, so valid requests never pay a second compile."""
    if _COMPILE_FAILED in engine_message:
        for i, t in enumerate(tools):
            why = await asyncio.to_thread(_schema_problem, json.dumps(_call_schema([t])))
            if why:
                param = f"tools.{i}.function.parameters"
                return param, f"{param}: the JSON schema of function `{t.name}` is not supported: {why}"
    return "tools", f"tools: the functions' JSON schemas cannot be used: {_engine_reason(engine_message)}"


def tool_guide(tools: list[ToolSpec], required: bool, parallel: bool) -> Guide:
    """A Lark grammar (llguidance): calls only (`required`), or free text or calls (`auto`)."""
    call = f'call: "{CALL_OPEN}\\n" %json {json.dumps(_call_schema(tools))} "\\n{CALL_CLOSE}"'
    # At most MAX_PARALLEL calls: a small model would otherwise chain calls until max_tokens.
    calls = "calls: " + " | ".join(" \"\\n\" ".join(["call"] * k) for k in range(1, MAX_PARALLEL + 1)) \
        if parallel else "calls: call"
    if required:
        lark = f"start: calls\n{calls}\n{call}\n"
    else:
        lark = f"start: calls | text\ntext: /(?s:[^<].*)/ | \"\"\n{calls}\n{call}\n"
    return Guide(kind="lark", spec=lark)


# ---------------------------------------------------------------- the answer

# How the grammar lays out a call's JSON (json.dumps' separators, "name" first): a cut call is read by it.
_NAME_OPEN = '{"name": "'
_ARGS_OPEN = ', "arguments": '
_NAME_CHARS = re.compile(r"[a-zA-Z0-9_-]*")  # FunctionDef's pattern: a name holds no quote or escape


def _call_id(index: int, ids: list[str]) -> str:
    return ids[index] if index < len(ids) else new_call_id()


def _call_of(obj: Any, index: int, ids: list[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ToolCall(id=_call_id(index, ids), name=obj["name"],
                    arguments=json.dumps(obj.get("arguments", {}), ensure_ascii=False))


def _parse_call(body: str, index: int, ids: list[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_of(obj, index, ids)


def _cut_call(body: str, index: int, ids: list[str], names: Sequence[str]) -> ToolCall | None:
    """The call an answer cut by max_tokens was writing (`body`: its text after `<tool_call>`): the name
    as far as it is known (a cut name only one of `names` begins with is that name) and the arguments'
    JSON text so far. None: `body` does not begin a call in the grammar's layout (free text that
    mentions the tag)."""
    text = body.lstrip()
    try:
        whole, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        whole = None
    if whole is not None:  # the JSON is complete; only the closing tag was cut
        return _call_of(whole, index, ids)
    if not _NAME_OPEN.startswith(text[:len(_NAME_OPEN)]):
        return None
    name, closed, after = text[len(_NAME_OPEN):].partition('"')
    if not _NAME_CHARS.fullmatch(name) or not (after.startswith(_ARGS_OPEN) or _ARGS_OPEN.startswith(after)):
        return None
    arguments = after[len(_ARGS_OPEN):] if after.startswith(_ARGS_OPEN) else ""
    return ToolCall(id=_call_id(index, ids), name=name if closed else _known_name(name, names), arguments=arguments)


def _known_name(begun: str, names: Sequence[str]) -> str:
    """A cut name: the one function it can only be, else as far as it was written."""
    known = [n for n in names if n.startswith(begun)]
    return known[0] if len(known) == 1 else begun


def _begun_call(index: int, ids: list[str], names: Sequence[str]) -> ToolCall:
    """A call cut inside its `<tool_call>` tag: no name written yet, no arguments."""
    return ToolCall(id=_call_id(index, ids), name=_known_name("", names), arguments="")


def _tag_begun(rest: str) -> bool:
    """True when `rest` (the answer after its last call, or all of it) is only the beginning of a call tag."""
    stripped = rest.strip()
    return bool(stripped) and CALL_OPEN.startswith(stripped)


def parse_tool_calls(text: str, ids: list[str] | None = None, *, cut: bool = False,
                     names: Sequence[str] = ()) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call or the whole text, calls). Text that is not a well-formed call stays
    content (with "auto" and no grammar violation this does not happen, but a free answer may mention tags).
    `cut`: the answer ended at max_tokens, so a call it had begun is returned as far as it got (`names`:
    the functions the answer may call)."""
    ids = ids or []
    calls: list[ToolCall] = []
    start = text.find(CALL_OPEN)
    if start < 0:
        if cut and _tag_begun(text):
            return None, [_begun_call(0, ids, names)]
        return text, []
    content = text[:start].rstrip() or None
    pos = start
    while True:
        open_at = text.find(CALL_OPEN, pos)
        if open_at < 0:
            if cut and _tag_begun(text[pos:]):
                calls.append(_begun_call(len(calls), ids, names))
            break
        body_at = open_at + len(CALL_OPEN)
        close_at = text.find(CALL_CLOSE, body_at)
        if close_at < 0:
            partial = _cut_call(text[body_at:], len(calls), ids, names) if cut else None
            if partial is not None:
                calls.append(partial)
            break
        call = _parse_call(text[body_at:close_at], len(calls), ids)
        if call is None:
            return text, []
        calls.append(call)
        pos = close_at + len(CALL_CLOSE)
    return (content, calls) if calls else (text, [])


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallDelta:
    index: int
    id: str | None  # first delta of a call: id and name
    name: str | None
    arguments: str


class ToolCallStreamer:
    """Turns streamed text into content deltas and tool-call deltas. Text that might be the start of a
    call is held back until it is clearly not one; a call is emitted once complete (id and name, then
    its arguments), so the SDK's stream helpers reassemble exactly the non-streamed answer. A call cut by
    max_tokens is emitted at `finish` as far as it got, as `parse_tool_calls(..., cut=True)` returns it."""

    def __init__(self, ids: list[str] | None = None, names: Sequence[str] = ()):
        self._buf = ""
        self._in_call = False
        self._seen_call = False
        self._loose = False  # text other than whitespace since the last call (or the start)
        self._n = 0
        self._ids = ids or []
        self._names = names

    @property
    def made_calls(self) -> bool:
        return self._n > 0

    def feed(self, text: str) -> list[ContentDelta | CallDelta]:
        self._buf += text
        out: list[ContentDelta | CallDelta] = []
        while True:
            if not self._in_call:
                at = self._buf.find(CALL_OPEN)
                if at < 0:
                    # Hold back what may be the start of a tag, and trailing whitespace (dropped if a call follows).
                    keep = _partial_suffix(self._buf, CALL_OPEN)
                    head = self._buf[:len(self._buf) - keep]
                    keep += len(head) - len(head.rstrip())
                    emit, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    self._loose = self._loose or bool(emit)
                    if emit and not self._seen_call:
                        out.append(ContentDelta(emit))
                    return out
                before = self._buf[:at]
                if before.rstrip() and not self._seen_call:
                    out.append(ContentDelta(before.rstrip()))
                self._buf = self._buf[at + len(CALL_OPEN):]
                self._in_call = True
            close = self._buf.find(CALL_CLOSE)
            if close < 0:
                return out
            body, self._buf = self._buf[:close], self._buf[close + len(CALL_CLOSE):]
            self._in_call = False
            self._loose = False
            call = _parse_call(body, self._n, self._ids)
            if call is not None:
                out += self._emit(call)

    def _emit(self, call: ToolCall) -> list[ContentDelta | CallDelta]:
        self._seen_call = True
        index, self._n = self._n, self._n + 1
        return [CallDelta(index, call.id, call.name, ""), CallDelta(index, None, None, call.arguments)]

    def finish(self, cut: bool = False) -> list[ContentDelta | CallDelta]:
        """The held-back rest at the end of the answer (text after the last call is dropped, as parsing
        does). `cut`: the answer ended at max_tokens, so a call it had begun is emitted as far as it got."""
        rest, self._buf = self._buf, ""
        call = self._cut(rest) if cut else None
        if call is not None:
            return self._emit(call)
        if self._seen_call:
            return []
        return [ContentDelta((CALL_OPEN if self._in_call else "") + rest)] if (rest or self._in_call) else []

    def _cut(self, rest: str) -> ToolCall | None:
        if self._in_call:
            return _cut_call(rest, self._n, self._ids, self._names)
        if _tag_begun(rest) and not self._loose:
            return _begun_call(self._n, self._ids, self._names)
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a beginning of `tag` (held back: maybe a tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def names(tools: Iterable[ToolSpec]) -> set[str]:
    return {t.name for t in tools}
