"""`sluice worker`: an engine process that drains the shared Redis queue (no HTTP)."""

from __future__ import annotations

import asyncio
import logging

from gateway.settings import Settings
from gateway.worker.factory import load_engine, make_queue
from gateway.worker.worker import EngineWorker

log = logging.getLogger("sluice")


async def run_worker(settings: Settings, stop: asyncio.Event) -> None:
    queue = make_queue(settings)
    queue.start_reaper()
    engine = await asyncio.to_thread(load_engine, settings)
    model = settings.model.served_model_name or engine.model_name
    q = settings.queue
    worker = EngineWorker(engine, queue, max_batch=q.max_batch, heartbeat_s=q.heartbeat_s, model_name=model)
    await worker.start()
    log.info("sluice worker %s: model=%s capacity=%d, draining %s", getattr(queue, "consumer_id", "?"), model,
             worker.capacity, settings.redis_url)
    await stop.wait()
    # Graceful: stop pulling, let in-flight requests finish within the grace period, hand the rest
    # back to the queue with the tokens already sent (another worker continues them), exit.
    log.info("worker shutting down: finishing %d in-flight requests for up to %.0fs",
             worker.stats().in_flight, settings.server.shutdown_grace_s)
    await worker.stop(grace_s=settings.server.shutdown_grace_s, handback=True)
    await queue.close()
    log.info("worker stopped")
