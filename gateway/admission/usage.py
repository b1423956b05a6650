"""Usage and cost: every finished request adds its tokens and cost to its key's totals.

Totals are kept per key, broken down by model and backend (`local` or `remote:<provider>`).
`GET /v1/usage` returns the calling key's totals; the same figures go to Prometheus counters. With
Redis configured (the limits' Redis) totals live in one hash per key, so every gateway sees the same
numbers and a key's budget holds across gateways; otherwise in memory, rebuilt at start from the usage
ledger (gateway/admission/ledger.py) so a restart forgets neither spend nor budgets.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("sluice.usage")

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")
ANON = "anonymous"


def _empty() -> dict[str, float]:
    return {f: 0 for f in FIELDS}


def _shape(flat: dict[str, float]) -> dict[str, Any]:
    """{"total|model|backend|field": n} -> the /v1/usage body."""
    out: dict[str, Any] = {"totals": _empty(), "by_model": {}, "by_backend": {}}
    for k, v in flat.items():
        parts = k.split("|")
        if parts[0] == "total" and len(parts) == 2:
            out["totals"][parts[1]] = v
        elif parts[0] in ("model", "backend") and len(parts) == 3:
            group = out["by_model" if parts[0] == "model" else "by_backend"]
            group.setdefault(parts[1], _empty())[parts[2]] = v
    for group in [out["totals"], *out["by_model"].values(), *out["by_backend"].values()]:
        for f in FIELDS:
            group[f] = round(float(group[f]), 10) if f == "cost" else int(group[f])
        group["total_tokens"] = group["prompt_tokens"] + group["completion_tokens"]
    return out


class UsageStore:
    def __init__(self, redis_url: str | None = None):
        self._mem: dict[str, dict[str, float]] = {}
        self.redis = None
        if redis_url:
            import redis.asyncio as aioredis

            self.redis = aioredis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)

    @staticmethod
    def _deltas(model: str, backend: str, prompt: int, cached: int, completion: int,
                cost: float, requests: int = 1) -> dict[str, float]:
        vals = {"requests": requests, "prompt_tokens": prompt, "cached_tokens": cached,
                "completion_tokens": completion, "cost": cost}
        out: dict[str, float] = {}
        for scope in ("total", f"model|{model}", f"backend|{backend}"):
            for f, v in vals.items():
                out[f"{scope}|{f}"] = v
        return out

    async def record(self, key: str | None, model: str, backend: str, prompt: int, cached: int,
                     completion: int, cost: float) -> None:
        key = key or ANON
        deltas = self._deltas(model, backend, prompt, cached, completion, cost)
        if self.redis is not None:
            try:
                pipe = self.redis.pipeline(transaction=False)
                name = f"sluice:usage:{key}"
                for f, v in deltas.items():
                    if f.endswith("|cost"):
                        pipe.hincrbyfloat(name, f, float(v))
                    else:
                        pipe.hincrby(name, f, int(v))
                await pipe.execute()
                return
            except Exception as e:  # never fail a request over bookkeeping; keep it in memory
                log.warning("usage to Redis failed (%s); keeping it in memory", type(e).__name__)
        acc = self._mem.setdefault(key, {})
        for f, v in deltas.items():
            acc[f] = acc.get(f, 0) + v

    def restore(self, by_key: dict[str, list[tuple[str, str, int, int, int, int, float]]]) -> None:
        """Replay the ledger's records, (model, backend, requests, prompt, cached, completion, cost) per key,
        into the in-memory totals, in the order `record` added them (so the sums are the same floats)."""
        for key, recs in by_key.items():
            acc = self._mem.setdefault(key, {})
            for model, backend, n, prompt, cached, completion, cost in recs:
                for f, v in self._deltas(model, backend, prompt, cached, completion, cost, n).items():
                    acc[f] = acc.get(f, 0) + v

    async def _flat(self, key: str | None) -> dict[str, float]:
        key = key or ANON
        flat = dict(self._mem.get(key, {}))
        if self.redis is not None:
            try:
                raw = await self.redis.hgetall(f"sluice:usage:{key}")
                for k, v in raw.items():
                    k = k.decode() if isinstance(k, bytes) else k
                    flat[k] = flat.get(k, 0) + float(v)
            except Exception as e:
                log.warning("usage from Redis failed (%s)", type(e).__name__)
        return flat

    async def totals(self, key: str | None) -> dict[str, Any]:
        return _shape(await self._flat(key))

    async def spent(self, key: str | None) -> float:
        return float((await self._flat(key)).get("total|cost", 0.0))

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
