"""Per-key limits: requests per minute, tokens per minute, a money budget, and Batch API tokens per day.

Windows are fixed, aligned minutes: a key gets at most `rpm` admissions in each minute, and
`Retry-After` says when the next minute starts. Requests are counted atomically at admission
(INCR in Redis, so several gateways share one count; a dict in memory otherwise). Tokens are only
known when the answer is done, so `tpm` is checked at admission against the tokens already spent in
the window and charged at the end (the overshoot is bounded by what the key has in flight), the way
LiteLLM and most gateways do it. The budget is checked against the key's recorded spend here, and each
request's worst-case cost is then reserved against it (admission/usage.py), so requests in flight count.
Anonymous use is key None: it gets its tier's limits and never a named key's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.settings import KeyLimits, LimitSettings

log = logging.getLogger("sluice.limits")

WINDOW_S = 60
DAY_S = 86400  # the Batch API's token quota: per UTC day


@dataclass
class Verdict:
    ok: bool
    reason: str = ""  # "rpm" | "tpm" | "budget"
    retry_after: float | None = None
    limit: int | float | None = None


_NO_LIMITS = KeyLimits()  # a tier without limits configured (asked several times per request: made once)


def _ident(key: str | None, tier: str) -> str:
    """The counters' owner: a key, or anonymous use by tier (never confused with a key's name)."""
    return f"key:{key}" if key is not None else f"tier:{tier}"


class Limiter:
    """The check/charge logic; storage is `_incr` / `_get` (memory or Redis)."""

    def __init__(self, settings: LimitSettings, clock: Callable[[], float] = time.time):
        self.settings = settings
        self.clock = clock

    def limits_for(self, key: str | None, tier: str) -> KeyLimits:
        base = self.settings.tiers.get(tier, _NO_LIMITS)
        own = self.settings.keys.get(key) if key is not None else None
        if own is None:
            return base
        merged = base.model_dump()
        merged.update({k: v for k, v in own.model_dump().items() if v is not None})
        return KeyLimits(**merged)

    def _window(self) -> tuple[int, float]:
        now = self.clock()
        w = int(now // WINDOW_S)
        return w, (w + 1) * WINDOW_S - now

    async def admit(self, key: str | None, tier: str, spent: float = 0.0) -> Verdict:
        lim = self.limits_for(key, tier)
        if lim.budget is not None and spent >= lim.budget:
            return Verdict(False, "budget", None, lim.budget)
        if lim.rpm is None and lim.tpm is None:
            return Verdict(True)
        ident = _ident(key, tier)
        w, left = self._window()
        if lim.tpm is not None:
            used = await self._get(f"sluice:lim:tpm:{ident}:{w}")
            if used >= lim.tpm:
                return Verdict(False, "tpm", left, lim.tpm)
        if lim.rpm is not None:
            n = await self._incr(f"sluice:lim:rpm:{ident}:{w}", 1)
            if n > lim.rpm:
                return Verdict(False, "rpm", left, lim.rpm)
        return Verdict(True)

    async def charge_tokens(self, key: str | None, tier: str, tokens: int) -> None:
        lim = self.limits_for(key, tier)
        if lim.tpm is None or tokens <= 0:
            return
        w, _ = self._window()
        await self._incr(f"sluice:lim:tpm:{_ident(key, tier)}:{w}", tokens)

    # ---------------------------------------------------------------- the Batch API's daily tokens

    def _day(self) -> tuple[int, float]:
        now = self.clock()
        d = int(now // DAY_S)
        return d, (d + 1) * DAY_S - now

    async def batch_tokens_wait(self, key: str | None, tier: str) -> float:
        """0 while the key's batch lines may use tokens today, else the seconds until the next UTC day."""
        cap = self.limits_for(key, tier).batch_tokens_per_day
        if cap is None:
            return 0.0
        d, left = self._day()
        return left if await self._get(f"sluice:lim:btpd:{_ident(key, tier)}:{d}") >= cap else 0.0

    async def charge_batch_tokens(self, key: str | None, tier: str, tokens: int) -> None:
        if self.limits_for(key, tier).batch_tokens_per_day is None or tokens <= 0:
            return
        d, _ = self._day()
        await self._incr(f"sluice:lim:btpd:{_ident(key, tier)}:{d}", tokens, ttl=2 * DAY_S)

    async def _incr(self, name: str, by: int, ttl: int = 2 * WINDOW_S) -> int:
        raise NotImplementedError

    async def _get(self, name: str) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class MemoryLimiter(Limiter):
    def __init__(self, settings: LimitSettings, clock: Callable[[], float] = time.time):
        super().__init__(settings, clock)
        self._counts: dict[str, tuple[int, float]] = {}  # name -> (count, expires at)
        self._gc_at = 0.0

    def _gc(self) -> None:
        now = self.clock()
        if now >= self._gc_at:  # drop counters of past windows, at most once a window
            self._gc_at = now + WINDOW_S
            self._counts = {k: v for k, v in self._counts.items() if v[1] > now}

    async def _incr(self, name: str, by: int, ttl: int = 2 * WINDOW_S) -> int:
        self._gc()
        n = self._counts.get(name, (0, 0.0))[0] + by
        self._counts[name] = (n, self.clock() + ttl)
        return n

    async def _get(self, name: str) -> int:
        self._gc()
        return self._counts.get(name, (0, 0.0))[0]


_INCR_EXPIRE = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n == tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return n
"""


class RedisLimiter(Limiter):
    """Counters in Redis: INCRBY and EXPIRE in one Lua script, so the count is atomic across gateways.
    When Redis is unreachable the limiter fails open (serves) and logs, rather than refusing everyone."""

    def __init__(self, settings: LimitSettings, url: str, clock: Callable[[], float] = time.time):
        super().__init__(settings, clock)
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._script = self.redis.register_script(_INCR_EXPIRE)

    async def _incr(self, name: str, by: int, ttl: int = 2 * WINDOW_S) -> int:
        try:
            return int(await self._script(keys=[name], args=[by, ttl]))
        except Exception as e:  # fail open
            log.warning("rate-limit counter unavailable (%s); admitting", type(e).__name__)
            return 0

    async def _get(self, name: str) -> int:
        try:
            v = await self.redis.get(name)
        except Exception as e:
            log.warning("rate-limit counter unavailable (%s); admitting", type(e).__name__)
            return 0
        return int(v or 0)

    async def close(self) -> None:
        await self.redis.aclose()


def make_limiter(settings: LimitSettings, queue_redis_url: str | None = None) -> Limiter:
    url = settings.redis_url or queue_redis_url
    if url:
        return RedisLimiter(settings, url)
    return MemoryLimiter(settings)
