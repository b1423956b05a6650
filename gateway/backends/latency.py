"""How long a backend takes to its first token once a request is sent: what a tier's target (a time to
first token) has left for waiting, learnt per engine replica and per remote provider from streamed answers."""

from __future__ import annotations

from collections import deque

ALPHA = 0.2  # weight of each new first-token time in the moving mean
RECENT = 100  # first-token times kept for the quantile
QUANTILE = 0.98  # the estimate: the tier targets are on p99 time to first token, and waiting adds to this
MIN_SAMPLES = 10  # fewer kept: the mean plus twice the mean deviation stands in for the quantile


class FirstTokenTimes:
    """A backend's time from sending a request to its first token, learnt from streamed answers."""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.dev = 0.0
        self._recent: deque[float] = deque(maxlen=RECENT)

    def observe(self, seconds: float) -> None:
        self._recent.append(seconds)
        if self.mean is None:
            self.mean = seconds
            return
        self.dev += ALPHA * (abs(seconds - self.mean) - self.dev)
        self.mean += ALPHA * (seconds - self.mean)

    def estimate(self) -> float | None:
        """A high quantile of its recent first-token times (None until one was seen). The tail, not the
        mean: an engine that keeps a request waiting beyond its batch has a skewed tail that a mean plus
        deviations understated (the pool-only standard tier missed its target by 30% at 2x load)."""
        if self.mean is None:
            return None
        if len(self._recent) < MIN_SAMPLES:
            return self.mean + 2 * self.dev
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
