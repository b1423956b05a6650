"""`/v1/responses`: create (JSON, SSE or in the background), retrieve, delete, list input items, cancel.

A response is answered through the chat path (prepare -> submit, gateway/http/routes.py), so routing,
overflow to providers, limits, usage and metrics are chat's; what this module adds is the chain and
the store: the turns before `previous_response_id` are read back from the store (only the key that
made them can), rendered as the same chat messages every time (so the prefix cache serves them), and
the finished response is written back. Stored responses (and chains) are visible only to their key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from gateway import jsonio
from gateway.backends.base import ChoiceStream
from gateway.errors import APIError
from gateway.http import prepare, prompt, routes
from gateway.http.errors import error_for_output, validation_error
from gateway.http.middleware import END_USER
from gateway.http.offload import OFFLOAD
from gateway.http.sse import collect
from gateway.messages import is_failure
from gateway.openai import responses as rs
from gateway.openai import tools
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.chunks import sse_event
from gateway.openai.endpoints import CHAT
from gateway.openai.schema import ChatCompletionRequest
from gateway.routing.router import BACKEND_HEADER
from gateway.state import STATE, GatewayState
from gateway.store.responses import AnyResponseStore, RedisResponseStore, ResponseStore

log = logging.getLogger("sluice.gateway")

STORE: web.AppKey[AnyResponseStore] = web.AppKey("responses_store")
RUNS = web.AppKey("responses_background", dict)  # response id -> its background task
MAX_CHAIN = 10_000  # turns read back through previous_response_id


def _owner(request: web.Request) -> str | None:
    return routes.caller(request, request.app[STATE]).key


def _not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(404, f"No response with id '{rid}' found.", param=param, code="not_found",
                    type="invalid_request_error")


# ---------------------------------------------------------------- the chain and the chat request


async def _history(store: AnyResponseStore, owner: str | None, previous_id: str) -> list[dict[str, Any]]:
    """Every item of the chain that ends at `previous_id`, oldest first (each turn's input, then its output)."""
    turns: list[list[dict[str, Any]]] = []
    rid: str | None = previous_id
    while rid is not None and len(turns) < MAX_CHAIN:
        stored = await store.get(owner, rid)
        if stored is None:
            raise _not_found(rid, "previous_response_id") if rid == previous_id else APIError(
                400, f"An earlier response of this chain ('{rid}') is gone (deleted or expired).",
                param="previous_response_id", code="previous_response_not_found")
        if rid == previous_id and stored.response.get("status") in ("queued", "in_progress"):
            raise APIError(400, f"The response '{rid}' has not finished; wait for it before continuing it.",
                           param="previous_response_id", code="previous_response_not_finished")
        turns.append(stored.input_items + rs.output_items_of(stored.response))
        rid = stored.previous_id
    return [item for turn in reversed(turns) for item in turn]


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = validation_error(e)
        param = err.param or ""
        if param.startswith("messages"):  # the items made messages that chat refuses: say it of `input`
            param = "input"
        raise APIError(400, err.message, param=param or None, code=err.code) from None


async def _start(request: web.Request, req: rs.ResponsesRequest, history: list[dict[str, Any]],
                 items: list[dict[str, Any]]) -> tuple[prepare.Prepared, ChoiceStream]:
    """Prepared and submitted through the chat path. truncation=auto drops the oldest items (a turn at a
    time: up to the next user message) while the conversation does not fit the context."""
    state, offload = request.app[STATE], request.app[OFFLOAD]
    who = routes.caller(request, state)
    context = history + items
    while True:
        chat = _chat_request(rs.chat_body(req, context[:len(context) - len(items)], context[-len(items):]
                                          if items else [], bool(req.stream)))
        try:
            p = await prepare.chat(state, offload, chat, who)
            break
        except APIError as e:
            if req.truncation != "auto" or e.code != "context_length_exceeded" or len(context) <= 1:
                raise
            context = _drop_oldest_turn(context)
            items = items[-len(context):] if len(items) > len(context) else items
    if p.end_user:
        request[END_USER] = p.end_user
    return p, await routes.submit(state, p)


def _drop_oldest_turn(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without the first item and whatever answered it (up to the next user message)."""
    rest = items[1:]
    while rest and not (rest[0].get("type", "message") == "message" and rest[0].get("role") == "user") \
            and len(rest) > 1:
        rest = rest[1:]
    return rest


# ---------------------------------------------------------------- answers


def _usage(p: prepare.Prepared, stream: ChoiceStream, accs: list[ChoiceAcc]) -> TokenUsage:
    reported = stream.prompt_tokens
    return TokenUsage.of(len(p.gen.prompt_token_ids) if reported is None else reported, accs)


async def _complete(p: prepare.Prepared, stream: ChoiceStream, response: dict[str, Any]) -> dict[str, Any]:
    accs = await collect(stream, 1)
    chat = CHAT.answer(p.gen.request_id, int(time.time()), p.gen.model, accs, _usage(p, stream, accs), p.shape)
    return rs.from_chat(response, chat)


class _Items:
    """The output items of a streamed response as they form: a message item while text comes, a
    function_call item per call, each opened and closed with its events."""

    def __init__(self, ev: rs.Events):
        self.ev = ev
        self.output: list[dict[str, Any]] = []
        self._text: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # call index -> its open item

    def text(self, delta: str) -> list[dict[str, Any]]:
        out = []
        if self._text is None:
            self._text = rs.message_item("", status="in_progress")
            self._text["content"] = []
            self.output.append(self._text)
            out.append(self.ev.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=dict(self._text, content=[])))
            out.append(self.ev.event("response.content_part.added", item_id=self._text["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=rs.output_text("")))
            self._text["content"] = [rs.output_text("")]
        part = self._text["content"][0]
        part["text"] += delta
        out.append(self.ev.event("response.output_text.delta", item_id=self._text["id"],
                                 output_index=self.output.index(self._text), content_index=0, delta=delta,
                                 logprobs=[]))
        return out

    def call(self, d: tools.CallDelta) -> list[dict[str, Any]]:
        out = []
        if d.id is not None:
            item = rs.call_item(d.id, d.name or "", "", status="in_progress")
            self._calls[d.index] = item
            self.output.append(item)
            out.append(self.ev.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=dict(item)))
        item = self._calls[d.index]
        if d.arguments:
            item["arguments"] += d.arguments
            out.append(self.ev.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=d.arguments))
        return out

    def close(self, status: str) -> list[dict[str, Any]]:
        out = []
        for i, item in enumerate(self.output):
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                out.append(self.ev.event("response.output_text.done", item_id=item["id"], output_index=i,
                                         content_index=0, text=part["text"], logprobs=[]))
                out.append(self.ev.event("response.content_part.done", item_id=item["id"], output_index=i,
                                         content_index=0, part=dict(part)))
            else:
                out.append(self.ev.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=i, name=item["name"], arguments=item["arguments"]))
            out.append(self.ev.event("response.output_item.done", output_index=i, item=dict(item)))
        return out


async def _events(p: prepare.Prepared, stream: ChoiceStream, response: dict[str, Any],
                  ev: rs.Events) -> AsyncIterator[list[dict[str, Any]]]:
    """The stream's events a batch at a time, ending with exactly one terminal event (also on a failure).
    `response` is completed (or failed) in place."""
    items = _Items(ev)
    streamer = tools.ToolCallStreamer(p.shape.ids(0), p.shape.call_names) if p.shape.tools is not None else None
    acc = ChoiceAcc()
    try:
        async with stream:
            while not acc.finished:
                try:
                    batch = await stream.next_batch()
                except StopAsyncIteration:
                    break
                events: list[dict[str, Any]] = []
                for ch in batch:
                    out = ch.output
                    acc.add(out)
                    if is_failure(out):
                        err = error_for_output(out) or APIError(500, "the request failed", code="engine_error")
                        raise err
                    parts: list[tools.ContentDelta | tools.CallDelta] = []
                    if streamer is None:
                        parts = [tools.ContentDelta(out.text)] if out.text else []
                    else:
                        parts = streamer.feed(out.text) if out.text else []
                        if out.finished:
                            parts += streamer.finish(cut=out.finish_reason == "length")
                    for part in parts:
                        events += items.text(part.text) if isinstance(part, tools.ContentDelta) else items.call(part)
                if events:
                    yield events
        cut = acc.finish_reason == "length"
        u = _usage(p, stream, [acc])
        done = items.close("incomplete" if cut else "completed")
        rs.finish(response, items.output, acc.finish_reason, rs.usage(u.prompt_tokens, u.completion_tokens,
                                                                       u.cached_tokens))
        yield done + [ev.snapshot("response.incomplete" if cut else "response.completed")]
    except APIError as e:
        rs.failed(response, e.code or "server_error", e.message)
        response["output"] = items.output
        yield [ev.snapshot("response.failed")]


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\n" + sse_event(e) for e in events)


# ---------------------------------------------------------------- providers that serve Responses natively

_NATIVE_FIELDS = ("instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
                  "parallel_tool_calls", "text", "truncation", "user", "safety_identifier")


def _native(state: GatewayState, req: rs.ResponsesRequest) -> bool:
    """A model only providers serve, and one of them serves `/v1/responses` itself: ask it natively.
    A local model's requests take the chat path (overflow and fallback to providers included)."""
    return state.pool_for(req.model) is None and state.remote is not None \
        and bool(state.remote.responses_chain(req.model))


async def _ask_natively(request: web.Request, req: rs.ResponsesRequest, history: list[dict[str, Any]],
                        items: list[dict[str, Any]], response: dict[str, Any]) -> str:
    """`response` completed by a provider's own `/v1/responses` (the whole chain sent as `input`, nothing
    stored there), accounted as chat is: the worst case held against the key's budget, the provider's
    usage recorded. Returns the backend (`remote:<name>`)."""
    state = request.app[STATE]
    assert state.remote is not None and state.router is not None
    who = routes.caller(request, state)
    body: dict[str, Any] = {"input": history + items, "store": False}
    for name in _NATIVE_FIELDS:
        v = getattr(req, name)
        if v is not None:
            body[name] = v.model_dump(exclude_none=True, by_alias=True) if hasattr(v, "model_dump") else v
    accountant = state.router.accountant
    bound = len(jsonio.dumps(body))  # a provider counts with its own tokenizer: bytes bound its tokens
    completion = req.max_output_tokens or accountant.reserve_completion_tokens
    worst = max((bound * max(p.settings.input_price_per_m, p.settings.cached_input_price_per_m or 0.0)
                 + completion * p.settings.output_price_per_m) / 1e6 for p in state.remote.responses_chain(req.model))
    rid = response["id"]
    await accountant.hold(who.key, who.tier, rid, worst)
    try:
        answer = await state.remote.responses(rid, req.model, body,
                                              prompt.deadline(state.settings.tiers, who.timeout, who.tier))
    except BaseException:
        await accountant.usage.release(rid)
        raise
    up = answer.body
    u: dict[str, Any] = up["usage"] if isinstance(up.get("usage"), dict) else {}
    n_in, n_out = int(u.get("input_tokens") or 0), int(u.get("output_tokens") or 0)
    cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    await accountant.record_usage(who.key, who.tier, req.model, rid, answer.backend, answer.provider, n_in, cached,
                                  n_out, batch=who.batch)
    status = up.get("status") if up.get("status") in ("completed", "incomplete", "failed") else "completed"
    response.update(output=up["output"], status=status, incomplete_details=up.get("incomplete_details"),
                    error=up.get("error"), usage=rs.usage(n_in, n_out, cached),
                    completed_at=int(time.time()) if status == "completed" else None)
    return answer.backend


def _replayed(response: dict[str, Any], ev: rs.Events) -> list[dict[str, Any]]:
    """A finished response as the events that would have streamed it (a native answer is read whole)."""
    out = [ev.snapshot("response.created"), ev.snapshot("response.in_progress")]
    items = _Items(ev)
    for i, item in enumerate(response["output"]):
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
            items._text = None
            out += items.text(text)
        elif item.get("type") == "function_call":
            out += items.call(tools.CallDelta(i, item["call_id"], item["name"], ""))
            out += items.call(tools.CallDelta(i, None, None, item["arguments"]))
    status = response["status"]
    out += items.close("incomplete" if status == "incomplete" else "completed")
    response["output"] = items.output
    out.append(ev.snapshot({"incomplete": "response.incomplete", "failed": "response.failed"}.get(
        status, "response.completed")))
    return out


# ---------------------------------------------------------------- the routes


async def create(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    req = await request.app[OFFLOAD].parse(await request.read(), rs.ResponsesRequest)
    owner = _owner(request)
    if req.background and req.store is False:
        raise APIError(400, "`background` needs `store` (a background response is polled from the store).",
                       param="background", code="invalid_value")
    if req.background and req.stream:
        raise APIError(400, "`background` with `stream` is not supported by Sluice; poll the response instead.",
                       param="stream", code="invalid_value")
    history = await _history(store, owner, req.previous_response_id) if req.previous_response_id else []
    items = rs.input_items(req)
    if not items:
        raise APIError(400, "`input` is empty.", param="input", code="invalid_value")
    rid = rs.new_id("resp")
    if _native(request.app[STATE], req) and not req.background:
        response = rs.skeleton(rid, req, "in_progress")
        try:
            backend = await _ask_natively(request, req, history, items, response)
        except APIError as e:
            if req.store is not False:
                await store.put(owner, rs.failed(response, e.code or "server_error", e.message), items,
                                req.previous_response_id)
            raise
        events = _replayed(response, rs.Events(response)) if req.stream else []  # (its items get our ids)
        if req.store is not False:
            await store.put(owner, response, items, req.previous_response_id)
        if not req.stream:
            return web.Response(body=jsonio.dumps(response), content_type="application/json",
                                headers={BACKEND_HEADER: backend})
        return web.Response(body=_sse(events), content_type="text/event-stream",
                            headers={BACKEND_HEADER: backend, "Cache-Control": "no-cache"})
    if req.background:
        response = rs.skeleton(rid, req, "queued")
        await store.put(owner, response, items, req.previous_response_id)
        request.app[RUNS][rid] = asyncio.create_task(_background(request, req, history, items, response))
        return web.json_response(response)
    p, stream = await _start(request, req, history, items)
    response = rs.skeleton(rid, req, "in_progress")
    if not req.stream:
        try:
            await _complete(p, stream, response)
        except APIError as e:
            if req.store is not False:
                await store.put(owner, rs.failed(response, e.code or "server_error", e.message), items,
                                req.previous_response_id)
            raise
        if req.store is not False:
            await store.put(owner, response, items, req.previous_response_id)
        return web.Response(body=jsonio.dumps(response), content_type="application/json",
                            headers={BACKEND_HEADER: stream.backend})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", BACKEND_HEADER: stream.backend})
    await resp.prepare(request)
    ev = rs.Events(response)
    try:
        await resp.write(_sse([ev.snapshot("response.created"), ev.snapshot("response.in_progress")]))
        async for events in _events(p, stream, response, ev):
            await resp.write(_sse(events))
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        log.info("client disconnected mid-stream (response %s); cancelling", rid)
        if response["status"] == "in_progress":
            response.update(status="cancelled")
    finally:
        if req.store is not False:
            await store.put(owner, response, items, req.previous_response_id)
    return resp


async def _background(request: web.Request, req: rs.ResponsesRequest, history: list[dict[str, Any]],
                      items: list[dict[str, Any]], response: dict[str, Any]) -> None:
    """A background response: in_progress once submitted, then completed, incomplete, failed or cancelled."""
    store, owner = request.app[STORE], _owner(request)
    try:
        p, stream = await _start(request, req.model_copy(update={"stream": False}), history, items)
        response["status"] = "in_progress"
        await store.put(owner, response)
        await _complete(p, stream, response)
    except asyncio.CancelledError:
        response.update(status="cancelled")
        await asyncio.shield(store.put(owner, response))
        raise
    except APIError as e:
        rs.failed(response, e.code or "server_error", e.message)
    except Exception as e:  # stored as failed: a poller must not wait forever
        log.exception("background response %s failed", response["id"])
        rs.failed(response, "server_error", f"the response failed: {type(e).__name__}")
    finally:
        request.app[RUNS].pop(response["id"], None)
    await store.put(owner, response)


async def retrieve(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if request.query.get("stream") in ("true", "1"):
        raise APIError(400, "Streaming a stored response again is not supported by Sluice; GET it without "
                            "`stream`.", param="stream", code="invalid_value")
    stored = await request.app[STORE].get(_owner(request), rid)
    if stored is None:
        raise _not_found(rid)
    return web.json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    owner = _owner(request)
    task = request.app[RUNS].get(rid)
    if not await request.app[STORE].delete(owner, rid):
        raise _not_found(rid)
    if task is not None:
        task.cancel()
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    store, owner = request.app[STORE], _owner(request)
    stored = await store.get(owner, rid)
    if stored is None:
        raise _not_found(rid)
    if not stored.response.get("background"):
        raise APIError(400, "Only background responses can be cancelled.", param="response_id",
                       code="invalid_value")
    task = request.app[RUNS].get(rid)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([task])
        stored = await store.get(owner, rid)
        assert stored is not None
    return web.json_response(stored.response)


async def input_items(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    stored = await request.app[STORE].get(_owner(request), rid)
    if stored is None:
        raise _not_found(rid)
    q = request.query
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise APIError(400, "`limit` must be an integer from 1 to 100.", param="limit", code="invalid_value") from None
    if not 1 <= limit <= 100:
        raise APIError(400, "`limit` must be an integer from 1 to 100.", param="limit", code="invalid_value")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "`order` must be asc or desc.", param="order", code="invalid_value")
    items = [rs.listed_item(item, i, rid) for i, item in enumerate(stored.input_items)]
    if order == "desc":
        items.reverse()
    for name in ("after", "before"):
        cursor = q.get(name)
        if cursor is not None:
            at = next((i for i, it in enumerate(items) if it["id"] == cursor), None)
            if at is None:
                raise APIError(400, f"`{name}`: no item '{cursor}' in this response.", param=name,
                               code="invalid_value")
            items = items[at + 1:] if name == "after" else items[:at]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    runs: dict[str, asyncio.Task[None]] = app[RUNS]
    if runs:  # background responses still running: let them finish within the shutdown grace
        _, pending = await asyncio.wait(list(runs.values()), timeout=app[STATE].settings.server.shutdown_grace_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)
    await app[STORE].close()


def setup(app: web.Application, state: GatewayState) -> None:
    settings = state.settings
    s = settings.responses
    shared = settings.limits.redis_url or settings.redis_url  # gateways sharing Redis share their responses
    app[STORE] = RedisResponseStore(shared, prefix=settings.queue.key_prefix, ttl_s=s.ttl_days * 86400,
                                    max_bytes=int(s.max_mb * 1e6)) if shared and s.store_path is None else \
        ResponseStore(settings.responses_store_path(), ttl_s=s.ttl_days * 86400, max_bytes=int(s.max_mb * 1e6))
    app[RUNS] = {}
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
    app.cleanup_ctx.append(_lifecycle)
