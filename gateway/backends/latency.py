"""How long a backend takes to its first token once a request is sent: what a tier's target (a time to
first token) has left for waiting, learnt per engine replica and per remote provider from streamed answers."""

from __future__ import annotations

ALPHA = 0.2  # weight of each new first-token time


class FirstTokenTimes:
    """A replica's time from sending a request to its first token, learnt from streamed answers."""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.dev = 0.0

    def observe(self, seconds: float) -> None:
        if self.mean is None:
            self.mean = seconds
            return
        self.dev += ALPHA * (abs(seconds - self.mean) - self.dev)
        self.mean += ALPHA * (seconds - self.mean)

    def estimate(self) -> float | None:
        """A high quantile of its first-token time (None until one was seen)."""
        return None if self.mean is None else self.mean + 2 * self.dev
