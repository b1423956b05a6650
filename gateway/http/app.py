"""`create_app`: builds every part of a gateway once, with its dependencies, and wires them into one
aiohttp application. Reading it top to bottom shows the path of a request:

    middleware: access log -> errors -> auth -> per-key limits -> body timeout     (http/, admission/)
    routes:     parse, tokenize, fit the prompt -> router.submit                     (http/routes.py)
    router:     local (queue -> embedded or `sluice worker` engine) or remote chain (routing/, backends/)
    answer:     JSON or SSE, accounted on close                 (http/sse.py, openai/, routing/)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.admission import middleware as admission
from gateway.admission.keys import KeyStore
from gateway.admission.ledger import LedgerOptions, make_ledger
from gateway.admission.limits import make_limiter
from gateway.admission.spill import Spill
from gateway.admission.usage import UsageStore
from gateway.backends.local import LocalBackend, LocalEmbeddings
from gateway.backends.pool.backend import PoolBackend
from gateway.backends.remote.backend import RemoteBackend
from gateway.http import batches, dashboard, embeddings, files, responses, routes
from gateway.http.errors import error_middleware
from gateway.http.lifecycle import engine_lifecycle, services, usage_ledger
from gateway.http.middleware import access_log, body_timeout, on_response_prepare
from gateway.http.offload import OFFLOAD, Offloader, RequestLimits
from gateway.observability.metrics import Metrics, make_key_label
from gateway.queue.base import RequestQueue
from gateway.queue.memory import MemoryQueue
from gateway.routing.accounting import Accountant
from gateway.routing.embeddings import EmbeddingRouter
from gateway.routing.estimate import WaitEstimator
from gateway.routing.router import Router
from gateway.routing.sampler import MetricsSampler
from gateway.settings import ModelEntry, Settings
from gateway.state import STATE, GatewayState
from gateway.worker.factory import ModelFrontend, make_queue
from gateway.worker.pool import ModelPool


def create_app(settings: Settings, engine: ModelFrontend | None = None, *, queue: RequestQueue | None = None,
               keys: KeyStore | None = None, no_engine: bool = False,
               engines: dict[str, Any] | None = None) -> web.Application:
    """The gateway app, serving `settings.model_entries()` (one pool each). `engine`: an already-built chat
    engine (tests) for the first chat model; with `models` unset it is then the only model. `engines`:
    already-built engines of other models, by their configured id (tests). `queue`: the first chat model's
    queue (tests). `no_engine`: gateway only; engine workers (`sluice worker`) drain the Redis queues
    elsewhere, and `engine` (if given) only supplies the tokenizer, model name and context."""
    pool_only = no_engine and not settings.redis_url and queue is None and bool(settings.engines)
    if no_engine and not settings.redis_url and queue is None and not pool_only:
        raise ValueError("a gateway without an engine needs the Redis queue (set redis_url / SLUICE_REDIS_URL)")
    keys = keys or KeyStore(settings.auth.keys_file)
    metrics = Metrics(key_label=make_key_label(keys, settings.metrics.key_labels))
    limiter = make_limiter(settings.limits, settings.redis_url)
    usage_redis = settings.limits.redis_url or settings.redis_url
    spill_dir = settings.spill_dir()
    max_spill = int(settings.usage.max_spill_mb * 1e6)
    usage = UsageStore(usage_redis, spill=Spill(spill_dir / "usage-totals.spill.jsonl", max_spill),
                       reservation_ttl_s=settings.limits.reservation_ttl_s)
    ledger_path = settings.ledger_path()
    spill_name = f"{Path(ledger_path).name}.spill.jsonl" if ledger_path and not usage_redis \
        else "usage-ledger.spill.jsonl"
    ledger = make_ledger(ledger_path, usage_redis if settings.usage.enabled else None, LedgerOptions(
        flush_interval_s=settings.usage.flush_interval_s, retention_days=settings.usage.retention_days,
        spill_path=str(spill_dir / spill_name), max_spill_bytes=max_spill,
        max_pending_rows=settings.usage.max_pending_rows, ballast_bytes=int(settings.usage.ballast_mb * 1e6)))
    remote = RemoteBackend(settings.providers, settings.routing, metrics) if settings.providers else None
    engine_pool = PoolBackend(settings.engines, settings.routing, metrics) if settings.engines else None
    state = GatewayState(settings=settings, keys=keys, metrics=metrics, limiter=limiter, usage=usage,
                         remote=remote, engines=engine_pool, no_engine=no_engine)

    entries = settings.model_entries()
    if engine is not None and settings.models is None:
        entries = [e for e in entries if e.kind == "chat"]  # a given engine is the whole local side
    if pool_only:
        entries = []  # `--no-engine` with engine pools and no Redis: the pools are the whole local side
    first_chat = next((e for e in entries if e.kind == "chat"), None)
    for entry in entries:
        first = entry is first_chat
        pool = ModelPool(entry=entry, queue=(queue if first and queue is not None else
                                             make_queue(settings, entry, first_chat=first)),
                         no_engine=no_engine,
                         engine=engine if first and engine is not None else (engines or {}).get(entry.id or ""),
                         is_draining=lambda: state.draining)
        state.pools.append(pool)

    def accountant_for(estimator: WaitEstimator, price: dict[str, float] | None) -> Accountant:
        return Accountant(metrics, usage, limiter, estimator,
                          price if price is not None else settings.routing.local_price,
                          providers=settings.providers, ledger=ledger,
                          reserve_completion_tokens=settings.limits.reserve_completion_tokens,
                          batch_price_factor=settings.batches.price_factor)

    sampler: MetricsSampler | None = None
    for pool in state.pools:
        estimator = WaitEstimator(pool, pool.queue, settings.tiers, settings.routing)
        accountant = accountant_for(estimator, pool.entry.price)
        if pool.kind == "embedding":
            pool.router = EmbeddingRouter(local=LocalEmbeddings(pool.queue), remote=remote, side=pool,
                                          accountant=accountant, routing=settings.routing, metrics=metrics,
                                          tiers=settings.tiers, pool=engine_pool)
            continue
        pool.router = Router(local=LocalBackend(pool.queue), remote=remote, side=pool, estimator=estimator,
                             accountant=accountant, routing=settings.routing, metrics=metrics, pool=engine_pool)
        if sampler is None:  # the queue gauges describe the first chat model
            sampler = MetricsSampler(metrics, pool.queue, settings.tiers, estimator, remote)
    chat = state.chat
    if chat is not None:
        state.router = chat.router
    else:  # only remote models are chat models here: a router whose local side is never ready
        idle = ModelPool(entry=ModelEntry(id="-", kind="chat"), queue=MemoryQueue(), is_draining=lambda: True)
        state.idle_queue = idle.queue
        estimator = WaitEstimator(idle, idle.queue, settings.tiers, settings.routing)
        state.router = Router(local=LocalBackend(idle.queue), remote=remote, side=idle, estimator=estimator,
                              accountant=accountant_for(estimator, None), routing=settings.routing, metrics=metrics,
                              pool=engine_pool)
        sampler = MetricsSampler(metrics, idle.queue, settings.tiers, estimator, remote)
    assert sampler is not None
    idle_embed = ModelPool(entry=ModelEntry(id="-", kind="embedding"), queue=MemoryQueue(), is_draining=lambda: True)
    state.embedding_router = EmbeddingRouter(
        local=LocalEmbeddings(idle_embed.queue), remote=remote, side=idle_embed,
        accountant=accountant_for(WaitEstimator(idle_embed, idle_embed.queue, settings.tiers, settings.routing),
                                  None), routing=settings.routing, metrics=metrics, tiers=settings.tiers,
        pool=engine_pool)

    app = web.Application(client_max_size=settings.server.max_body_bytes)
    app[STATE] = state
    app[OFFLOAD] = Offloader(RequestLimits(max_messages=settings.server.max_messages,
                                           max_prompt_chars=settings.server.max_prompt_chars))
    app.middlewares.append(access_log(metrics))
    app.middlewares.append(error_middleware)
    admission.setup(app, keys=keys, anonymous_tier=settings.auth.anonymous_tier, limiter=limiter, usage=usage,
                    metrics=metrics, ledger=ledger)
    app.middlewares.append(body_timeout(settings.server.body_timeout_s))
    app.on_response_prepare.append(on_response_prepare)
    routes.setup(app)
    embeddings.setup(app)  # /v1/embeddings
    responses.setup(app, state)  # /v1/responses and its store
    files.setup(app, state)  # /v1/files
    batches.setup(app, state)  # /v1/batches and their runner
    dashboard.setup(app)  # /dashboard and /dashboard/data (admin-only once keys exist)

    app.cleanup_ctx.append(usage_ledger(usage, ledger))
    app.cleanup_ctx.append(engine_lifecycle)
    app.cleanup_ctx.append(services(sampler, remote, limiter, engine_pool))
    app.cleanup_ctx.append(batches.lifecycle)  # last: its runner stops first at shutdown
    return app
