"""A per-provider circuit breaker: closed -> open after `failures` consecutive failures -> after
`cooldown_s` one probe is let through (half-open) -> closed on its success, open again on its failure.

Time comes from an injectable clock so tests need no sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failures: int = 5, cooldown_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive = 0
        self.opened_at: float | None = None
        self.probing = False  # a half-open probe is in flight

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        if self.clock() - self.opened_at >= self.cooldown_s:
            return HALF_OPEN
        return OPEN

    def available(self) -> bool:
        """Would `allow()` let a request through now (without claiming the probe)?"""
        s = self.state
        return s == CLOSED or (s == HALF_OPEN and not self.probing)

    def allow(self) -> bool:
        """Claim a pass: always when closed, one probe at a time when half-open, never when open."""
        s = self.state
        if s == CLOSED:
            return True
        if s == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def retry_in(self) -> float:
        """Seconds until the breaker lets a probe through (0 when it would now)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.cooldown_s - (self.clock() - self.opened_at))

    def success(self) -> None:
        self.consecutive = 0
        self.opened_at = None
        self.probing = False

    def failure(self) -> None:
        self.consecutive += 1
        if self.probing or self.consecutive >= self.threshold:
            self.opened_at = self.clock()
        self.probing = False

    def trip(self) -> None:
        """Open now, whatever the count (a configuration error: more tries cannot succeed)."""
        self.consecutive = max(self.consecutive + 1, self.threshold)
        self.opened_at = self.clock()
        self.probing = False

    def release(self) -> None:
        """The pass was not used for a verdict (e.g. the client left): free the probe slot."""
        self.probing = False
