"""Shared bits of the benchmarks: percentiles, workload generation, and the engine they drive."""

from __future__ import annotations

import os
import random
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOPICS = ["the ocean", "a robot", "mountains", "coffee", "a small town", "the moon", "trains", "music",
          "gardening", "chess", "rain", "a library", "bicycles", "volcanoes", "bread", "owls"]


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def mixed_workload(n: int, min_out: int, max_out: int, seed: int = 0, dist: str = "uniform") -> list[tuple[str, int]]:
    """n (prompt, output length) pairs. uniform: lengths spread evenly over [min_out, max_out];
    longtail: most answers short and a few long (a chat-like, log-normal-ish spread, clipped to the range)."""
    rng = random.Random(seed)
    if dist == "longtail":
        lengths = [min(max_out, max(min_out, round(min_out * (max_out / min_out) ** (rng.random() ** 3))))
                   for _ in range(n)]
    else:
        lengths = [round(min_out + (max_out - min_out) * i / max(1, n - 1)) for i in range(n)]
    rng.shuffle(lengths)
    return [(f"Write about {TOPICS[i % len(TOPICS)]}." + " Please be detailed." * rng.randint(0, 6), lengths[i])
            for i in range(n)]
