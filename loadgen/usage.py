"""A Sluice gateway's own accounting: `GET /v1/usage` for each key, before and after a level.

`/v1/usage` returns the calling key's all-time totals (requests, prompt, cached and completion tokens,
cost) and the same by backend. The difference after minus before is what the gateway billed for the
level, to set beside the bench's own count and price table. Any other server answers 404 (or not
JSON): the bench then simply has no gateway figures. Traffic from elsewhere on the same keys during
the level is counted too.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
Snapshot = dict[str, dict[str, object]]  # label (the tiers using a key) -> the /v1/usage body


def _labels(keys: dict[str, str | None]) -> dict[str | None, str]:
    """Distinct keys -> a label naming the tiers that use each (never the key itself)."""
    out: dict[str | None, list[str]] = {}
    for tier, key in keys.items():
        out.setdefault(key, []).append(tier)
    return {k: "+".join(tiers) for k, tiers in out.items()}


async def snapshot(base_url: str, keys: dict[str, str | None], timeout_s: float = 5.0) -> Snapshot | None:
    """{label: body} for each distinct key, or None when any answer is not a usage body."""
    out: Snapshot = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            for key, label in _labels(keys).items():
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with s.get(base_url.rstrip("/") + "/usage", headers=headers) as r:
                    if r.status != 200:
                        return None
                    body = await r.json(content_type=None)
                    if not isinstance(body, dict) or not isinstance(body.get("totals"), dict):
                        return None
                    out[label] = body
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    return out


def _fields(d: object) -> dict[str, float]:
    src = d if isinstance(d, dict) else {}
    return {f: float(src.get(f) or 0) for f in FIELDS}


def _diff(a: object, b: object) -> dict[str, float]:
    fa, fb = _fields(a), _fields(b)
    return {f: (round(fb[f] - fa[f], 10) if f == "cost" else int(fb[f] - fa[f])) for f in FIELDS}


def delta(before: Snapshot, after: Snapshot) -> dict[str, object]:
    """after - before, summed over keys: the totals, by backend, and by key label."""
    totals: dict[str, float] = {f: (0.0 if f == "cost" else 0) for f in FIELDS}
    by_backend: dict[str, dict[str, float]] = {}
    by_key: dict[str, dict[str, float]] = {}
    for label, b_after in after.items():
        b_before = before.get(label, {})
        d = _diff(b_before.get("totals"), b_after.get("totals"))
        by_key[label] = d
        for f in FIELDS:
            totals[f] += d[f]
        backends_after = b_after.get("by_backend")
        backends_before = b_before.get("by_backend")
        for backend, v in (backends_after.items() if isinstance(backends_after, dict) else ()):
            prev = backends_before.get(backend) if isinstance(backends_before, dict) else None
            d = _diff(prev, v)
            if d["requests"] or d["cost"]:
                acc = by_backend.setdefault(backend, {f: (0.0 if f == "cost" else 0) for f in FIELDS})
                for f in FIELDS:
                    acc[f] += d[f]
    totals["cost"] = round(totals["cost"], 10)
    for acc in by_backend.values():
        acc["cost"] = round(acc["cost"], 10)
    return {"totals": totals, "by_backend": dict(sorted(by_backend.items())), "by_key": by_key}


async def settled_delta(base_url: str, keys: dict[str, str | None], before: Snapshot, expect_requests: int,
                        wait_s: float = 2.0) -> dict[str, object] | None:
    """The delta once the gateway has accounted at least `expect_requests` (it books a request as its
    stream ends, so the last ones may land a moment after the client saw them), or after `wait_s`."""
    end = time.monotonic() + wait_s
    while True:
        after = await snapshot(base_url, keys)
        if after is None:
            return None
        d = delta(before, after)
        totals = d["totals"]
        if (isinstance(totals, dict) and totals.get("requests", 0) >= expect_requests) or time.monotonic() >= end:
            return d
        await asyncio.sleep(0.05)
