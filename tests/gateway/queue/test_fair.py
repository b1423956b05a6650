"""gateway/queue/fair.py: fair share between the keys of one priority, and the in-process queue that
orders by it."""

from __future__ import annotations

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
