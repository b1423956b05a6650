"""The state of a store that spend is recorded in (the usage ledger, the Redis totals): failing or not.

A failure is logged once when it starts (ERROR: the gateway refuses metered requests from then on) and
once when it ends, with a reminder every `remind_every_s` while it lasts, however often it is retried: a
failing store is retried every flush, and one line per retry filled the log even with no traffic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any


class Outage:
    def __init__(self, what: str, logger: logging.Logger, remind_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.what = what
        self.logger = logger
        self.remind_every_s = remind_every_s
        self.clock = clock
        self.problem: str | None = None  # why spend cannot be recorded now; None: it can
        self._since = 0.0
        self._next_reminder = 0.0

    def failed(self, why: str, pending: str = "") -> None:
        """Record a failed attempt; `pending`: what is waiting to be written (for the log line)."""
        now = self.clock()
        tail = f"; {pending}" if pending else ""
        if self.problem is None:
            self._since = now
            self._next_reminder = now + self.remind_every_s
            self.logger.error("%s: %s; refusing metered requests (503 usage_unavailable) until spend can be "
                              "recorded again%s", self.what, why, tail)
        elif now >= self._next_reminder:
            self._next_reminder = now + self.remind_every_s
            self.logger.warning("%s: still failing after %.0fs: %s%s", self.what, now - self._since, why, tail)
        self.problem = why

    def recovered(self) -> None:
        if self.problem is not None:
            self.logger.warning("%s: recording spend again after %.0fs; admitting metered requests", self.what,
                                self.clock() - self._since)
            self.problem = None


class Recovery:
    """A refused request's try at ending an outage at once (so the first request after the store is back
    is admitted, not one after a further retry interval): one attempt at a time, shared by every caller, and at
    most one every `every_s` however many requests are refused. A caller waits at most `wait_s` for it (a
    store that hangs must not hold the requests it refuses)."""

    def __init__(self, attempt: Callable[[], Coroutine[Any, Any, bool]], every_s: float = 0.25,
                 wait_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.attempt = attempt
        self.every_s = every_s
        self.wait_s = wait_s
        self.clock = clock
        self._task: asyncio.Task[bool] | None = None
        self._last = float("-inf")

    async def __call__(self) -> bool:
        """True when the attempt (this caller's, or the one under way) ended the outage."""
        if self._task is None or self._task.done():
            now = self.clock()
            if now - self._last < self.every_s:
                return False
            self._last = now
            self._task = asyncio.create_task(self.attempt())
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), self.wait_s)
        except TimeoutError:
            return False
