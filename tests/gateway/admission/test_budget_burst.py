"""Bursts against a budget, end to end: a real `sluice serve` (one, or two sharing Redis) with a budgeted key
and a provider slow enough that every request of a burst is in flight at once. Each request holds its
worst-case cost while it runs, so the key's spend never passes its budget by more than one request's cost.
And the hold of a gateway that dies is not held forever."""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import pytest

from gateway.admission.usage import UsageStore
from tests.fixtures.processes import PRICE_IN, PRICE_OUT, Gateway, create_key, start_mock, stop_all, write_config
from tests.fixtures.servers import free_port

BUDGET = 0.5
MAX_TOKENS = 64
ANSWER_TOKENS = 32  # the mock's answer, under max_tokens
PROMPT_WORDS = 2  # "hello there": the mock counts a prompt token per word
ONE_REQUEST_MAX = (PROMPT_WORDS * PRICE_IN + MAX_TOKENS * PRICE_OUT) / 1e6  # the most one request can cost
BODY = {"model": "remote-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": MAX_TOKENS}


async def _burst(bases: list[str], key: str, n: int = 64) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:

        async def one(i: int) -> tuple[int, dict]:
            async with s.post(bases[i % len(bases)] + "/v1/chat/completions", json=BODY) as r:
                return r.status, await r.json()

        return await asyncio.gather(*(one(i) for i in range(n)))


async def _spend_until_refused(bases: list[str], key: str) -> tuple[int, int]:
    """Bursts of 64 until one is refused whole with nothing in flight; returns (answered, refused)."""
    answered = refused = 0
    for _ in range(30):
        results = await _burst(bases, key)
        for st, body in results:
            if st == 200:
                answered += 1
            else:
                assert st == 429 and body["error"]["code"] == "insufficient_quota", body
                refused += 1
        if all(st == 429 for st, _ in results):
            return answered, refused
    raise AssertionError("the budget never refused a whole burst")


def _config(tmp_path, mock_port: int, key: str, redis_url: str | None, n: int):
    port = free_port()
    extra = f"[limits.keys.{key}]\nbudget = {BUDGET}\n"
    if redis_url:
        extra = f'[limits]\nredis_url = "{redis_url}"\n' + extra
    cfg = write_config(tmp_path / f"sluice{n}.toml", port=port, mock_port=mock_port, tmp_path=tmp_path, extra=extra)
    return cfg, port


def _slow_mock(tmp_path):
    """The mock provider answering after 300 ms: a burst's requests are all in flight together."""
    return start_mock(tmp_path, tokens=ANSWER_TOKENS, ttft_ms=300)


@pytest.mark.slow
async def test_a_burst_of_64_cannot_overshoot_a_budget(tmp_path):
    mock, mport = _slow_mock(tmp_path)
    procs = [mock]
    try:
        cfg, port = _config(tmp_path, mport, "bob", None, 1)
        key = create_key(cfg, "bob")
        gw = await asyncio.to_thread(Gateway, cfg, tmp_path / "gw.log", port)
        procs.append(gw.proc)
        answered, refused = await _spend_until_refused([gw.base], key)
        st, usage = await asyncio.to_thread(gw.call, "/v1/usage", key)
        spent = usage["totals"]["cost"]
        assert st == 200 and usage["totals"]["requests"] == answered
        assert refused > 0 and BUDGET <= spent <= BUDGET + ONE_REQUEST_MAX, (answered, spent)
    finally:
        stop_all(procs)


@pytest.mark.slow
async def test_two_gateways_sharing_redis_hold_one_budget(tmp_path, redis_server):
    mock, mport = _slow_mock(tmp_path)
    procs = [mock]
    name = f"hank-{uuid.uuid4().hex[:8]}"  # the session's Redis is shared with other tests
    try:
        cfg1, port1 = _config(tmp_path, mport, name, redis_server.url, 1)
        cfg2, port2 = _config(tmp_path, mport, name, redis_server.url, 2)
        key = create_key(cfg1, name)
        gws = [await asyncio.to_thread(Gateway, cfg, tmp_path / f"gw{i}.log", port)
               for i, (cfg, port) in enumerate([(cfg1, port1), (cfg2, port2)])]
        procs += [g.proc for g in gws]
        answered, refused = await _spend_until_refused([g.base for g in gws], key)
        for gw in gws:  # both read the same totals from Redis
            st, usage = await asyncio.to_thread(gw.call, "/v1/usage", key)
            assert st == 200 and usage["totals"]["requests"] == answered
            spent = usage["totals"]["cost"]
            assert refused > 0 and BUDGET <= spent <= BUDGET + ONE_REQUEST_MAX, (answered, spent)
    finally:
        stop_all(procs)


async def test_a_hold_that_is_never_settled_expires(redis_server):
    """A gateway killed mid-request never settles its hold: it expires after reservation_ttl_s, while a
    live gateway's holds are renewed."""
    key = f"kim-{uuid.uuid4().hex[:8]}"
    dead = UsageStore(redis_server.url, reservation_ttl_s=0.5)
    alive = UsageStore(redis_server.url, reservation_ttl_s=0.5)
    try:
        assert (await dead.reserve(key, 1.0, "req-dead", 1.0)).ok
        hold = await alive.reserve(key, 1.0, "req-1", 1.0)
        assert not hold.ok and hold.held == pytest.approx(1.0)  # held by the other gateway's request
        deadline = time.monotonic() + 5
        while not (hold := await alive.reserve(key, 1.0, "req-1", 1.0)).ok:
            assert time.monotonic() < deadline, "the dead gateway's hold never expired"
            await asyncio.sleep(0.1)
        alive.start()  # renews req-1's hold while it runs
        await asyncio.sleep(1.5)  # three TTLs
        hold = await dead.reserve(key, 1.0, "req-2", 0.1)
        assert not hold.ok and hold.held == pytest.approx(1.0)
        await alive.record(key, "m", "remote:p", 1, 0, 1, 0.25, request_id="req-1")  # settled to its real cost
        hold = await dead.reserve(key, 1.0, "req-3", 0.1)
        assert hold.ok and hold.spent == pytest.approx(0.25) and hold.held == 0
    finally:
        await alive.close()
        await dead.close()
