"""Background tasks that must survive their own failures: one loop helper instead of a hand-written
"try, log, sleep, retry" in every component, and a cancellation that cannot be swallowed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable


def cancel_requested() -> bool:
    """True inside a task being cancelled. redis-py may turn a CancelledError that lands mid-command
    into a ConnectionError, so retry loops check this before retrying."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def run_forever(body: Callable[[], Awaitable[object]], *, every_s: float, log: logging.Logger,
                      what: str, level: int = logging.WARNING) -> None:
    """Run `body` every `every_s` seconds until cancelled; a failure is logged (`what` failed) and the
    loop goes on, so a dependency's outage (Redis restarting) never ends the loop."""
    while True:
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if cancel_requested():
                raise asyncio.CancelledError() from e
            log.log(level, "%s failed (%s: %s); retrying", what, type(e).__name__, e)
        await asyncio.sleep(every_s)


async def cancel_and_wait(tasks: list[asyncio.Task]) -> None:
    """Cancel and wait. Cancel again while any is still pending: a client library that absorbs a
    CancelledError mid-command (redis-py can) would otherwise leave its task waiting forever."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
    await asyncio.gather(*tasks, return_exceptions=True)
