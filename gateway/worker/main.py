"""`sluice worker`: an engine process that drains one model's queue in the shared Redis (no HTTP)."""

from __future__ import annotations

import asyncio
import logging

from gateway.settings import ModelEntry, Settings
from gateway.worker.factory import load_engine, make_queue
from gateway.worker.worker import EngineWorker

log = logging.getLogger("sluice")


def worker_entry(settings: Settings, model: str | None) -> tuple[ModelEntry, bool]:
    """The model a worker serves (its id or alias; None: the first chat model) and whether it is the
    first chat model (whose queue keeps the deployment's key prefix)."""
    entries = settings.model_entries()
    first_chat = next((e for e in entries if e.kind == "chat"), None)
    if model is None:
        if first_chat is None:
            raise SystemExit("no chat model is configured: name the model to serve with --model")
        return first_chat, True
    for e in entries:
        if model == e.id or model in e.aliases:
            return e, e is first_chat
    raise SystemExit(f"no configured model is named {model!r}")


async def run_worker(settings: Settings, stop: asyncio.Event, *, model: str | None = None) -> None:
    entry, first_chat = worker_entry(settings, model)
    queue = make_queue(settings, entry, first_chat=first_chat)
    queue.start_reaper()
    engine = await asyncio.to_thread(load_engine, settings, entry)
    name = entry.id or engine.model_name
    q = settings.queue
    worker = EngineWorker(engine, queue, max_batch=q.max_batch, heartbeat_s=q.heartbeat_s, model_name=name,
                          background_above=max(t.priority for t in settings.tiers.values()))
    await worker.start()
    log.info("sluice worker %s: %s model=%s capacity=%d, draining %s", getattr(queue, "consumer_id", "?"),
             entry.kind, name, worker.capacity, settings.redis_url)
    await stop.wait()
    # Graceful: stop pulling, let in-flight requests finish within the grace period, hand the rest
    # back to the queue with the tokens already sent (another worker continues them), exit.
    log.info("worker shutting down: finishing %d in-flight requests for up to %.0fs",
             worker.stats().in_flight, settings.server.shutdown_grace_s)
    await worker.stop(grace_s=settings.server.shutdown_grace_s, handback=True)
    await queue.close()
    log.info("worker stopped")
