"""The aiohttp application: OpenAI routes on top of a Backend, plus health/readiness/metrics.

`create_app(settings, engine=None)` builds everything; the engine (when not given) loads in the
background so /health answers at once and /ready turns 200 when the engine and worker run.
Handlers validate and tokenize, check the context budget, then hand a `GenerationRequest` to the
backend; every exit path closes the backend stream so a vanished client frees its engine slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from engine.request import SamplingParams
from gateway import router as remote_router
from gateway import serving
from gateway.auth import KEY_NAME, RESPONSE, TIER_KEY, make_auth_middleware
from gateway.backends.base import Backend, ChoiceStream, GenerationRequest
from gateway.backends.local import LocalBackend
from gateway.config import Settings, cache_salt
from gateway.errors import APIError, error_middleware
from gateway.keys import KeyStore
from gateway.offload import Offloader, RequestLimits
from gateway.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from gateway.queue.base import ErrorOutput, QueueFull, RequestQueue
from gateway.queue.memory import MemoryQueue
from gateway.worker import EngineWorker

log = logging.getLogger("sluice.gateway")

STATE: web.AppKey["GatewayState"] = web.AppKey("sluice_state", object)  # type: ignore[arg-type]
LOADER: web.AppKey[asyncio.Task] = web.AppKey("sluice_loader", asyncio.Task)
REQUEST_ID: web.RequestKey[str] = web.RequestKey("sluice_request_id", str)
REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


@dataclass
class GatewayState:
    settings: Settings
    keys: KeyStore
    engine: Any = None
    queue: RequestQueue | None = None
    worker: EngineWorker | None = None
    backend: Backend | None = None
    router: Any = None  # gateway.router.Router (wraps `backend` once the app starts)
    model_name: str | None = None
    max_model_len: int = 0
    load_error: str | None = None
    no_engine: bool = False  # gateway only: engine workers run elsewhere (`sluice worker`, Redis queue)
    draining: bool = False  # SIGTERM received: new requests get 503 + Retry-After
    workers: list[dict[str, Any]] | None = None  # live remote workers of this model (Redis queue)
    created: int = field(default_factory=lambda: int(time.time()))
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    offload: Offloader = field(default_factory=lambda: Offloader(RequestLimits()))

    def __post_init__(self) -> None:
        self.m_requests = Counter("sluice_requests_total", "HTTP requests", ["endpoint", "status"],
                                  registry=self.registry)
        self.m_tokens = Counter("sluice_completion_tokens_total", "Generated tokens", registry=self.registry)
        self.m_latency = Histogram("sluice_request_seconds", "Request latency", ["endpoint"],
                                   registry=self.registry)
        self.m_in_flight = Gauge("sluice_in_flight", "Requests inside the engine", registry=self.registry)

    @property
    def ready(self) -> bool:
        if self.draining or self.engine is None:
            return False
        local = self.worker is not None and self.worker.running
        if self.no_engine:
            return bool(self.workers)
        return local


def request_id(request: web.Request) -> str:
    rid = request.get(REQUEST_ID)
    if rid is None:
        client = request.headers.get(REQUEST_ID_HEADER, "")
        rid = client if _VALID_REQUEST_ID.match(client) else uuid.uuid4().hex
        request[REQUEST_ID] = rid
    return rid


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[REQUEST_ID_HEADER] = request_id(request)


# ---------------------------------------------------------------- engine & worker lifecycle


def load_engine(settings: Settings) -> Any:
    """Build the engine from settings (slow: loads weights). Imports torch, so callers set OMP first."""
    from pydantic import TypeAdapter

    from engine import EngineConfig, LLMEngine

    config = TypeAdapter(EngineConfig).validate_python(settings.engine_kwargs())
    return LLMEngine(config)


class Frontend:
    """What the handlers need from an engine when the engine runs elsewhere: tokenizer, name, context."""

    def __init__(self, settings: Settings):
        from engine.loader import load_model
        from engine.tokenizer import Tokenizer

        loaded = load_model(settings.model.path, with_weights=False)
        self.tokenizer = Tokenizer(loaded)
        self.model_name = settings.model.served_model_name or settings.engine.get("served_model_name") or loaded.name
        self.max_model_len = int(settings.engine.get("max_model_len") or loaded.args.max_position_embeddings)
        self.generation_defaults = dict(loaded.generation_defaults)


def make_queue(settings: Settings) -> RequestQueue:
    """The Redis queue when `redis_url` is set, else the in-process one."""
    q = settings.queue
    kw = dict(max_depth=dict(q.max_depth), fill_target=q.fill_target, max_wait_ms=q.max_wait_ms, aging_s=q.aging_s)
    if settings.redis_url:
        from gateway.queue.redis import RedisQueue

        return RedisQueue(settings.redis_url, prefix=q.key_prefix, lease_s=q.lease_s, result_ttl_s=q.result_ttl_s,
                          heartbeat_ttl_s=5 * q.heartbeat_s, **kw)
    return MemoryQueue(**kw)


async def _watch_workers(app: web.Application) -> None:
    """Keeps `state.workers` (live remote workers serving this model) fresh for /ready and routing."""
    state = app[STATE]
    assert state.queue is not None
    while True:
        try:
            workers = await state.queue.workers()
            if workers is not None:
                state.workers = [w for w in workers if state.model_name is None or w.get("model") == state.model_name]
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Redis unreachable: keep the last view, retry
            log.warning("listing workers failed: %s", e)
        await asyncio.sleep(state.settings.queue.heartbeat_s)


async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    try:
        if state.no_engine:
            if state.engine is None:
                state.engine = await asyncio.to_thread(Frontend, state.settings)
            state.model_name = state.settings.model.served_model_name or state.engine.model_name
            state.max_model_len = int(state.engine.max_model_len)
            log.info("gateway only (no local engine): model=%s max_model_len=%d", state.model_name,
                     state.max_model_len)
            return
        if state.engine is None:
            state.engine = await asyncio.to_thread(load_engine, state.settings)
        engine = state.engine
        state.model_name = state.settings.model.served_model_name or engine.model_name
        state.max_model_len = int(engine.max_model_len)
        worker = EngineWorker(engine, state.queue, max_batch=state.settings.queue.max_batch,
                              heartbeat_s=state.settings.queue.heartbeat_s, model_name=state.model_name)
        await worker.start()
        state.worker = worker
        log.info("engine ready: model=%s max_model_len=%d max_running_requests=%d",
                 state.model_name, state.max_model_len, worker.capacity)
    except Exception as e:  # /ready reports it; /health stays up so operators can see why
        state.load_error = f"{type(e).__name__}: {e}"
        log.exception("engine failed to start")


async def _lifecycle(app: web.Application):
    state = app[STATE]
    if state.queue is None:
        state.queue = make_queue(state.settings)
    if state.backend is None:
        state.backend = LocalBackend(state.queue)
    state.queue.start_reaper()
    loader = asyncio.create_task(_start_engine(app))
    app[LOADER] = loader
    watcher = asyncio.create_task(_watch_workers(app)) if state.no_engine else None
    yield
    for t in (loader, watcher):
        if t is not None:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
    if state.worker is not None:
        await state.worker.stop(grace_s=state.settings.server.shutdown_grace_s)
    await state.queue.close()
    state.offload.close()


# ---------------------------------------------------------------- shared handler helpers


async def _read_json(request: web.Request, model: type) -> Any:
    """The validated request; a large body is parsed in the helper process (see gateway/offload.py)."""
    body = await request.read()  # raises 413 beyond client_max_size
    return await request.app[STATE].offload.parse(body, model)


def _require_ready(state: GatewayState) -> None:
    if state.draining:
        raise APIError(503, "This gateway is shutting down; retry (another gateway will answer).",
                       code="shutting_down", retry_after=1)
    if state.no_engine and state.engine is not None and not state.workers:
        raise APIError(503, "No engine worker is alive for this model.", code="no_workers", retry_after=1)
    if not state.ready:
        msg = "The model is still loading." if state.load_error is None else "The engine is not available."
        raise APIError(503, msg, code="not_ready", retry_after=1)


def _check_model(state: GatewayState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist. Available: {state.model_name}.",
                       param="model", code="model_not_found")


def _resolve_max_tokens(state: GatewayState, prompt_len: int, requested: int | None,
                        default: int | None) -> int:
    limit = state.max_model_len
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                            f"{prompt_len} tokens. Please shorten the prompt.",
                       param="messages", code="context_length_exceeded")
    available = limit - prompt_len
    if requested is None:
        return available if default is None else min(default, available)
    if requested > available:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. The prompt has "
                            f"{prompt_len} tokens, so at most {available} tokens are available for the "
                            f"completion, but {requested} were requested. Lower max_tokens.",
                       param="max_tokens", code="context_length_exceeded")
    return requested


def _tier_priority(state: GatewayState, tier: str) -> int:
    tiers = state.settings.tiers
    if tier in tiers:
        return tiers[tier].priority
    return max(t.priority for t in tiers.values())


DEADLINE_HEADER = "x-request-timeout"  # seconds the client is willing to wait (its own timeout)


def _deadline(state: GatewayState, request: web.Request, tier: str) -> float | None:
    """When a still-queued request stops being wanted: the tier's deadline_s, or the client's timeout."""
    limits = []
    t = state.settings.tiers.get(tier)
    if t is not None and t.deadline_s is not None:
        limits.append(t.deadline_s)
    try:
        client = float(request.headers.get(DEADLINE_HEADER, ""))
        if client > 0:
            limits.append(client)
    except ValueError:
        pass
    return time.time() + min(limits) if limits else None


def _sampling(req: ChatCompletionRequest | CompletionRequest, max_tokens: int,
              defaults: dict[str, float] | None = None) -> SamplingParams:
    """Fields the request leaves out take the model's recommended values, then OpenAI's defaults."""
    d = defaults or {}
    return SamplingParams(
        temperature=float(d.get("temperature", 1.0)) if req.temperature is None else float(req.temperature),
        top_p=float(d.get("top_p", 1.0)) if req.top_p is None else float(req.top_p),
        top_k=int(d.get("top_k", 0)) if req.top_k is None else req.top_k,
        max_tokens=max_tokens,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
    )


TRUNCATION_MARKER = "\n\n[... middle of the prompt truncated ...]\n\n"


def _fit_prompt(state: GatewayState, ids: list[int], requested_max_tokens: int | None, mode: str | None) -> list[int]:
    """With prompt_truncation="middle", cut an over-long prompt's middle (the head keeps the system prompt,
    the tail the latest turn and the generation prompt) so that it and max_tokens fit the context."""
    limit = state.max_model_len
    reserve = requested_max_tokens if requested_max_tokens is not None else min(256, limit // 4)
    budget = limit - reserve
    if mode != "middle" or len(ids) <= budget:
        # A long prompt arrives as an array; one over the context is refused by length right after this.
        return ids if len(ids) >= limit else list(ids)
    marker = state.engine.tokenizer.encode(TRUNCATION_MARKER)
    keep = budget - len(marker)
    if keep < 2:
        raise APIError(400, f"max_tokens {reserve} leaves no room for the prompt in the {limit}-token context.",
                       param="max_tokens", code="context_length_exceeded")
    head = keep // 2
    return list(ids[:head]) + marker + list(ids[len(ids) - (keep - head):])


async def _submit(state: GatewayState, gen: GenerationRequest) -> ChoiceStream:
    assert state.backend is not None
    try:
        return await state.backend.submit(gen)
    except QueueFull as e:
        raise APIError(503, f"The server is overloaded ({e.tier} queue full); retry shortly.",
                       type="overloaded_error", code="queue_full", retry_after=e.retry_after) from None


def _raise_for_output(out: Any) -> None:
    """Turn an errored or aborted engine output into an APIError."""
    if isinstance(out, ErrorOutput):
        raise APIError(out.error_status, out.error or "engine error", param=out.error_param,
                       code=out.error_code)
    if out.finish_reason == "error" or out.error:
        raise APIError(500, out.error or "engine error", type="server_error", code="engine_error")
    if out.finish_reason == "abort":
        raise APIError(503, "The request was aborted (server shutting down).", code="aborted", retry_after=1)


@dataclass
class _ChoiceAcc:
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False


def _usage(prompt_len: int, accs: list[_ChoiceAcc]) -> Usage:
    completion = sum(a.completion_tokens for a in accs)
    return Usage(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=max((a.cached_tokens for a in accs),
                                                                             default=0)))


def _accumulate(acc: _ChoiceAcc, out: Any) -> None:
    acc.completion_tokens = max(acc.completion_tokens, out.completion_tokens)
    acc.cached_tokens = max(acc.cached_tokens, out.cached_tokens)
    if out.finished:
        acc.finish_reason = out.finish_reason


async def _collect(stream: ChoiceStream, n: int) -> list[_ChoiceAcc]:
    accs = [_ChoiceAcc() for _ in range(n)]
    async with stream:
        async for ch in stream:
            _raise_for_output(ch.output)
            acc = accs[ch.index]
            if ch.output.text:
                acc.text.append(ch.output.text)
            _accumulate(acc, ch.output)
    return accs


def _sse(obj: Any) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _first(stream: ChoiceStream):
    """The first output, so engine rejections become a real HTTP status before the SSE headers."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return None
    _raise_for_output(first.output)
    return first


async def _stream_sse(request: web.Request, state: GatewayState, stream: ChoiceStream, n: int,
                      make_chunks, make_usage_chunk) -> web.StreamResponse:
    """Shared SSE loop. `make_chunks(index, output, acc)` returns the chunk dicts for one output."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    accs = [_ChoiceAcc() for _ in range(n)]
    async with stream:
        first = await _first(stream)
        resp.headers[remote_router.BACKEND_HEADER] = remote_router.stream_backend(stream)
        await resp.prepare(request)
        try:
            pending = [first] if first is not None else []
            while True:
                if pending:
                    ch = pending.pop()
                else:
                    try:
                        ch = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                out = ch.output
                if out.finish_reason in ("error", "abort") or out.error:
                    _accumulate(accs[ch.index], out)  # the usage chunk reports the tokens billed so far
                    try:
                        _raise_for_output(out)
                    except APIError as e:
                        await resp.write(_sse(e.body()))
                    break
                acc = accs[ch.index]
                _accumulate(acc, out)
                for chunk in make_chunks(ch.index, out, acc):
                    await resp.write(_sse(chunk))
            usage_chunk = make_usage_chunk(accs)
            if usage_chunk is not None:
                await resp.write(_sse(usage_chunk))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            log.info("client disconnected mid-stream (request %s); cancelling", request_id(request))
        state.m_tokens.inc(sum(a.completion_tokens for a in accs))
    return resp


# ---------------------------------------------------------------- routes


async def _submit_generation(request: web.Request, state: GatewayState, req: ChatCompletionRequest | CompletionRequest,
                             prompt_ids: list[int], max_tokens: int, id_prefix: str) -> tuple[str, ChoiceStream]:
    """Builds the backend request (tier, priority, deadline, sampling) and submits it; returns its id and stream."""
    tier = request.get(TIER_KEY, state.settings.auth.anonymous_tier)
    n = req.n or 1
    if state.queue is not None and n > state.queue.depth_limit(tier):
        raise APIError(400, f"n={n} choices cannot be queued: the {tier} tier queues at most "
                            f"{state.queue.depth_limit(tier)} requests at once. Lower n.", param="n",
                       code="invalid_value")
    rid = f"{id_prefix}-{uuid.uuid4().hex}"
    sampling = _sampling(req, max_tokens, getattr(state.engine, "generation_defaults", None))
    gen = GenerationRequest(request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
                            n=req.n or 1, tier=tier, priority=_tier_priority(state, tier),
                            deadline=_deadline(state, request, tier), model=req.model, api=req,
                            endpoint="chat" if isinstance(req, ChatCompletionRequest) else "completion",
                            key=request.get(KEY_NAME),
                            cache_salt=cache_salt(state.settings.auth.prefix_cache_scope, request.get(KEY_NAME),
                                                  tier, req.cache_salt))
    return rid, await _submit(state, gen)


def _route_local(state: GatewayState, model: str) -> bool:
    """True: tokenize here, the local engine may serve it (the router may still overflow it);
    False: only remote providers can take it now (a remote-only model, or no engine worker ready)."""
    router = state.router
    if router is not None and router.serves_remotely(model) and not state.draining:
        return model == state.model_name and state.ready
    _require_ready(state)
    _check_model(state, model)
    return True


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await _read_json(request, ChatCompletionRequest)
    if _route_local(state, req.model):
        prompt_ids = await state.offload.chat_prompt(state.engine.tokenizer, req.template_messages())
        prompt_ids = _fit_prompt(state, prompt_ids, req.requested_max_tokens(), req.prompt_truncation)
        max_tokens = _resolve_max_tokens(state, len(prompt_ids), req.requested_max_tokens(), None)
    else:  # remote providers only: they tokenize, and their usage is what counts
        prompt_ids, max_tokens = [], req.requested_max_tokens() or 0
    n = req.n or 1
    rid, stream = await _submit_generation(request, state, req, prompt_ids, max_tokens, "chatcmpl")
    created = int(time.time())
    model = req.model  # the local model's id, or the Sluice name of a remote one

    if not req.stream:
        accs = await _collect(stream, n)
        body = ChatCompletionResponse(
            id=rid, created=created, model=model,
            choices=[ChatChoice(index=i, message=ChatMessageOut(content="".join(a.text)),
                                finish_reason=a.finish_reason) for i, a in enumerate(accs)],
            usage=_usage(remote_router.stream_prompt_tokens(stream, len(prompt_ids)), accs))
        state.m_tokens.inc(body.usage.completion_tokens)
        return web.json_response(body.model_dump(),
                                 headers={remote_router.BACKEND_HEADER: remote_router.stream_backend(stream)})

    include_usage = req.include_usage()

    def chunk(index: int, delta: ChatDelta, finish: str | None = None) -> dict[str, Any]:
        c = ChatCompletionChunk(id=rid, created=created, model=model,
                                choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish)])
        d = c.model_dump()
        d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        if not include_usage:
            d.pop("usage")
        return d

    def make_chunks(index: int, out: Any, acc: _ChoiceAcc) -> list[dict[str, Any]]:
        chunks = []
        if not acc.started:
            acc.started = True
            chunks.append(chunk(index, ChatDelta(role="assistant", content="")))
        if out.text:
            chunks.append(chunk(index, ChatDelta(content=out.text)))
        if out.finished:
            chunks.append(chunk(index, ChatDelta(), out.finish_reason))
        return chunks

    def make_usage(accs: list[_ChoiceAcc]) -> dict[str, Any] | None:
        if not include_usage:
            return None
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                   usage=_usage(remote_router.stream_prompt_tokens(stream, len(prompt_ids)), accs)).model_dump()

    return await _stream_sse(request, state, stream, n, make_chunks, make_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = await _read_json(request, CompletionRequest)
    if _route_local(state, req.model):
        prompt = req.prompt_text_or_ids()
        prompt_ids = await state.offload.encode(state.engine.tokenizer, prompt) if isinstance(prompt, str) else prompt
        if not prompt_ids:
            raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
        prompt_ids = _fit_prompt(state, prompt_ids, req.max_tokens, req.prompt_truncation)
        try:
            max_tokens = _resolve_max_tokens(state, len(prompt_ids), req.max_tokens, 16)  # OpenAI's default: 16
        except APIError as e:
            if e.param == "messages":
                e.param = "prompt"
            raise
    else:  # remote providers only
        prompt_ids, max_tokens = [], req.max_tokens or 0
    n = req.n or 1
    rid, stream = await _submit_generation(request, state, req, prompt_ids, max_tokens, "cmpl")
    created = int(time.time())
    model = req.model  # the local model's id, or the Sluice name of a remote one

    if not req.stream:
        accs = await _collect(stream, n)
        body = CompletionResponse(
            id=rid, created=created, model=model,
            choices=[CompletionChoice(index=i, text="".join(a.text), finish_reason=a.finish_reason)
                     for i, a in enumerate(accs)],
            usage=_usage(remote_router.stream_prompt_tokens(stream, len(prompt_ids)), accs))
        state.m_tokens.inc(body.usage.completion_tokens)
        return web.json_response(body.model_dump(),
                                 headers={remote_router.BACKEND_HEADER: remote_router.stream_backend(stream)})

    include_usage = req.include_usage()

    def make_chunks(index: int, out: Any, acc: _ChoiceAcc) -> list[dict[str, Any]]:
        if not out.text and not out.finished:
            return []
        d = CompletionResponse(id=rid, created=created, model=model, choices=[
            CompletionChoice(index=index, text=out.text, finish_reason=out.finish_reason if out.finished else None)
        ]).model_dump()
        if not include_usage:
            d.pop("usage")
        return [d]

    def make_usage(accs: list[_ChoiceAcc]) -> dict[str, Any] | None:
        if not include_usage:
            return None
        return CompletionResponse(id=rid, created=created, model=model, choices=[],
                                  usage=_usage(remote_router.stream_prompt_tokens(stream, len(prompt_ids)), accs)).model_dump()

    return await _stream_sse(request, state, stream, n, make_chunks, make_usage)


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


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: dict[str, Any] = {"status": "ready" if state.ready else "not_ready", "model": state.model_name}
    if state.load_error:
        body["error"] = state.load_error
    if state.worker is not None:
        body["worker"] = state.worker.stats()
    if state.workers is not None:  # remote workers (Redis queue): how many and how busy, for the router
        body["workers"] = {"alive": len(state.workers),
                           "capacity": sum(int(w.get("capacity", 0)) for w in state.workers),
                           "in_flight": sum(int(w.get("in_flight", 0)) for w in state.workers),
                           "draining": sum(1 for w in state.workers if w.get("draining"))}
    if state.draining:
        body["draining"] = True
    if state.queue is not None:
        body["queue_depth"] = {t: await state.queue.depth(t) for t in state.settings.tiers}
    if state.router is not None and state.router.remote is not None:  # circuits and configuration errors
        body["providers"] = state.router.remote.status()
    return web.json_response(body, status=200 if state.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.worker is not None:
        state.m_in_flight.set(state.worker.stats()["in_flight"])
    resp = web.Response(body=generate_latest(state.registry))
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


@web.middleware
async def _access_log(request: web.Request, handler):
    """One line per API request (never the Authorization header) and the Prometheus counters."""
    start = time.monotonic()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except asyncio.CancelledError:
        # The handler was cancelled (client gone, or a revoked key's request stopped). Once the headers
        # went out, the status the client got is the response's (a stream whose client closes right
        # after [DONE] is a 200); 499 only when nothing was sent.
        sent = request.get(RESPONSE)
        status = sent.status if sent is not None and sent.prepared else 499
        raise
    finally:
        if request.path.startswith("/v1/"):
            state = request.app[STATE]
            elapsed = time.monotonic() - start
            state.m_requests.labels(request.path, str(status)).inc()
            state.m_latency.labels(request.path).observe(elapsed)
            log.info("%s %s %d %.3fs request_id=%s tier=%s", request.method, request.path, status, elapsed,
                     request_id(request), request.get(TIER_KEY, "-"))


def create_app(settings: Settings, engine: Any = None, *, queue: RequestQueue | None = None,
               keys: KeyStore | None = None, no_engine: bool = False) -> web.Application:
    """The gateway app. `engine`: an already-built engine (tests); None loads one from settings.
    `no_engine`: gateway only; engine workers (`sluice worker`) drain the Redis queue elsewhere, and
    `engine` (if given) only supplies the tokenizer, model name and context length."""
    keys = keys or KeyStore(settings.auth.keys_file)
    if no_engine and not settings.redis_url and queue is None:
        raise ValueError("a gateway without an engine needs the Redis queue (set redis_url / SLUICE_REDIS_URL)")
    state = GatewayState(settings=settings, keys=keys, engine=engine, queue=queue, no_engine=no_engine,
                         offload=Offloader(RequestLimits(max_messages=settings.server.max_messages,
                                                         max_prompt_chars=settings.server.max_prompt_chars)))
    app = web.Application(
        client_max_size=settings.server.max_body_bytes,
        middlewares=[_access_log, error_middleware, make_auth_middleware(keys, settings.auth.anonymous_tier)],
    )
    app[STATE] = state
    app.on_response_prepare.append(_add_request_id)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    remote_router.install(app)  # routing to remote providers, per-key limits, usage (GET /v1/usage)
    serving.install(app)  # body read timeout, the prepared response on the request, per-key metric labels
    return app
