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
  * `Durations` learns how long a pooled request holds its replica; with the replicas' room levels that
    is the rate at which room opens when they are full, so a request that arrives behind `ahead` others
    waiting for room expects to wait about (ahead + 1) / rate, and when that exceeds its budget it leaves
    at once (overflow, or an early 429 where nothing else serves).
"""

from __future__ import annotations

ALPHA = 0.1  # weight of each new request duration
MIN_DURATIONS = 3  # fewer requests ended: the drain rate is unknown (nothing is refused early)


class Durations:
    """How long the pool's requests hold a replica (admitted to ended): with the room the replicas have,
    the rate at which room opens while they are full. (Completions per second over a window would be
    the arrival rate at part load, far below that: a burst at half load then looked hopeless.)"""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.count = 0

    def ended(self, seconds: float) -> None:
        self.count += 1
        self.mean = seconds if self.mean is None else self.mean + ALPHA * (seconds - self.mean)

    def drain_rate(self, slots: float) -> float | None:
        """Requests per second that end when `slots` requests run (None: too few seen)."""
        if self.mean is None or self.count < MIN_DURATIONS or slots <= 0:
            return None
        return slots / max(self.mean, 1e-3)


def wait_budget(target_s: float, first_token_s: float | None) -> float:
    """How long a request may wait for room and still see its first token within `target_s`."""
    return max(0.0, target_s - (first_token_s or 0.0))


def expected_wait(ahead: int, rate: float | None) -> float | None:
    """Seconds until room opens for a request with `ahead` others waiting before it (None: unknown)."""
    if rate is None or rate <= 0:
        return None
    return (ahead + 1) / rate
