"""Why the router sent a request where it did: the `reason` label of `sluice_route_decisions_total`
and of the route's log line."""

from __future__ import annotations

import enum


class RouteReason(enum.StrEnum):
    LOCAL = "local"  # both ways serve the model, and the local wait is within the tier's target
    LOCAL_ONLY = "local_only"  # no provider serves the model
    BATCH = "batch"  # a Batch API line: it waits for the local engine (never overflows to a provider's price)
    CAPABILITY = "capability"  # the local model cannot serve a part of it (an image part, ...)
    REMOTE_ONLY = "remote_only"  # only providers serve the model
    NO_WORKER = "no_worker"  # no local engine worker is ready
    QUEUE_WAIT = "queue_wait"  # the estimated queue wait exceeds the tier's `max_queue_wait_ms`
    QUEUE_FULL = "queue_full"  # the tier's local queue is full
    LOCAL_FAILED = "local_failed"  # the local engine failed before the first token (routing/fallback.py)
    POOL = "pool"  # an engine replica of the model's pool had room (or the request waited for it)
    POOL_FAILED = "pool_failed"  # every replica failed before the first token: the embedded engine or a provider
    ENGINE_FIELD = "engine_field"  # it sets a field only an engine applies (vLLM's extras): never overflows
    REFUSED_LATE = "refused_late"  # `routing.refuse_past_target`: a 429, its first token would come too late
    QUEUE_LATE = "queue_late"  # still queued locally near its tier's target: taken back, to a provider or a 429
