"""Time to first token on a pool, so a request waits for room only while it can still meet its tier's target.

A tier's target (`tiers.<tier>.max_queue_wait_ms`) is about what the client sees: the time to its first
token. A pooled request spends it in two places: waiting in Sluice for room on a replica, then inside the
replica (its prefill among the batch it joins, and the network). Waiting the whole target for room and
then paying the replica's own time on top misses the target by exactly that time, and a request that
cannot get room in time is better sent elsewhere at once than after waiting in vain. So:

  * `FirstTokenTimes` (backends/latency.py) learns, per replica and per provider, how long the first
    token takes once a request is sent (a high quantile, not the typical case);
  * the wait allowed for room is the target less that time, and less the provider's where the request
    would go to one after waiting (`wait_budget`; the router passes the target less the provider's);
  * `Completions` counts the pool's requests ending (the rate at which room opens); a request that
    arrives behind `ahead` others waiting for room expects to wait about (ahead + 1) / rate, and when
    that exceeds its budget it leaves at once (overflow, or an early 429 where nothing else serves).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from gateway.backends.latency import FirstTokenTimes

__all__ = ["Completions", "FirstTokenTimes", "expected_wait", "wait_budget"]

WINDOW_S = 10.0  # completions counted over this long
MIN_COMPLETIONS = 3  # fewer in the window: the rate is unknown (nothing is refused early)


class Completions:
    """Ends of pooled requests over the last `WINDOW_S`: the rate at which replicas free room."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._ends: deque[float] = deque()
        self._started = clock()

    def ended(self) -> None:
        self._ends.append(self._clock())

    def rate(self) -> float | None:
        now = self._clock()
        while self._ends and now - self._ends[0] > WINDOW_S:
            self._ends.popleft()
        if len(self._ends) < MIN_COMPLETIONS:
            return None
        return len(self._ends) / min(WINDOW_S, max(1e-3, now - self._started))


def wait_budget(target_s: float, first_token_s: float | None) -> float:
    """How long a request may wait for room and still see its first token within `target_s`."""
    return max(0.0, target_s - (first_token_s or 0.0))


def expected_wait(ahead: int, rate: float | None) -> float | None:
    """Seconds until room opens for a request with `ahead` others waiting before it (None: unknown)."""
    if rate is None or rate <= 0:
        return None
    return (ahead + 1) / rate
