"""The queue seam: what the gateway and the workers agree on, whatever carries the items.

Three channels share one object because every implementation needs all three and they must agree
on request ids:
  * requests: `put` (gateway) / `pull` (worker), strict priority, FIFO within a priority, aging,
    bounded per tier, fill- and time-based batching;
  * results: `subscribe` (gateway, BEFORE `put`, so no output is missed) / `publish` (worker);
  * cancellation: `cancel` (gateway) / `next_cancellations` (worker, which then aborts in the engine).
All methods are async: the Redis implementation talks to a server on every call.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

from gateway.messages import AnyOutput, QueueItem, WorkerStats


class QueueFull(Exception):
    """The tier's queue is at max_depth; the gateway answers 503 with Retry-After."""

    def __init__(self, tier: str, depth: int, retry_after: float = 1.0):
        super().__init__(f"queue for tier {tier!r} is full ({depth} waiting)")
        self.tier = tier
        self.depth = depth
        self.retry_after = retry_after


class CancellationInbox:
    """Ids of cancelled requests waiting for this process's worker to abort them (either queue kind)."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._event = asyncio.Event()

    def add(self, request_id: str) -> None:
        self._ids.append(request_id)
        self._event.set()

    async def take(self, timeout: float | None = None) -> list[str]:
        """Every id added since the last call; waits up to `timeout` for at least one."""
        if not self._ids:
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except TimeoutError:
                return []
        ids, self._ids = self._ids, []
        self._event.clear()
        return ids


class Subscription(ABC):
    """The outputs of one request, in order. Close it when done (also on cancellation)."""

    request_id: str

    @abstractmethod
    async def get(self, timeout: float | None = None) -> AnyOutput:
        """The next output; raises TimeoutError after `timeout` seconds without one."""

    @abstractmethod
    async def close(self) -> None: ...

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> AnyOutput:
        return await self.get()


class RequestQueue(ABC):
    """See the module docstring. `pull` semantics:

    waits until at least one item is queued (or `timeout` passes: returns []), then while fewer than
    `fill_target` items are queued waits at most `max_wait_ms` for more, then returns up to
    `max_items` items: aged items (waiting >= aging_s) first in arrival order, then by priority
    (lower first), FIFO within a priority.
    """

    def __init__(self, *, max_depth: dict[str, int] | int = 1024, fill_target: int = 1,
                 max_wait_ms: float = 50.0, aging_s: float = 10.0):
        self.max_depth = max_depth
        self.fill_target = fill_target
        self.max_wait_ms = max_wait_ms
        self.aging_s = aging_s

    def depth_limit(self, tier: str) -> int:
        if isinstance(self.max_depth, int):
            return self.max_depth
        return self.max_depth.get(tier, max(self.max_depth.values(), default=1024))

    @abstractmethod
    async def put(self, item: QueueItem) -> None:
        """Enqueue; raises QueueFull when the item's tier holds max_depth items."""

    @abstractmethod
    async def pull(self, max_items: int, timeout: float | None = None, *, fill_target: int | None = None,
                   max_wait_ms: float | None = None) -> list[QueueItem]: ...

    @abstractmethod
    async def depth(self, tier: str | None = None) -> int:
        """Items waiting in a tier (all tiers when None)."""

    @abstractmethod
    async def depth_at_most(self, priority: int) -> int:
        """Items queued at this priority or a more urgent one (a lower number)."""

    @abstractmethod
    async def subscribe(self, request_id: str) -> Subscription: ...

    @abstractmethod
    async def publish(self, output: AnyOutput) -> None: ...

    @abstractmethod
    async def cancel(self, request_id: str) -> None:
        """The client is gone: drop the item if still queued, else tell the workers to abort it."""

    @abstractmethod
    async def expire_if_queued(self, request_id: str) -> bool:
        """The request's deadline passed: if no worker took it yet, drop it and publish its
        `queue_timeout` result (504). False when it already runs (or finished): it goes on."""

    @abstractmethod
    async def next_cancellations(self, timeout: float | None = None) -> list[str]:
        """Request ids cancelled since the last call; waits up to `timeout` for at least one."""

    # ---- distributed delivery (leases). The in-process queue needs none of it: these defaults make
    # every hook a no-op there, and the Redis queue overrides them.

    lease_s: float | None = None  # None: no leases (nothing to renew)
    renew_interval_s: float | None = None

    async def publish_batch(self, outputs: list[AnyOutput]) -> list[str]:
        """Publish one step's outputs; returns the ids this worker no longer owns (to abort locally)."""
        for out in outputs:
            await self.publish(out)
        return []

    async def renew(self, request_ids: list[str]) -> list[str]:  # noqa: ARG002 (no leases here)
        """Extend the leases of requests this worker runs; returns the ids it no longer owns."""
        return []

    async def release(self, request_ids: list[str]) -> int:  # noqa: ARG002 (no leases here)
        """Hand unfinished requests back to the queue (graceful shutdown). Returns how many went
        back; 0 means the queue cannot take them back (the worker then fails them)."""
        return 0

    async def heartbeat(self, info: WorkerStats) -> None:  # noqa: B027 (optional hook)
        """Announce a live worker and how busy it is (no-op in-process)."""

    async def unregister(self) -> None:  # noqa: B027 (optional hook)
        """The worker is leaving."""

    async def workers(self) -> list[WorkerStats] | None:
        """Live workers with their stats; None when the queue has no notion of remote workers."""
        return None

    def start_reaper(self) -> None:  # noqa: B027 (optional hook)
        """Start background housekeeping (lease reclaim, deadline expiry); no-op in-process."""

    async def close(self) -> None:
        return None
