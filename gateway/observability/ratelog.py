"""Rate-limited logging: a message that can repeat per request or per connection (a broken keys file,
a refused connection, `accept()` failing for lack of file descriptors) is written at most once per
`interval_s` per topic, with the count of the ones left out since, so a flood cannot fill the disk."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # topic -> (when last written, left out since)

    def log(self, level: int, topic: str, msg: str, *args: object) -> bool:
        """Write the message unless this topic was written less than interval_s ago; True when written."""
        now = time.monotonic()
        last = self._last.get(topic)
        if last is not None and now - last[0] < self.interval_s:
            self._last[topic] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            msg += " (%d more like this in the last %.0fs)"
            args = (*args, last[1], now - last[0])
        self._last[topic] = (now, 0)
        self.logger.log(level, msg, *args)
        return True

    def error(self, topic: str, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, topic, msg, *args)

    def warning(self, topic: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, topic, msg, *args)

    def info(self, topic: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, topic, msg, *args)
