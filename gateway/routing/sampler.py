"""Once a second, what the router sees: the engine workers' step counters go into the wait estimate
(`WaitEstimator.sample_steps`), and the gauges that describe state rather than events are refreshed
(queue depth and estimated wait per tier, the engine's busy ratio, providers' circuits)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from gateway.backends.remote.backend import RemoteBackend
from gateway.observability.metrics import Metrics
from gateway.queue.base import RequestQueue
from gateway.routing.estimate import WaitEstimator
from gateway.settings import TierSettings
from gateway.tasks import cancel_and_wait, run_forever

log = logging.getLogger("sluice.metrics")


class MetricsSampler:
    def __init__(self, metrics: Metrics, queue: RequestQueue, tiers: dict[str, TierSettings],
                 estimator: WaitEstimator, remote: RemoteBackend | None, interval_s: float = 1.0):
        self.metrics = metrics
        self.queue = queue
        self.tiers = tiers
        self.estimator = estimator
        self.remote = remote
        self.interval_s = interval_s
        self._busy_last: tuple[float, float] | None = None
        self._task: asyncio.Task | None = None

    async def sample_once(self) -> None:
        m = self.metrics
        self.estimator.sample_steps()
        for tier in self.tiers:
            m.queue_depth.labels(tier).set(await self.queue.depth(tier))
            est = await self.estimator.estimate_wait(tier)
            m.queue_wait_estimate.labels(tier).set(est if math.isfinite(est) else -1)
        busy_parts = [w.busy_seconds for w in self.estimator.local.worker_stats() if w.busy_seconds is not None]
        if busy_parts:
            busy = sum(busy_parts)
            now = time.monotonic()
            m.busy_seconds.set(busy)
            if self._busy_last is not None and now > self._busy_last[0]:
                ratio = (busy - self._busy_last[1]) / (now - self._busy_last[0])
                m.busy_ratio.set(min(1.0, max(0.0, ratio)))
            self._busy_last = (now, busy)
        if self.remote is not None:
            for p in self.remote.providers:
                m.breaker.labels(p.name).set(0 if p.breaker.state == "closed" else 1)

    def start(self) -> None:
        self._task = asyncio.create_task(
            run_forever(self.sample_once, every_s=self.interval_s, log=log, what="metrics sampling",
                        level=logging.DEBUG), name="sluice-metrics-sampler")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
