"""The OpenAI routes and the operational ones (/health, /ready, /metrics).

Chat and legacy completions share one path: parse (http/offload.py), decide whether this gateway
tokenizes (the local engine may serve it) or only remote providers can, fit the prompt, build the
`GenerationRequest` (http/prompt.py), submit it to the router, and answer as JSON or SSE (http/sse.py)
in the endpoint's format (gateway/openai/). Every exit path closes the backend stream, so a vanished
client frees its engine slot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.request import Guide
from gateway import jsonio
from gateway.admission.auth import KEY_NAME, TIER_KEY
from gateway.backends.base import ChoiceStream
from gateway.errors import APIError
from gateway.http import prompt
from gateway.http.middleware import END_USER, request_id
from gateway.http.offload import OFFLOAD
from gateway.http.sse import collect, stream_sse
from gateway.messages import GenerationRequest
from gateway.openai import answer, chunks, tools
from gateway.openai.choices import ChoiceAcc, TokenUsage
from gateway.openai.chunks import ChunkEncoder
from gateway.openai.logprobs import TokenPieces
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from gateway.openai.shape import AnswerShape, chat_shape, completion_shape
from gateway.queue.base import QueueFull
from gateway.routing.router import BACKEND_HEADER
from gateway.settings import cache_salt
from gateway.state import STATE, GatewayState

# ---------------------------------------------------------------- readiness


def _require_ready(state: GatewayState) -> None:
    if state.draining:
        raise APIError(503, "This gateway is shutting down; retry (another gateway will answer).",
                       code="shutting_down", retry_after=1)
    if state.no_engine and state.engine is not None and not state.remote_workers:
        raise APIError(503, "No engine worker is alive for this model.", code="no_workers", retry_after=1)
    if not state.ready:
        msg = "The model is still loading." if state.load_error is None else "The engine is not available."
        raise APIError(503, msg, code="not_ready", retry_after=1)


def _check_model(state: GatewayState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist. Available: {state.model_name}.",
                       param="model", code="model_not_found")


def _tokenize_here(state: GatewayState, model: str) -> bool:
    """True: tokenize here, the local engine may serve it (the router may still overflow it);
    False: only remote providers can take it now (a remote-only model, or no engine worker ready)."""
    router = state.router
    if router is not None and router.serves_remotely(model) and not state.draining:
        return model == state.model_name and state.ready
    _require_ready(state)
    _check_model(state, model)
    return True


# ---------------------------------------------------------------- the two formats of an answer


@dataclass(frozen=True)
class _Format:
    id_prefix: str
    response: Callable[[str, int, str, list[ChoiceAcc], TokenUsage, AnswerShape], dict[str, object]]
    chunks: Callable[[str, int, str, bool, AnswerShape], ChunkEncoder]  # (rid, created, model, usage?, shape)


_CHAT = _Format("chatcmpl", answer.chat_answer, chunks.ShapedChatChunks)
_COMPLETION = _Format("cmpl", answer.completion_answer, chunks.ShapedCompletionChunks)


# ---------------------------------------------------------------- the shared generation path


async def _generate(request: web.Request, state: GatewayState, req: ChatCompletionRequest | CompletionRequest,
                    prompt_ids: Sequence[int], max_tokens: int, fmt: _Format, shape: AnswerShape,
                    guide: Guide | None = None, needs_remote: str | None = None) -> web.StreamResponse:
    tier = request.get(TIER_KEY, state.settings.auth.anonymous_tier)
    end_user = req.user or getattr(req, "safety_identifier", None)
    if end_user:
        request[END_USER] = end_user
    n = req.n or 1
    if n > state.queue.depth_limit(tier):
        raise APIError(400, f"n={n} choices cannot be queued: the {tier} tier queues at most "
                            f"{state.queue.depth_limit(tier)} requests at once. Lower n.", param="n",
                       code="invalid_value")
    rid = f"{fmt.id_prefix}-{os.urandom(16).hex()}"
    key = request.get(KEY_NAME)
    gen = GenerationRequest(
        request_id=rid, prompt_token_ids=list(prompt_ids),
        sampling=prompt.sampling_params(req, max_tokens, getattr(state.engine, "generation_defaults", None),
                                        guide=guide, logprobs=shape.top_logprobs),
        needs_remote=needs_remote,
        n=n, tier=tier, priority=prompt.tier_priority(state.settings.tiers, tier),
        deadline=prompt.deadline(state.settings.tiers, request.headers.get(prompt.DEADLINE_HEADER), tier),
        model=req.model, api=req, endpoint="chat" if isinstance(req, ChatCompletionRequest) else "completion",
        key=key, cache_salt=cache_salt(state.settings.auth.prefix_cache_scope, key, tier, req.cache_salt))
    assert state.router is not None
    try:
        stream: ChoiceStream = await state.router.submit(gen)
    except QueueFull as e:
        raise APIError(503, f"The server is overloaded ({e.tier} queue full); retry shortly.",
                       type="overloaded_error", code="queue_full", retry_after=e.retry_after) from None
    created = int(time.time())
    model = req.model  # the local model's id, or the Sluice name of a remote one

    def usage(accs: list[ChoiceAcc]) -> TokenUsage:
        reported = stream.prompt_tokens  # the provider's count when remote
        return TokenUsage.of(len(prompt_ids) if reported is None else reported, accs)

    if not req.stream:
        accs = await collect(stream, n)
        u = usage(accs)
        state.metrics.completion_tokens.inc(u.completion_tokens)
        return web.Response(body=jsonio.dumps(fmt.response(rid, created, model, accs, u, shape)),
                            content_type="application/json", charset="utf-8",
                            headers={BACKEND_HEADER: stream.backend})

    include_usage = req.include_usage()
    resp, completion = await stream_sse(request, stream, n, fmt.chunks(rid, created, model, include_usage, shape),
                                        usage if include_usage else None, request_id(request))
    state.metrics.completion_tokens.inc(completion)
    return resp


def _marker(state: GatewayState) -> list[int]:
    assert state.engine is not None
    return state.engine.tokenizer.encode(prompt.TRUNCATION_MARKER)


def _capability(state: GatewayState, req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """What the local model cannot serve in this request: None, or the field (then only a remote provider
    that serves the model may take it; without one it is a 400 naming the field)."""
    field = req.local_unsupported()
    if field is None:
        return None
    if state.router is not None and state.router.serves_remotely(req.model) and not state.draining:
        return field
    raise APIError(400, f"{field}: the model `{req.model}` takes text only here, and no remote provider serves "
                        "it; remove the part or configure a provider that serves this model.",
                   param=field.split(" ")[0], code="unsupported_content")


def _pieces(state: GatewayState) -> TokenPieces | None:
    if state.engine is None:
        return None
    if state.token_pieces is None:
        tok = state.engine.tokenizer
        raw = getattr(tok, "_tok", None)  # the byte-level vocabulary, when the tokenizer exposes it
        vocab = {i: raw.id_to_token(i) for i in range(raw.get_vocab_size())} if raw is not None else None
        state.token_pieces = TokenPieces(tok, vocab)
    return state.token_pieces


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await request.app[OFFLOAD].parse(await request.read(), ChatCompletionRequest)
    requested = req.requested_max_tokens()
    needs_remote = _capability(state, req)
    shape, guide, specs = chat_shape(req, _pieces(state))
    if needs_remote is None and _tokenize_here(state, req.model):
        assert state.engine is not None
        messages = req.template_messages()
        if specs:
            messages = tools.with_tool_system(messages, specs)
        ids = await request.app[OFFLOAD].chat_prompt(state.engine.tokenizer, messages)
        ids = prompt.fit_prompt(ids, state.max_model_len, requested, req.prompt_truncation, _marker(state))
        max_tokens = prompt.resolve_max_tokens(state.max_model_len, len(ids), requested, None)
    else:  # remote providers only: they tokenize, parse tools, and their usage is what counts
        ids, max_tokens = [], requested or 0
        shape = AnswerShape()
    try:
        return await _generate(request, state, req, ids, max_tokens, _CHAT, shape, guide, needs_remote)
    except APIError as e:
        if specs and shape.tool_grammar and e.code == "invalid_grammar":  # the engine refused the tools' grammar
            param, message = await tools.invalid_tool(specs, e.message)
            raise APIError(400, message, param=param, code="invalid_grammar") from None
        raise


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await request.app[OFFLOAD].parse(await request.read(), CompletionRequest)
    ids: Sequence[int]
    shape, guide = completion_shape(req, _pieces(state))
    if _tokenize_here(state, req.model):
        assert state.engine is not None
        text_or_ids = req.prompt_text_or_ids()
        ids = (await request.app[OFFLOAD].encode(state.engine.tokenizer, text_or_ids) if isinstance(text_or_ids, str)
               else text_or_ids)
        if not ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
        ids = prompt.fit_prompt(ids, state.max_model_len, req.max_tokens, req.prompt_truncation, _marker(state))
        # OpenAI's default max_tokens for completions: 16
        max_tokens = prompt.resolve_max_tokens(state.max_model_len, len(ids), req.max_tokens, 16, "prompt")
    else:  # remote providers only
        ids, max_tokens = [], req.max_tokens or 0
        shape = AnswerShape()
    return await _generate(request, state, req, ids, max_tokens, _COMPLETION, shape, guide)


# ---------------------------------------------------------------- models and operations


def _served_models(state: GatewayState) -> list[str]:
    """The local model (once ready) and every model a remote provider serves."""
    local = [state.model_name] if state.ready and state.model_name else []
    remote = state.router.remote_models() if state.router is not None else []
    return local + [m for m in remote if m not in local]


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    models = _served_models(state)
    if not models:
        _require_ready(state)
    body = ModelList(data=[ModelCard(id=m, created=state.created) for m in models])
    return web.json_response(body.model_dump())


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = request.match_info["model"]
    if model not in _served_models(state):
        _require_ready(state)
        _check_model(state, model)
    return web.json_response(ModelCard(id=model, created=state.created).model_dump())


async def health(request: web.Request) -> web.Response:  # noqa: ARG001 (a handler)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: dict[str, Any] = {"status": "ready" if state.ready else "not_ready", "model": state.model_name}
    if state.load_error:
        body["error"] = state.load_error
    if state.local_worker is not None:
        body["worker"] = state.local_worker.stats().to_dict()
    if state.remote_workers is not None:  # `sluice worker`s (Redis queue): how many and how busy
        ws = state.remote_workers
        body["workers"] = {"alive": len(ws), "capacity": sum(w.capacity for w in ws),
                           "in_flight": sum(w.in_flight for w in ws), "draining": sum(1 for w in ws if w.draining)}
    if state.draining:
        body["draining"] = True
    body["queue_depth"] = {t: await state.queue.depth(t) for t in state.settings.tiers}
    if state.remote is not None:  # circuits and configuration errors
        body["providers"] = state.remote.status()
    return web.json_response(body, status=200 if state.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.local_worker is not None:
        state.metrics.in_flight.set(state.local_worker.stats().in_flight)
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
