"""Queue semantics, parametrised over implementations: in-process, Redis (a real redis-server) and
Redis on fakeredis (its Lua runs on lupa; skipped where lupa is missing)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from engine import EngineRequest, RequestOutput
from gateway.messages import QueueItem
from gateway.queue.base import QueueFull
from gateway.queue.memory import MemoryQueue

PRIO = {"pro": 0, "standard": 1}


def _memory(**kw):
    return MemoryQueue(**kw)


def _redis(request, **kw):
    from gateway.queue.redis import RedisQueue

    server = request.getfixturevalue("redis_server")
    return RedisQueue(server.url, prefix=f"t{uuid.uuid4().hex[:8]}", **kw)


def _fakeredis(request, **kw):
    pytest.importorskip("lupa", reason="fakeredis runs Lua only with lupa installed")
    import fakeredis

    from gateway.queue.redis import RedisQueue

    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer(), decode_responses=True)
    return RedisQueue(client=client, prefix="t", **kw)


QUEUE_FACTORIES = {"memory": lambda request, **kw: _memory(**kw), "redis": _redis, "fakeredis": _fakeredis}


@pytest.fixture(params=sorted(QUEUE_FACTORIES))
async def make_queue(request):
    made = []

    def factory(**kw):
        kw.setdefault("max_wait_ms", 0)
        q = QUEUE_FACTORIES[request.param](request, **kw)
        made.append(q)
        return q

    yield factory
    for q in made:
        await q.close()


def item(rid: str, tier: str = "standard", enqueued_at: float | None = None) -> QueueItem:
    it = QueueItem(request=EngineRequest(request_id=rid, prompt_token_ids=[1], priority=PRIO[tier]), tier=tier)
    if enqueued_at is not None:
        it.enqueued_at = enqueued_at
    return it


async def ids(q, n=100, **kw):
    return [i.request_id for i in await q.pull(n, timeout=0.5, **kw)]


async def test_priority_then_fifo(make_queue):
    q = make_queue()
    for rid, tier in [("s1", "standard"), ("p1", "pro"), ("s2", "standard"), ("p2", "pro")]:
        await q.put(item(rid, tier))
    assert await ids(q) == ["p1", "p2", "s1", "s2"]


async def test_max_items_and_depth(make_queue):
    q = make_queue()
    for i in range(5):
        await q.put(item(f"s{i}"))
    await q.put(item("p0", "pro"))
    assert await q.depth("standard") == 5 and await q.depth("pro") == 1 and await q.depth() == 6
    assert await ids(q, 2) == ["p0", "s0"]
    assert await q.depth("standard") == 4
    assert await ids(q, 10) == ["s1", "s2", "s3", "s4"]
    assert await q.depth() == 0


async def test_depth_at_most_counts_the_tiers_priorities_not_batch_lines(make_queue):
    q = make_queue()
    await q.put(item("p0", "pro"))
    await q.put(item("s0"))
    line = item("line0")
    line.request.priority = 2  # beyond every tier: a Batch API line, queued under its owner's tier
    await q.put(line)
    assert await q.depth_at_most(1) == 2 and await q.depth_at_most(0) == 1 and await q.depth_at_most(2) == 3
    assert await q.depth() == 3
    assert await ids(q, 2) == ["p0", "s0"]
    assert await q.depth_at_most(1) == 0 and await q.depth_at_most(2) == 1


async def test_aging_serves_old_items_first_in_arrival_order(make_queue):
    q = make_queue(aging_s=5.0)
    now = time.time()
    await q.put(item("old-s", "standard", enqueued_at=now - 20))
    await q.put(item("older-s", "standard", enqueued_at=now - 30))  # FIFO within tier still holds
    await q.put(item("p-new", "pro"))
    await q.put(item("p-old", "pro", enqueued_at=now - 10))
    # Heads: standard "old-s" (aged, 20s), pro "p-new" (fresh). Aged first, then priority.
    assert await ids(q) == ["old-s", "older-s", "p-new", "p-old"]


async def test_aged_items_across_tiers_in_arrival_order(make_queue):
    q = make_queue(aging_s=5.0)
    now = time.time()
    await q.put(item("p-aged", "pro", enqueued_at=now - 10))
    await q.put(item("s-aged", "standard", enqueued_at=now - 20))
    await q.put(item("p-fresh", "pro"))
    assert await ids(q) == ["s-aged", "p-aged", "p-fresh"]


async def test_bounded_depth_per_tier(make_queue):
    q = make_queue(max_depth={"pro": 1, "standard": 2})
    await q.put(item("s1"))
    await q.put(item("s2"))
    with pytest.raises(QueueFull) as exc:
        await q.put(item("s3"))
    assert exc.value.tier == "standard" and exc.value.retry_after > 0
    await q.put(item("p1", "pro"))  # another tier has its own budget
    with pytest.raises(QueueFull):
        await q.put(item("p2", "pro"))
    await ids(q, 1)
    await q.put(item("p2", "pro"))  # room again after a pull


async def test_pull_times_out_empty(make_queue):
    q = make_queue()
    t0 = time.monotonic()
    assert await q.pull(10, timeout=0.1) == []
    assert 0.08 <= time.monotonic() - t0 < 1.0


async def test_pull_wakes_on_put(make_queue):
    q = make_queue()

    async def later():
        await asyncio.sleep(0.05)
        await q.put(item("x"))

    task = asyncio.create_task(later())
    t0 = time.monotonic()
    assert await ids(q) == ["x"]
    assert time.monotonic() - t0 < 0.4
    await task


async def test_fill_target_waits_at_most_max_wait(make_queue):
    q = make_queue(fill_target=3, max_wait_ms=150)
    await q.put(item("a"))
    t0 = time.monotonic()
    assert await ids(q) == ["a"]  # never reached 3: returned after max_wait
    assert 0.12 <= time.monotonic() - t0 < 1.0


async def test_fill_target_returns_when_filled(make_queue):
    q = make_queue(fill_target=3, max_wait_ms=2000)
    await q.put(item("a"))

    async def more():
        await asyncio.sleep(0.05)
        await q.put(item("b"))
        await q.put(item("c"))

    task = asyncio.create_task(more())
    t0 = time.monotonic()
    assert await ids(q) == ["a", "b", "c"]
    assert time.monotonic() - t0 < 1.0
    await task


async def test_results_channel_in_order(make_queue):
    q = make_queue()
    sub = await q.subscribe("r1")
    await q.publish(RequestOutput(request_id="other", text="x"))  # nobody listens: dropped
    for i in range(3):
        await q.publish(RequestOutput(request_id="r1", text=str(i), finished=i == 2))
    got = [(await sub.get(timeout=1)).text for _ in range(3)]
    assert got == ["0", "1", "2"]
    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        await sub.get(timeout=0.05)
    await sub.close()


async def test_cancel_queued_item_removes_it(make_queue):
    q = make_queue()
    await q.put(item("a"))
    await q.put(item("b"))
    await q.cancel("a")
    assert await q.depth("standard") == 1
    assert await ids(q) == ["b"]


async def test_cancel_running_item_reaches_workers(make_queue):
    q = make_queue()
    await q.put(item("a"))
    assert await ids(q) == ["a"]
    waiter = asyncio.create_task(q.next_cancellations(timeout=2))
    await asyncio.sleep(0.01)
    await q.cancel("a")
    assert await waiter == ["a"]
    assert await q.next_cancellations(timeout=0.05) == []


def test_queue_item_roundtrip():
    it = item("z", "pro")
    assert QueueItem.from_dict(it.to_dict()) == it
