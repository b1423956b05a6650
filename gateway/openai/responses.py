"""The Responses API's protocol (`POST /v1/responses`): the request, its input items as chat messages,
and the Response object and stream events built from a chat answer.

Sluice serves Responses by bridging to chat completions inside the gateway: the items of the chain
(every stored turn's input and output, then this request's input) become chat messages, rendered the
same way every turn so the prefix cache serves the earlier turns; the chat answer (a message, function
calls) becomes output items. Fields of OpenAI's API that Sluice does not implement are refused with a
400 naming them, as for chat.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.errors import APIError

INT32_MAX = 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        # Checked with the request, not when the answer is made: a `background` response was accepted
        # (queued) with a json_schema format that had no schema, and failed only later.
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a `text.format` of type json_schema needs `name` and `schema`")
        return self


class TextParam(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only value that changes nothing


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


# Responses fields Sluice does not implement: the values that change nothing, and why.
_NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "include": (([],), ""),
    "reasoning": (({},), " (the local models do not reason)"),
    "top_logprobs": ((0,), ""),
    "max_tool_calls": ((), " (it limits built-in tools, which Sluice does not run)"),
    "conversation": ((), " (chain turns with `previous_response_id`)"),
    "prompt": ((), " (prompt templates)"),
    "prompt_cache_key": ((), " (prefix caching is automatic)"),
    "prompt_cache_retention": ((), ""),
    "service_tier": (("auto", "default"), " (the tier comes from the API key)"),
    "stream_options": (({}, {"include_obfuscation": False}), ""),
    "context_management": ((), ""),
}


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(default="")
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = Field(None, max_length=16)
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | int | None = Field(None, ge=0.0, le=2.0)
    top_p: float | int | None = Field(None, ge=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = False
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    stream: bool | None = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's extra, also honoured here
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    context_management: Any = None

    @field_validator(*_NOT_IMPLEMENTED)
    @classmethod
    def _not_implemented(cls, v: Any, info: Any) -> Any:
        allowed, why = _NOT_IMPLEMENTED[info.field_name]
        if info.field_name == "reasoning" and isinstance(v, dict) and all(x is None for x in v.values()):
            return v  # {"effort": null, "summary": null}: what the SDK's defaults send
        if v is not None and v not in allowed:
            raise ValueError(f"`{info.field_name}` is not supported by Sluice{why}; remove it"
                             + (f" or send one of {list(allowed)}" if allowed else ""))
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(v or []):
            kind = t.get("type")
            if kind != "function":
                raise ValueError(f"tools[{i}]: tool type {kind!r} is not supported by Sluice; only `function` "
                                 "tools are (built-in tools such as web search run at OpenAI)")
            FunctionTool.model_validate(t)
        names = [t["name"] for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError("each function needs its own name")
        return v

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or []]


# ---------------------------------------------------------------- input items -> chat messages


def _bad(index: int, message: str, where: str = "") -> APIError:
    return APIError(400, f"input[{index}]{where}: {message}", param=f"input[{index}]{where}", code="invalid_value")


def _text_of(content: Any, index: int, kinds: tuple[str, ...]) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or chat parts (text, image_url, file)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(index, "`content` must be a string or a list of parts", ".content")
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        where = f".content[{j}]"
        if kind in kinds and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "refusal" and "output_text" in kinds and isinstance(p.get("refusal"), str):
            parts.append({"type": "text", "text": p["refusal"]})
        elif kind == "input_image" and "input_text" in kinds:
            url = p.get("image_url") or p.get("file_id")
            if not isinstance(url, str):
                raise _bad(index, "an input_image part needs `image_url` or `file_id`", where)
            parts.append({"type": "image_url", "image_url": {"url": url, **({"detail": p["detail"]}
                                                                           if p.get("detail") else {})}})
        elif kind == "input_file" and "input_text" in kinds:
            parts.append({"type": "file", "file": {k: p[k] for k in ("file_id", "file_data", "filename")
                                                   if p.get(k) is not None}})
        else:
            raise _bad(index, f"content part type {kind!r} is not supported here; use "
                              f"{' or '.join(kinds)} (text), input_image or input_file", where)
    if parts and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items (messages, function calls and their outputs) as chat messages. Consecutive
    function calls join one assistant message (with the text just before them), as chat expects."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(i, "an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(i, f"role {role!r} is not one of user, system, developer, assistant", ".role")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            out.append({"role": role, "content": _text_of(item.get("content"), i, kinds)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise _bad(i, "a function_call item needs string `call_id`, `name` and `arguments`")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and isinstance(last.get("content"), (str, type(None))) \
                    and not any(m["role"] == "tool" for m in out[-1:]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if isinstance(output, list):  # output as content parts: their text
                output = "\n".join(p.get("text", "") for p in output if isinstance(p, dict))
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise _bad(i, "a function_call_output item needs a string `call_id` and `output`")
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # another model's reasoning carried in the history: nothing for this one to read
        else:
            raise _bad(i, f"input item type {kind!r} is not supported by Sluice; use message, function_call "
                          "or function_call_output", ".type")
    return out


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items (a string input is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}] \
            if req.input else []
    return [dict(x) for x in req.input]


def chat_body(req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]],
              stream: bool) -> dict[str, Any]:
    """The chat completion request that answers `req`: instructions first (a system message), then the
    chain's earlier items, then this request's."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + \
        items_to_messages(history + items)
    if not messages:
        raise APIError(400, "`input` is empty.", param="input", code="invalid_value")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("seed", "seed"),
                         ("user", "user"), ("safety_identifier", "safety_identifier")):
        v = getattr(req, ours)
        if v is not None:
            body[theirs] = v
    tools = req.function_tools()
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
            {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or fmt.name is None:
            raise APIError(400, "`text.format` of type json_schema needs `name` and `schema`.",
                           param="text.format", code="invalid_value")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {}),
            **({"description": fmt.description} if fmt.description else {})}}
    return body


# ---------------------------------------------------------------- the Response object


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(24).hex()}"


def skeleton(rid: str, req: ResponsesRequest, status: str, created_at: float | None = None) -> dict[str, Any]:
    """A Response object before any output: what `response.created` and a queued background response show."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    tool_choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else \
        req.tool_choice.model_dump()
    return {
        "id": rid, "object": "response", "created_at": int(created_at or time.time()), "status": status,
        "background": bool(req.background), "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "model": req.model, "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": tool_choice or "auto",
        "tools": [dict(t.model_dump(exclude_none=True), parameters=t.parameters, strict=t.strict is not False)
                  for t in req.function_tools()],
        "top_logprobs": 0, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled", "metadata": req.metadata or {},  # usage: once finished
        **{k: v for k, v in (("user", req.user), ("safety_identifier", req.safety_identifier)) if v is not None},
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def finish(response: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None,
           usage_: dict[str, Any] | None) -> dict[str, Any]:
    """`response` completed (or incomplete, cut by max_output_tokens) with `output`."""
    cut = finish_reason == "length"
    for item in output:
        item["status"] = "incomplete" if cut else "completed"
    if usage_ is not None:
        response["usage"] = usage_
    response.update(output=output, completed_at=None if cut else int(time.time()),
                    status="incomplete" if cut else "completed",
                    incomplete_details={"reason": "max_output_tokens"} if cut else None)
    return response


def from_chat(response: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """`response` completed from a chat completion answer (a JSON body: local or a provider's)."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(message_item(msg.get("content") or ""))
    for c in msg.get("tool_calls") or []:
        output.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    u = chat.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return finish(response, output, choice.get("finish_reason"),
                  usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0), cached))


def failed(response: dict[str, Any], code: str, message: str) -> dict[str, Any]:
    response.update(status="failed", error={"code": code, "message": message})
    return response


def output_items_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output as input items of the next turn (their ids and statuses dropped, so a
    chain renders the same however it was produced)."""
    out = []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "".join(
                            p.get("text", "") for p in item.get("content") or [])}]})
        elif item.get("type") == "function_call":
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
    return out


def listed_item(item: dict[str, Any], index: int, rid: str) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it: with an id (stable per position)."""
    out = dict(item)
    if "id" not in out:
        kind = out.get("type", "message")
        out.setdefault("type", kind)
        prefix = {"message": "msg", "function_call": "fc"}.get(kind, "fco")
        out["id"] = f"{prefix}_{rid[5:29]}{index:04d}"
    if out.get("type") == "message":
        content = out.get("content")
        if isinstance(content, str):
            out["content"] = [{"type": "input_text" if out.get("role") != "assistant" else "output_text",
                               "text": content}]
        out.setdefault("status", "completed")
    return out


# ---------------------------------------------------------------- stream events


class Events:
    """The semantic stream of one response: each event a dict with its increasing `sequence_number`."""

    def __init__(self, response: dict[str, Any]):
        self.response = response
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def snapshot(self, kind: str) -> dict[str, Any]:
        return self.event(kind, response=dict(self.response))
