"""A local request whose first output is a failure (the engine broke before any token) is served by
the remote chain instead, invisibly to the client; a request on an engine pool whose every replica
failed before its first text is served by the embedded engine or a provider the same way.

A local request still queued at its start-by time (a share of its tier's time-to-first-token target: the
admission estimate can be wrong, and higher tiers arriving after it go first) is taken back out of the
queue: it goes to the remote chain, or, without one, ends with 429 + Retry-After (`routing.refuse_past_target`),
rather than reaching its first token past the target."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from engine import RequestOutput
from gateway.backends.base import ChoiceStream, WrappedStream
from gateway.backends.remote.backend import RemoteBackend
from gateway.errors import APIError, Failure
from gateway.messages import ChoiceOutput, ErrorOutput, GenerationRequest
from gateway.observability.metrics import Metrics
from gateway.routing.reasons import RouteReason

log = logging.getLogger("sluice.router")
T = TypeVar("T")


def _failed_locally(out: RequestOutput) -> bool:
    """A failure another backend may fix: anything but the request's own fault (a 400)."""
    if isinstance(out, ErrorOutput):
        return out.failure is not Failure.INVALID_REQUEST
    if out.error_code is not None:  # the engine refused the request as sent (e.g. invalid_grammar)
        return False
    return out.finish_reason in ("error", "abort") and not out.text


class FallbackStream(WrappedStream):
    """The local stream, replaced by a remote one when the first local output is a failure, or when it
    was still queued at `start_by` (time.monotonic(); None: never taken back)."""

    def __init__(self, gen: GenerationRequest, local: ChoiceStream, remote: RemoteBackend | None, metrics: Metrics,
                 start_by: float | None = None):
        self._gen = gen
        self._inner = local
        self._remote = remote
        self._metrics = metrics
        self._first = True
        self._withdrawing = self._withdrawn = False
        self._timer = asyncio.create_task(self._withdraw_at(start_by)) if start_by is not None else None

    async def _withdraw_at(self, start_by: float) -> None:
        await asyncio.sleep(max(0.0, start_by - time.monotonic()))
        self._withdrawing = True  # its queue_timeout output may reach __anext__ before the answer here
        self._withdrawn = await self._inner.withdraw_if_queued()

    def _remote_serves(self) -> bool:
        return self._remote is not None and bool(self._remote.chain(self._gen.model))

    async def __anext__(self) -> ChoiceOutput:
        ch = await self._inner.__anext__()
        if self._first:
            self._first = False
            if self._timer is not None:
                if self._withdrawing:
                    await asyncio.shield(self._timer)
                else:
                    self._timer.cancel()
            if self._withdrawn:
                return await self._late()
            if _failed_locally(ch.output) and self._remote_serves():
                log.warning("local failure before the first token for %s (%s); retrying remotely",
                            self._gen.request_id, ch.output.error or ch.output.finish_reason)
                await self._inner.aclose()
                self._metrics.decisions.labels(self._gen.tier, "remote", RouteReason.LOCAL_FAILED).inc()
                assert self._remote is not None
                self._inner = await self._remote.submit(self._gen)
                return await self._inner.__anext__()
        return ch

    async def _late(self) -> ChoiceOutput:
        """Taken back from the queue at its start-by time: a provider, or 429 (nothing was sent yet)."""
        await self._inner.aclose()
        if not self._remote_serves():
            self._metrics.decisions.labels(self._gen.tier, "local", RouteReason.REFUSED_LATE).inc()
            raise APIError(429, f"The local engine did not start this request within the {self._gen.tier} tier's "
                                "time-to-first-token target; retry shortly.", code="engines_busy", retry_after=1)
        log.info("route %s tier=%s -> remote (%s: still queued near its target)", self._gen.request_id,
                 self._gen.tier, RouteReason.QUEUE_LATE)
        self._metrics.decisions.labels(self._gen.tier, "remote", RouteReason.QUEUE_LATE).inc()
        assert self._remote is not None
        self._inner = await self._remote.submit(self._gen)
        return await self._inner.__anext__()

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self._inner.aclose()


class PoolFallbackStream(WrappedStream):
    """A pool stream, replaced by `elsewhere(gen)`'s when the replicas gave up before the first output
    (the tries raise the 429/503 of giving up then: nothing was sent to the client yet)."""

    def __init__(self, gen: GenerationRequest, pooled: ChoiceStream,
                 elsewhere: Callable[[GenerationRequest], Awaitable[ChoiceStream]]):
        self._gen = gen
        self._inner = pooled
        self._elsewhere = elsewhere
        self._first = True

    async def __anext__(self) -> ChoiceOutput:
        if not self._first:
            return await self._inner.__anext__()
        return await self._first_read(lambda: self._inner.__anext__())

    async def next_batch(self) -> list[ChoiceOutput]:
        if not self._first:
            return await self._inner.next_batch()
        return await self._first_read(lambda: self._inner.next_batch())

    async def _first_read(self, read: Callable[[], Awaitable[T]]) -> T:
        """The first read, moved elsewhere when the replicas gave up before it."""
        self._first = False
        try:
            return await read()
        except APIError as e:
            if e.status not in (429, 503):
                raise
            log.warning("every engine replica failed before the first token for %s (%s); moving it on",
                        self._gen.request_id, e.message)
            await self._inner.aclose()
            try:
                self._inner = await self._elsewhere(self._gen)
            except Exception:
                raise e from None
            return await read()

    async def aclose(self) -> None:
        await self._inner.aclose()
