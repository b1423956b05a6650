"""Pacing one level of a sweep: a fixed concurrency, or a Poisson arrival rate.

* concurrency C: C workers, each sending its next request as soon as its previous one ends;
* rate R: arrivals with exponential gaps of mean 1/R seconds (a Poisson process, drawn from the seed;
  `inf` sends them all at once), each sent at its arrival time, at most `max_concurrency` in flight
  when given (later arrivals then wait for a slot).

A level ends after `requests` requests have been sent and/or once `duration_s` has passed (no new
request starts after it; those in flight are awaited, up to the client's timeout). Its duration, the
denominator of every rate, runs from the first send to the last answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loadgen.client import RequestResult
from loadgen.workload import RequestSpec, Workload

SendFn = Callable[[RequestSpec, float], Awaitable[RequestResult]]


@dataclass(frozen=True)
class Level:
    concurrency: int | None = None
    rate: float | None = None  # requests/s; math.inf: all at once
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.rate is not None:
            cap = f" (max {self.max_concurrency} in flight)" if self.max_concurrency else ""
            return f"rate {self.rate:g}/s{cap}"
        return f"concurrency {self.concurrency}"

    def to_json(self) -> dict[str, object]:
        return {"concurrency": self.concurrency, "rate": None if self.rate is None else
                ("inf" if math.isinf(self.rate) else self.rate), "max_concurrency": self.max_concurrency,
                "label": self.label}


@dataclass
class LevelRun:
    level: Level
    results: list[RequestResult]
    duration_s: float


async def run_level(level: Level, workload: Workload, send: SendFn, *, requests: int | None,
                    duration_s: float | None, seed: int = 0, first_index: int = 0,
                    on_result: Callable[[RequestResult], None] | None = None) -> LevelRun:
    """Runs one level. Its i-th request is `workload.request(first_index + i)` (reported as index i):
    give each level its own range, or a server's prefix cache would answer a level's prompts from the
    level before."""
    if requests is None and duration_s is None:
        raise ValueError("a level needs a request count, a duration, or both")
    if level.rate is not None and math.isinf(level.rate) and requests is None:
        raise ValueError("an infinite rate needs a request count")
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s

    async def one(index: int) -> None:
        r = await send(dataclasses.replace(workload.request(first_index + index), index=index), t0)
        results.append(r)
        if on_result is not None:
            on_result(r)

    if level.rate is None:
        counter = itertools.count()

        async def worker() -> None:
            while True:
                i = next(counter)
                if requests is not None and i >= requests:
                    return
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                await one(i)

        await asyncio.gather(*(worker() for _ in range(max(1, level.concurrency or 1))))
    else:
        rng = random.Random(f"{seed}/arrivals/{first_index}")
        slots = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None

        async def paced(index: int) -> None:
            if slots is None:
                await one(index)
                return
            async with slots:
                if deadline is not None and time.perf_counter() >= deadline:
                    return  # its arrival was in time but no slot freed before the end
                await one(index)

        tasks: list[asyncio.Task[None]] = []
        at = t0
        for i in itertools.count():
            if requests is not None and i >= requests:
                break
            if i and not math.isinf(level.rate):
                at += rng.expovariate(level.rate)
            if deadline is not None and at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))  # yields even when late
            tasks.append(asyncio.create_task(paced(i)))
        await asyncio.gather(*tasks)
    end = max((t0 + r.start_s + r.e2e_ms / 1000.0 for r in results), default=time.perf_counter())
    first = min((r.start_s for r in results), default=0.0)
    results.sort(key=lambda r: r.index)
    return LevelRun(level, results, max(end - t0 - first, 1e-9))
