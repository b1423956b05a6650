"""gateway/queue/fair.py: fair share between the keys of one priority, and the queues that order by it:
the in-process one and the Redis one (its Lua scripts keep the same tags in Redis; a real redis-server)."""

from __future__ import annotations

import uuid

import pytest

from engine import EngineRequest, SamplingParams
from gateway.messages import QueueItem
from gateway.queue.fair import FairShare, request_cost
from gateway.queue.memory import MemoryQueue


def test_one_key_keeps_arrival_order():
    fair = FairShare()
    tags = [fair.tag(1, "a", c) for c in (5, 1, 300, 2)]
    assert tags == sorted(tags) and len(set(tags)) == 4


def test_a_light_key_goes_ahead_of_a_flood_and_idle_earns_no_credit():
    fair = FairShare()
    flood = [fair.tag(1, "heavy", 100) for _ in range(10)]
    light = fair.tag(1, "light", 100)
    assert light == 0.0 and sum(t < light for t in flood) == 0  # ties: arrival decides, only the head
    fair.served(1, flood[0])
    fair.served(1, light)
    second = fair.tag(1, "light", 100)
    assert second == 100.0 and sum(t < second for t in flood) == 1  # one of the flood's 10 ahead of it
    # Served far ahead while "late" idled: it comes back at the clock, not at 0 with 900 tokens of credit.
    for t in flood[1:]:
        fair.served(1, t)
    late = fair.tag(1, "late", 100)
    assert late == flood[-1]


def test_priorities_keep_their_own_clocks():
    fair = FairShare()
    for _ in range(5):
        fair.served(2, fair.tag(2, "a", 1000))
    assert fair.tag(1, "a", 10) == 0.0


def test_request_cost_counts_prompt_and_the_most_it_may_generate():
    assert request_cost(100, 50) == 150 and request_cost(0, 0) == 1 and request_cost(10, None) == 266


def _item(rid: str, key: str, max_tokens: int = 64) -> QueueItem:
    req = EngineRequest(rid, [1] * 32, SamplingParams(max_tokens=max_tokens), priority=1)
    return QueueItem(request=req, tier="standard", key=key)


async def test_the_memory_queue_serves_a_light_key_between_a_heavy_keys_requests():
    q = MemoryQueue(max_wait_ms=0)
    for i in range(20):
        await q.put(_item(f"h{i}", "heavy"))
    await q.put(_item("l0", "light"))
    await q.put(_item("l1", "light"))
    got = [i.request_id for i in await q.pull(100, timeout=0.5)]
    # Arrival order would serve the light key 21st and 22nd; fair share serves it 2nd and 4th.
    assert got.index("l0") == 1 and got.index("l1") == 3, got
    assert [r for r in got if r.startswith("h")] == [f"h{i}" for i in range(20)]
    await q.close()


async def test_a_cancelled_queued_item_leaves_the_fair_queue():
    q = MemoryQueue(max_wait_ms=0)
    for rid, key in [("a", "x"), ("b", "y"), ("c", "x")]:
        await q.put(_item(rid, key))
    await q.cancel("b")
    assert [i.request_id for i in await q.pull(10, timeout=0.5)] == ["a", "c"]
    assert await q.depth() == 0
    await q.close()


def test_a_refused_request_is_no_service_it_moves_neither_its_key_nor_the_clock():
    fair = FairShare()
    first = fair.tag(1, "heavy", 100)
    fair.served(1, first)
    refused = fair.tag(1, "heavy", 100)
    fair.withdraw(1, "heavy", refused, 100)
    assert fair.tag(1, "heavy", 100) == refused  # its next one takes the refused one's place
    assert fair.tag(1, "light", 100) == 0.0  # the clock stayed where service left it


@pytest.fixture
async def redis_queue(redis_server):
    from gateway.queue.redis import RedisQueue

    made = []
    prefix = f"t{uuid.uuid4().hex[:8]}"  # one deployment: every queue made here shares its keys

    def make(**kw):
        q = RedisQueue(redis_server.url, prefix=prefix, max_wait_ms=0, **kw)
        made.append(q)
        return q
    yield make
    for q in made:
        await q.close()


@pytest.mark.redis
async def test_the_redis_queue_serves_a_light_key_between_a_heavy_keys_requests_across_gateways(redis_queue):
    """Two gateways put into one Redis: the tags live in Redis, so the light key's requests go ahead of the
    heavy key's flood whichever gateway took them, and the heavy key's own order is kept."""
    g1, g2, worker = redis_queue(), redis_queue(), redis_queue()
    for i in range(20):
        await g1.put(_item(f"h{i:02d}", "heavy"))
    await g2.put(_item("l0", "light"))
    await g2.put(_item("l1", "light"))
    got = [i.request_id for i in await worker.pull(100, timeout=0.5)]
    # Arrival order would serve the light key 21st and 22nd. Its first request ties with the flood's head
    # (both start at the clock): Redis breaks a tie by id, not arrival, so it is 1st or 2nd.
    assert got.index("l0") <= 1 and got.index("l1") <= 3, got
    assert [r for r in got if r.startswith("h")] == [f"h{i:02d}" for i in range(20)]
    # The clock moved with what was served: a key idle all along starts at it, with no credit.
    await g1.put(_item("h20", "heavy"))
    await g2.put(_item("late", "late"))
    assert [i.request_id for i in await worker.pull(100, timeout=0.5)][0] == "late"


@pytest.mark.redis
async def test_a_cancelled_redis_item_gives_its_share_back(redis_queue):
    """x's requests cost 96 tokens, y's 48. y's cancelled request gives its 48 back, so y's next starts at
    48, ahead of x's second (96); charged for it, y's next would tie with x's and lose the tie by id."""
    q = redis_queue()
    await q.put(_item("x0", "x"))
    await q.put(_item("y0", "y", max_tokens=16))
    await q.put(_item("y1", "y", max_tokens=16))
    await q.cancel("y1")  # y's latest: its finish tag goes back, y is not charged for it
    await q.put(_item("y2", "y", max_tokens=16))
    await q.put(_item("x1", "x"))
    got = [i.request_id for i in await q.pull(10, timeout=0.5)]
    assert "y1" not in got and got.index("y2") < got.index("x1"), got
    assert await q.depth() == 0
