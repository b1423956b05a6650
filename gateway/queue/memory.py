"""In-process queue: one event loop, plain deques and asyncio primitives. Not thread-safe by design:
the engine thread never touches it (the worker hops to the loop first)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

from gateway.messages import AnyOutput, QueueItem, queue_timeout_output
from gateway.queue.base import CancellationInbox, QueueFull, RequestQueue, Subscription
from gateway.queue.fair import FairShare, item_cost


class _MemorySubscription(Subscription):
    def __init__(self, owner: MemoryQueue, request_id: str):
        self._owner = owner
        self.request_id = request_id
        self._q: asyncio.Queue[AnyOutput] = asyncio.Queue()

    async def get(self, timeout: float | None = None) -> AnyOutput:
        if timeout is None:
            return await self._q.get()
        return await asyncio.wait_for(self._q.get(), timeout)

    async def close(self) -> None:
        if self._owner._subs.get(self.request_id) is self:
            del self._owner._subs[self.request_id]


class MemoryQueue(RequestQueue):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Per priority, a heap of (fair-share tag, arrival, item): keys of one tier share it fairly (fair.py).
        self._by_priority: dict[int, list[tuple[float, int, QueueItem]]] = {}
        self._fair = FairShare()
        self._arrivals = itertools.count()
        self._tier_depth: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._subs: dict[str, _MemorySubscription] = {}
        self._cancelled = CancellationInbox()
        self._clock = time.time  # injectable for aging tests

    # ------------------------------------------------------------ requests

    def _count(self) -> int:
        return sum(len(d) for d in self._by_priority.values())

    async def put(self, item: QueueItem) -> None:
        limit = self.depth_limit(item.tier)
        depth = self._tier_depth.get(item.tier, 0)
        if depth >= limit:
            raise QueueFull(item.tier, depth, retry_after=max(1.0, self.max_wait_ms / 1000))
        tag = self._fair.tag(item.priority, item.key, item_cost(item))
        heapq.heappush(self._by_priority.setdefault(item.priority, []), (tag, next(self._arrivals), item))
        self._tier_depth[item.tier] = depth + 1
        async with self._changed:
            self._changed.notify_all()

    def _pop_next(self) -> QueueItem | None:
        heads = [(p, d[0][2]) for p, d in self._by_priority.items() if d]
        if not heads:
            return None
        now = self._clock()
        aged = [(item.enqueued_at, p) for p, item in heads if now - item.enqueued_at >= self.aging_s]
        if aged:
            _, prio = min(aged)
        else:
            prio = min(p for p, _ in heads)
        tag, _, item = heapq.heappop(self._by_priority[prio])
        self._fair.served(prio, tag)
        self._tier_depth[item.tier] -= 1
        return item

    async def pull(self, max_items: int, timeout: float | None = None, *, fill_target: int | None = None,
                   max_wait_ms: float | None = None) -> list[QueueItem]:
        fill = self.fill_target if fill_target is None else fill_target
        wait_s = (self.max_wait_ms if max_wait_ms is None else max_wait_ms) / 1000
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._count() > 0), timeout)
            except TimeoutError:
                return []
            if self._count() < min(fill, max_items) and wait_s > 0:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self._count() >= min(fill, max_items)), wait_s)
                except TimeoutError:
                    pass
            out: list[QueueItem] = []
            while len(out) < max_items:
                item = self._pop_next()
                if item is None:
                    break
                out.append(item)
            return out

    async def depth_at_most(self, priority: int) -> int:
        return sum(len(d) for p, d in self._by_priority.items() if p <= priority)

    async def depth(self, tier: str | None = None) -> int:
        if tier is None:
            return self._count()
        return self._tier_depth.get(tier, 0)

    # ------------------------------------------------------------ results

    async def subscribe(self, request_id: str) -> Subscription:
        sub = _MemorySubscription(self, request_id)
        self._subs[request_id] = sub
        return sub

    async def publish(self, output: AnyOutput) -> None:
        sub = self._subs.get(output.request_id)
        if sub is not None:
            sub._q.put_nowait(output)

    # ------------------------------------------------------------ cancellation

    def _remove_queued(self, request_id: str) -> bool:
        for d in self._by_priority.values():
            for i, (tag, _, item) in enumerate(d):
                if item.request_id == request_id:
                    d[i] = d[-1]
                    d.pop()
                    heapq.heapify(d)
                    self._fair.withdraw(item.priority, item.key, tag, item_cost(item))
                    self._tier_depth[item.tier] -= 1
                    return True
        return False

    async def expire_if_queued(self, request_id: str) -> bool:
        if not self._remove_queued(request_id):
            return False
        await self.publish(queue_timeout_output(request_id))
        return True

    async def cancel(self, request_id: str) -> None:
        if self._remove_queued(request_id):
            return  # never reached a worker: nothing to abort
        self._cancelled.add(request_id)

    async def next_cancellations(self, timeout: float | None = None) -> list[str]:
        return await self._cancelled.take(timeout)

