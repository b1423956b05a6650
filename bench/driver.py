"""Drives an engine step by step and records when each request's tokens appeared (TTFT, inter-token gaps)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine import EngineRequest, LLMEngine


@dataclass
class Timeline:
    submitted: float
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def run(engine: LLMEngine, arrivals: list[tuple[float, EngineRequest]]) -> dict[str, Timeline]:
    """arrivals: (seconds after start, request). Returns each request's timeline (token-output times)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    timelines: dict[str, Timeline] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            _, req = pending.pop(0)
            timelines[req.request_id] = Timeline(submitted=time.perf_counter())
            engine.add_request(req)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            tl = timelines[o.request_id]
            tl.token_times += [t] * max(1, len(o.token_ids))
            tl.cached_tokens = o.cached_tokens
    return timelines
