"""Shared bits of the benchmarks: percentiles, workload generation, and the engine they drive."""

from __future__ import annotations

import os
import random
import statistics
import subprocess

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TOPICS = ["the ocean", "a robot", "mountains", "coffee", "a small town", "the moon", "trains", "music",
          "gardening", "chess", "rain", "a library", "bicycles", "volcanoes", "bread", "owls"]


# The CPU flags every benchmark prints beside its figures: which kernels a build can take.
CPU_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine() -> str:
    """This machine as `lscpu` names it: model, CPU count and the CPU_FLAGS it has."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (lscpu failed)"
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    return (f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs; flags: "
            + " ".join(f for f in CPU_FLAGS if f in flags))


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
