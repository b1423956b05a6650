"""A queued request's deadline (X-Request-Timeout) on both queues: past it, a request still queued gets a
504 `queue_timeout` on time, and the request running ahead of it is not touched."""

from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest

from gateway.queue.redis import RedisQueue
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

MSG = [{"role": "user", "content": "hi"}]


def _client(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


async def _queued_request_times_out(base: str, engine: FakeEngine) -> None:
    engine.gate.clear()  # the engine stalls: the first request holds the only slot, the next one queues
    c = _client(base)
    hold = asyncio.create_task(c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3))
    for _ in range(200):
        if engine.added:
            break
        await asyncio.sleep(0.01)
    assert engine.added
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        await c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3,
                                        extra_headers={"X-Request-Timeout": "1"})
    took = time.monotonic() - t0
    assert e.value.status_code == 504 and e.value.body["code"] == "queue_timeout"
    assert 0.9 < took < 1.5, f"504 after {took:.2f}s"
    engine.gate.set()
    assert (await hold).choices[0].finish_reason == "length"  # the running request was not touched


async def test_queued_request_gets_504_on_time_in_process(tmp_path):
    engine = FakeEngine(max_running_requests=1)
    async with fake_gateway(tmp_path, engine=engine) as (base, app, _):
        await _queued_request_times_out(base, engine)


@pytest.mark.redis
async def test_queued_request_gets_504_on_time_through_redis(tmp_path, redis_server):
    engine = FakeEngine(max_running_requests=1)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    async with fake_gateway(tmp_path, engine=engine, redis_url=redis_server.url,
                            queue={"key_prefix": prefix, "lease_s": 30.0}) as (base, app, _):
        from gateway.state import STATE
        assert isinstance(app[STATE].queue, RedisQueue)
        await _queued_request_times_out(base, engine)
