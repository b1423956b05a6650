"""The circuit breaker (gateway/backends/remote/breaker.py) on a settable clock: open, half-open, closed."""

from __future__ import annotations

from gateway.backends.remote.breaker import CircuitBreaker
from tests.fixtures.clock import Clock


def test_breaker_opens_half_opens_and_closes():
    c = Clock()
    b = CircuitBreaker(failures=3, cooldown_s=10, clock=c)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == "closed"
    b.success()  # a success resets the count
    for _ in range(3):
        b.failure()
    assert b.state == "open" and not b.allow() and b.retry_in() == 10
    c.t += 10
    assert b.state == "half_open"
    assert b.allow() and not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open again for a full cool-down
    assert b.state == "open"
    c.t += 10
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()


def test_breaker_probe_released_without_verdict():
    c = Clock()
    b = CircuitBreaker(failures=1, cooldown_s=1, clock=c)
    b.failure()
    c.t += 1
    assert b.allow()
    b.release()
    assert b.allow()
