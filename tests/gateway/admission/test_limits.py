"""The rate and budget limiters (gateway/admission/limits.py) on a settable clock: requests and tokens per
minute per key and per tier, the window's Retry-After, budgets, the Batch API's tokens per UTC day, and one
count shared through Redis."""

from __future__ import annotations

import pytest

from gateway.admission.limits import MemoryLimiter, RedisLimiter
from gateway.settings import LimitSettings
from tests.fixtures.clock import Clock


async def test_memory_limiter_enforces_rpm_tpm_and_budget_per_minute_window():
    c = Clock(600.0)
    lim = MemoryLimiter(LimitSettings(keys={"k": {"rpm": 3, "tpm": 100}}, tiers={"standard": {"rpm": 1}}), clock=c)
    assert [(await lim.admit("k", "standard")).ok for _ in range(4)] == [True, True, True, False]
    v = await lim.admit("k", "standard")
    assert v.reason == "rpm" and v.retry_after == 60
    c.t += 59.5
    assert (await lim.admit("k", "standard")).retry_after == pytest.approx(0.5)
    c.t += 0.5  # the next window
    assert (await lim.admit("k", "standard")).ok
    await lim.charge_tokens("k", "standard", 100)
    v = await lim.admit("k", "standard")
    assert not v.ok and v.reason == "tpm"
    # tier default for other keys; a budget
    assert (await lim.admit("x", "standard")).ok and not (await lim.admit("x", "standard")).ok
    lim2 = MemoryLimiter(LimitSettings(keys={"b": {"budget": 1.0}}), clock=c)
    assert (await lim2.admit("b", "pro", spent=0.99)).ok
    assert (await lim2.admit("b", "pro", spent=1.0)).reason == "budget"


async def test_batch_tokens_per_day_wait_for_the_next_utc_day_and_outlive_minute_windows():
    c = Clock(86400.0 * 100 + 3600)  # 01:00 UTC
    lim = MemoryLimiter(LimitSettings(keys={"k": {"batch_tokens_per_day": 100}}), clock=c)
    assert await lim.batch_tokens_wait("k", "pro") == 0
    await lim.charge_batch_tokens("k", "pro", 60)
    c.t += 600  # minute windows come and go; the day's count stays
    await lim.admit("k", "pro")
    assert await lim.batch_tokens_wait("k", "pro") == 0
    await lim.charge_batch_tokens("k", "pro", 40)
    assert await lim.batch_tokens_wait("k", "pro") == pytest.approx(86400 - 3600 - 600)
    assert await lim.batch_tokens_wait("other", "pro") == 0  # per key; no quota: never waits
    await lim.charge_batch_tokens("other", "pro", 10**9)
    assert await lim.batch_tokens_wait("other", "pro") == 0
    c.t += 86400 - 3600 - 600  # the next day
    assert await lim.batch_tokens_wait("k", "pro") == 0


@pytest.mark.redis
async def test_redis_limiter_is_shared_and_atomic(redis_server):
    import asyncio

    c = Clock(1200.0)
    settings = LimitSettings(keys={"k": {"rpm": 50}})
    g1 = RedisLimiter(settings, redis_server.url, clock=c)
    g2 = RedisLimiter(settings, redis_server.url, clock=c)
    try:
        verdicts = await asyncio.gather(*[(g1 if i % 2 else g2).admit("k", "pro") for i in range(80)])
        assert sum(v.ok for v in verdicts) == 50  # two "gateways", one count
    finally:
        await g1.redis.flushdb()
        await g1.close()
        await g2.close()
