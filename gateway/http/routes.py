"""The OpenAI routes and the operational ones (/health, /ready, /metrics).

Chat and legacy completions read the same four steps: parse (http/offload.py: the body into the
request model, off the event loop when it is large), prepare (http/prepare.py: tokenized here or
relayed, the prompt fitted, the `GenerationRequest`), submit (to the router) and answer (JSON, or SSE
through http/sse.py, in the endpoint's format: gateway/openai/). Every exit path closes the backend
stream, so a vanished client frees its engine slot.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import jsonio
from gateway.admission.auth import KEY_NAME, TIER_KEY
from gateway.backends.base import ChoiceStream
from gateway.backends.local import LocalBackend
from gateway.errors import APIError
from gateway.http import prepare, prompt
from gateway.http.middleware import END_USER, request_id
from gateway.http.offload import OFFLOAD
from gateway.http.sse import read_all, send_then_close, stream_sse
from gateway.openai import tools
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.queue.base import QueueFull
from gateway.routing.router import BACKEND_HEADER
from gateway.state import STATE, GatewayState
from gateway.worker.pool import ModelPool

# ---------------------------------------------------------------- parse -> prepare -> submit -> answer


def caller(request: web.Request, state: GatewayState) -> prepare.Caller:
    return prepare.Caller(tier=request.get(TIER_KEY, state.settings.auth.anonymous_tier), key=request.get(KEY_NAME),
                          timeout=request.headers.get(prompt.DEADLINE_HEADER), priority=request.get(prepare.PRIORITY))


async def submit(state: GatewayState, p: prepare.Prepared) -> ChoiceStream:
    gen = p.gen
    limit = p.router.local.queue.depth_limit(gen.tier) if isinstance(p.router.local, LocalBackend) \
        else state.queue.depth_limit(gen.tier)
    if gen.n > limit:
        raise APIError(400, f"n={gen.n} choices cannot be queued: the {gen.tier} tier queues at most "
                            f"{limit} requests at once. Lower n.", param="n", code="invalid_value")
    try:
        return await p.router.submit(gen)
    except QueueFull as e:
        raise APIError(503, f"The server is overloaded ({e.tier} queue full); retry shortly.",
                       type="overloaded_error", code="queue_full", retry_after=e.retry_after) from None


async def _answer(request: web.Request, state: GatewayState, p: prepare.Prepared,
                  stream: ChoiceStream) -> web.StreamResponse:
    """JSON or SSE in the endpoint's format; every exit path closes the stream."""
    gen, endpoint = p.gen, p.endpoint
    created = int(time.time())
    model = gen.model  # the local model's id, or the Sluice name of a remote one

    def usage(accs: list[ChoiceAcc]) -> TokenUsage:
        reported = stream.prompt_tokens  # the provider's count when remote
        return TokenUsage.of(len(gen.prompt_token_ids) if reported is None else reported, accs)

    if not p.req.stream:
        try:
            accs = await read_all(stream, gen.n)
            u = usage(accs)
            answer = web.Response(body=jsonio.dumps(endpoint.answer(gen.request_id, created, model, accs, u,
                                                                    p.shape)),
                                  headers={"Content-Type": "application/json; charset=utf-8",
                                           BACKEND_HEADER: stream.backend})
        except BaseException:
            await stream.aclose()
            raise
        await send_then_close(request, answer, stream)
        state.metrics.completion_tokens.inc(u.completion_tokens)
        return answer

    include_usage = p.req.include_usage()
    encoder = endpoint.chunks(gen.request_id, created, model, include_usage, p.shape)
    resp, completion = await stream_sse(request, stream, gen.n, encoder, usage if include_usage else None,
                                        request_id(request))
    state.metrics.completion_tokens.inc(completion)
    return resp


async def _generate(request: web.Request, state: GatewayState, p: prepare.Prepared) -> web.StreamResponse:
    if p.end_user:
        request[END_USER] = p.end_user
    return await _answer(request, state, p, await submit(state, p))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, offload = request.app[STATE], request.app[OFFLOAD]
    req = await offload.parse(await request.read(), ChatCompletionRequest)
    p = await prepare.chat(state, offload, req, caller(request, state))
    try:
        return await _generate(request, state, p)
    except APIError as e:
        if p.tools and p.shape.tool_grammar and e.code == "invalid_grammar":  # the engine refused the tools' grammar
            param, message = await tools.invalid_tool(p.tools, e.message)
            raise APIError(400, message, param=param, code="invalid_grammar") from None
        raise


async def completions(request: web.Request) -> web.StreamResponse:
    state, offload = request.app[STATE], request.app[OFFLOAD]
    req = await offload.parse(await request.read(), CompletionRequest)
    p = await prepare.completion(state, offload, req, caller(request, state))
    return await _generate(request, state, p)


# ---------------------------------------------------------------- models and operations


def _served_models(state: GatewayState) -> list[str]:
    """Every local model that is ready (its id and aliases) and every model a remote provider serves."""
    local = [n for p in state.pools if p.ready for n in p.names]
    remote = state.router.remote_models() if state.router is not None else []
    return local + [m for m in remote if m not in local]


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    models = _served_models(state)
    if not models:
        prepare.require_ready(state)
    body = ModelList(data=[ModelCard(id=m, created=state.created) for m in models])
    return web.json_response(body.model_dump())


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = request.match_info["model"]
    if model not in _served_models(state):
        pool = state.pool_for(model)
        prepare.require_ready(state, pool)
        prepare.check_model(state, model, pool.kind if pool is not None else "chat")
    return web.json_response(ModelCard(id=model, created=state.created).model_dump())


async def health(request: web.Request) -> web.Response:  # noqa: ARG001 (a handler)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: dict[str, Any] = {"status": "ready" if state.ready else "not_ready", "model": state.model_name}
    chat = state.chat
    if chat is not None:  # the first chat model, at the top level as before several models
        body.update(_pool_status(chat))
    body["models"] = {p.model_name or p.entry.id or f"({p.kind})": {"kind": p.kind, "ready": p.ready,
                                                                    **_pool_status(p)} for p in state.pools}
    if state.draining:
        body["draining"] = True
    body["queue_depth"] = {t: await state.queue.depth(t) for t in state.settings.tiers}
    if state.remote is not None:  # circuits and configuration errors
        body["providers"] = state.remote.status()
    if state.engines is not None:  # replicas: circuits, room levels, last polled load
        body["engines"] = state.engines.status()
    return web.json_response(body, status=200 if state.ready else 503)


def _pool_status(pool: ModelPool) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if pool.load_error:
        body["error"] = pool.load_error
    if pool.local_worker is not None:
        body["worker"] = pool.local_worker.stats().to_dict()
    if pool.remote_workers is not None:  # `sluice worker`s (Redis queue): how many and how busy
        ws = pool.remote_workers
        body["workers"] = {"alive": len(ws), "capacity": sum(w.capacity for w in ws),
                           "in_flight": sum(w.in_flight for w in ws), "draining": sum(1 for w in ws if w.draining)}
    return body


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.local_worker is not None:
        state.metrics.in_flight.set(state.local_worker.stats().in_flight)
    for pool in state.pools:  # embedding engines' mean batch (inputs per step)
        stats = getattr(pool.engine, "stats", None) if pool.kind == "embedding" and pool.local_worker else None
        if stats is not None and stats.steps:
            state.metrics.embedding_step_inputs.labels(pool.model_name or "").set(stats.inputs / stats.steps)
    resp = web.Response(body=generate_latest(state.metrics.registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
