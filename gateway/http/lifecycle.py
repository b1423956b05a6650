"""What starts with a gateway and stops with it: aiohttp cleanup contexts, appended by `create_app` in
this order (aiohttp stops them in reverse):

  1. `usage_ledger`: spend is recorded before the engine starts and after it stops, so the last answers
     are written too;
  2. `engine_lifecycle`: the engine side of the process: the embedded engine and its worker (loaded in
     the background so /health answers at once and /ready turns 200 when they run), or, with
     `--no-engine`, the model's frontend plus a watch on the live `sluice worker`s behind the Redis
     queue; then the queue and the request-preparation helper;
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
from gateway.backends.remote.backend import RemoteBackend
from gateway.http.offload import OFFLOAD
from gateway.routing.sampler import MetricsSampler
from gateway.state import STATE, GatewayState
from gateway.tasks import cancel_and_wait, run_forever
from gateway.worker.engine_api import ModelFrontend
from gateway.worker.factory import load_engine, load_frontend
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


async def _start(state: GatewayState) -> None:
    try:
        if state.no_engine:
            frontend: ModelFrontend = (state.engine if state.engine is not None
                                       else await asyncio.to_thread(load_frontend, state.settings))
            state.engine = frontend
            state.model_name = state.settings.model.served_model_name or frontend.model_name
            state.max_model_len = int(frontend.max_model_len)
            log.info("gateway only (no local engine): model=%s max_model_len=%d", state.model_name,
                     state.max_model_len)
            return
        engine: ModelFrontend = (state.engine if state.engine is not None
                                 else await asyncio.to_thread(load_engine, state.settings))
        state.engine = engine
        state.model_name = state.settings.model.served_model_name or engine.model_name
        state.max_model_len = int(engine.max_model_len)
        q = state.settings.queue
        worker = EngineWorker(engine, state.queue, max_batch=q.max_batch,  # type: ignore[arg-type]
                              heartbeat_s=q.heartbeat_s, model_name=state.model_name,
                              on_pulled=state.metrics.observe_queue_time)
        await worker.start()
        state.local_worker = worker
        log.info("engine ready: model=%s max_model_len=%d max_running_requests=%d",
                 state.model_name, state.max_model_len, worker.capacity)
    except Exception as e:  # /ready reports it; /health stays up so operators can see why
        state.load_error = f"{type(e).__name__}: {e}"
        log.exception("engine failed to start")


async def _watch_workers(state: GatewayState) -> None:
    """Keeps `state.remote_workers` (live workers serving this model) fresh for /ready and routing."""
    async def refresh() -> None:
        workers = await state.queue.workers()
        if workers is not None:
            state.remote_workers = [w for w in workers if state.model_name is None or w.model == state.model_name]
    await run_forever(refresh, every_s=state.settings.queue.heartbeat_s, log=log, what="listing workers")


async def engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.queue.start_reaper()
    tasks = [asyncio.create_task(_start(state), name="sluice-engine-start")]
    if state.no_engine:
        tasks.append(asyncio.create_task(_watch_workers(state), name="sluice-worker-watch"))
    yield
    await cancel_and_wait(tasks)  # re-cancels: redis-py can absorb a CancelledError mid-command
    if state.local_worker is not None:
        await state.local_worker.stop(grace_s=state.settings.server.shutdown_grace_s)
    await state.queue.close()
    app[OFFLOAD].close()


def services(sampler: MetricsSampler, remote: RemoteBackend | None, limiter: Limiter) -> CleanupContext:
    async def ctx(app: web.Application) -> AsyncIterator[None]:  # noqa: ARG001 (aiohttp passes it)
        sampler.start()
        yield
        await sampler.close()
        if remote is not None:
            await remote.close()
        await limiter.close()

    return ctx
