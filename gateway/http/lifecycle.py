"""What starts with a gateway and stops with it: aiohttp cleanup contexts, appended by `create_app` in
this order (aiohttp stops them in reverse):

  1. `usage_ledger`: spend is recorded before the engine starts and after it stops, so the last answers
     are written too;
  2. `engine_lifecycle`: the engine side of the process: each model's embedded engine and worker
     (loaded in the background, one model after another, so /health answers at once and /ready turns 200
     when they all run), or, with `--no-engine`, each model's frontend plus a watch on the live
     `sluice worker`s behind its Redis queue; then the queues and the request-preparation helper;
  3. `services`: the metrics sampler, the remote providers' connection pools and the limiter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.admission.ledger import UsageLedger
from gateway.admission.limits import Limiter
from gateway.admission.usage import UsageStore
from gateway.backends.pool.backend import PoolBackend
from gateway.backends.remote.backend import RemoteBackend
from gateway.http.offload import OFFLOAD, Offloader
from gateway.routing.sampler import MetricsSampler
from gateway.state import STATE, GatewayState
from gateway.tasks import cancel_and_wait, run_forever
from gateway.worker.factory import load_engine, load_frontend
from gateway.worker.pool import ModelPool
from gateway.worker.worker import EngineWorker

log = logging.getLogger("sluice.gateway")

CleanupContext = Callable[[web.Application], AsyncIterator[None]]


def usage_ledger(usage: UsageStore, ledger: UsageLedger | None) -> CleanupContext:
    async def ctx(app: web.Application) -> AsyncIterator[None]:  # noqa: ARG001 (aiohttp passes it)
        """Before the engine starts, after it stops (its last answers are recorded too): what earlier runs
        spilled is taken in first."""
        await usage.open()
        if ledger is not None:
            await ledger.open()
            if usage.redis is None:  # in-memory totals: rebuilt from the ledger, so budgets survive a restart
                usage.restore(await ledger.totals_by_key() or {})
            ledger.start()
        usage.start()
        yield
        if ledger is not None:
            await ledger.close()
        await usage.close()

    return ctx


async def _start(state: GatewayState, pool: ModelPool) -> None:
    """Load one model: its engine and worker, or (gateway only) its frontend. Models load one after
    another (`_start_all`), so a small embedding model does not compete with the chat model for the CPU."""
    entry, kind = pool.entry, pool.kind
    try:
        if pool.no_engine:
            frontend = (pool.engine if pool.engine is not None
                        else await asyncio.to_thread(load_frontend, state.settings, entry))
            pool.engine = frontend
            pool.model_name = entry.id or frontend.model_name
            pool.max_model_len = _context(frontend)
            log.info("gateway only (no local engine): %s model=%s", kind, pool.model_name)
            return
        engine = pool.engine if pool.engine is not None else await asyncio.to_thread(load_engine, state.settings, entry)
        pool.engine = engine
        pool.model_name = entry.id or engine.model_name
        pool.max_model_len = _context(engine)
        q = state.settings.queue
        worker = EngineWorker(engine, pool.queue, max_batch=q.max_batch, heartbeat_s=q.heartbeat_s,
                              model_name=pool.model_name, on_pulled=state.metrics.observe_queue_time,
                              background_above=max(t.priority for t in state.settings.tiers.values()))
        await worker.start()
        pool.local_worker = worker
        log.info("engine ready: %s model=%s %s=%d max_running_requests=%d", kind, pool.model_name,
                 "max_model_len" if kind == "chat" else "max_input_tokens", pool.max_model_len, worker.capacity)
    except Exception as e:  # /ready reports it; /health stays up so operators can see why
        pool.load_error = f"{type(e).__name__}: {e}"
        log.exception("the %s model %s failed to start", kind, entry.id or "(default)")


def _context(engine: object) -> int:
    """A chat model's context, or an embedding model's longest input."""
    return int(getattr(engine, "max_model_len", 0) or getattr(engine, "max_input_tokens", 0))


async def _start_all(state: GatewayState, offload: Offloader) -> None:
    for pool in state.pools:
        await _start(state, pool)
    chat = next((p for p in state.pools if p.kind == "chat" and p.engine is not None), None)
    if chat is not None and getattr(chat.engine, "tokenizer", None) is not None and \
            state.settings.server.prepare_helper_at_start:
        offload.set_tokenizer(chat.engine.tokenizer)
        offload.warm()  # the first large request does not wait for the helper's start


async def _watch_workers(state: GatewayState, pool: ModelPool) -> None:
    """Keeps `pool.remote_workers` (live workers of this model's queue) fresh for /ready and routing."""
    async def refresh() -> None:
        workers = await pool.queue.workers()
        if workers is not None:
            pool.remote_workers = [w for w in workers if pool.model_name is None or w.model in pool.names]
    await run_forever(refresh, every_s=state.settings.queue.heartbeat_s, log=log, what="listing workers")


async def engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    for pool in state.pools:
        pool.queue.start_reaper()
    tasks = [asyncio.create_task(_start_all(state, app[OFFLOAD]), name="sluice-engine-start")]
    if state.no_engine:
        tasks += [asyncio.create_task(_watch_workers(state, pool), name="sluice-worker-watch")
                  for pool in state.pools]
    yield
    await cancel_and_wait(tasks)  # re-cancels: redis-py can absorb a CancelledError mid-command
    for pool in state.pools:
        if pool.local_worker is not None:
            await pool.local_worker.stop(grace_s=state.settings.server.shutdown_grace_s)
    for pool in state.pools:
        await pool.queue.close()
    app[OFFLOAD].close()


def services(sampler: MetricsSampler, remote: RemoteBackend | None, limiter: Limiter,
             pool: PoolBackend | None = None) -> CleanupContext:
    async def ctx(app: web.Application) -> AsyncIterator[None]:  # noqa: ARG001 (aiohttp passes it)
        sampler.start()
        if pool is not None:
            pool.start()  # replicas' load is known before the first request
        yield
        await sampler.close()
        if remote is not None:
            await remote.close()
        if pool is not None:
            await pool.close()
        await limiter.close()

    return ctx
