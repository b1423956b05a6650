"""The Redis queue's delivery guarantees with in-process workers on the fake engine (fast, a real
redis-server): leases and reclaim with resume tokens, fencing and de-duplication, cancellation,
deadlines, hand-back on shutdown, heartbeats, a Redis restart with AOF. The multi-process versions
with the real engine are in test_distributed.py."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from engine import EngineRequest, RequestOutput, SamplingParams
from gateway.messages import ErrorOutput, QueueItem
from gateway.queue.redis import RedisQueue
from gateway.worker.worker import EngineWorker
from tests.fixtures.fake_engine import FakeEngine

pytestmark = pytest.mark.redis

PROMPT = "abcdefghij"


def qitem(rid: str, max_tokens: int = 8, prompt: str = PROMPT, deadline: float | None = None) -> QueueItem:
    return QueueItem(request=EngineRequest(request_id=rid, prompt_token_ids=[ord(c) for c in prompt],
                                           sampling=SamplingParams(max_tokens=max_tokens)),
                     tier="standard", deadline=deadline)


def expected(max_tokens: int, prompt: str = PROMPT) -> str:
    return "".join(prompt[i % len(prompt)] for i in range(max_tokens))


@pytest.fixture
async def cluster(redis_server):
    """make(lease_s=...) -> a RedisQueue on a fresh key prefix; closes them all at the end."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    made: list[RedisQueue] = []
    workers: list[EngineWorker] = []

    def make(**kw) -> RedisQueue:
        kw.setdefault("max_wait_ms", 0)
        kw.setdefault("lease_s", 1.0)
        q = RedisQueue(redis_server.url, prefix=prefix, **kw)
        made.append(q)
        return q

    async def worker(engine: FakeEngine, **kw) -> EngineWorker:
        w = EngineWorker(engine, make(**kw), poll_s=0.05, idle_wait_s=0.01, heartbeat_s=0.2)
        await w.start()
        workers.append(w)
        return w

    make.worker = worker  # type: ignore[attr-defined]
    yield make
    for w in workers:
        if w._thread is not None and w._thread.is_alive():
            w.engine.gate.set()
            await w.stop()
    for q in made:
        await q.close()


def kill(worker: EngineWorker) -> None:
    """As if SIGKILLed: nothing more leaves the worker (no publish, no renewal, no hand-back)."""
    async def dead(*args, **kwargs):
        await asyncio.Event().wait()

    # A task cancelled mid-command may go on (redis-py can absorb the cancellation): make sure that
    # nothing it does afterwards reaches Redis, as after a real kill -9.
    worker.queue.publish_batch = dead  # type: ignore[method-assign]
    worker.queue.renew = dead  # type: ignore[method-assign]
    worker._stopping = True
    for t in worker._tasks:
        t.cancel()
    worker._stop_thread.set()
    worker._wake.set()


async def collect(sub, timeout: float = 10.0) -> list[RequestOutput]:
    outs = []
    while True:
        out = await sub.get(timeout=timeout)
        outs.append(out)
        if out.finished:
            return outs


async def test_worker_killed_mid_generation_is_resumed_elsewhere(cluster):
    gw = cluster(reap_interval_s=0.1)
    gw.start_reaper()
    slow = FakeEngine(max_running_requests=4, step_s=0.05)
    w1 = await cluster.worker(slow, lease_s=0.5)
    subs = {f"k{i}": await gw.subscribe(f"k{i}") for i in range(3)}
    for rid in subs:
        await gw.put(qitem(rid, max_tokens=30))
    firsts = {rid: await s.get(timeout=5) for rid, s in subs.items()}  # all three are generating on w1
    await asyncio.sleep(0.2)
    kill(w1)
    t_kill = time.monotonic()
    w2 = await cluster.worker(FakeEngine(max_running_requests=4), lease_s=0.5)
    for rid, s in subs.items():
        outs = [firsts[rid]] + await collect(s)
        text = "".join(o.text for o in outs)
        assert text == expected(30), (rid, text)  # nothing lost, nothing repeated
        assert [o.completion_tokens for o in outs] == sorted({o.completion_tokens for o in outs})
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 30
    assert time.monotonic() - t_kill < 5
    assert gw.reclaimed >= 1 or w2.queue.reclaimed >= 1
    assert set(w2.engine.added) == set(subs)
    # w2 was handed the tokens already sent: it generated only the rest.
    assert all(rid not in slow.running for rid in subs)


async def test_publish_is_fenced_and_deduplicated(cluster):
    gw, wq = cluster(), cluster()
    sub = await gw.subscribe("f1")
    await gw.put(qitem("f1"))
    [it] = await wq.pull(10, timeout=1)
    out1 = RequestOutput(request_id="f1", text="a", token_ids=[97], completion_tokens=1)
    assert await wq.publish_batch([out1]) == []
    assert await wq.publish_batch([out1]) == []  # a retried publish (lost reply) adds nothing
    other = cluster()  # not the owner: rejected, reported as lost
    assert await other.publish_batch([RequestOutput(request_id="f1", text="X", token_ids=[88],
                                                    completion_tokens=2)]) == ["f1"]
    fin = RequestOutput(request_id="f1", text="b", token_ids=[98], completion_tokens=2, finished=True,
                        finish_reason="length")
    assert await wq.publish_batch([fin]) == []
    outs = await collect(sub, timeout=2)
    assert [o.text for o in outs] == ["a", "b"]
    # Acknowledged: no item, no lease left; only the result stream (with a short expiry).
    r = wq._r
    assert not await r.exists(f"{wq.prefix}:item:f1") and await r.zcard(f"{wq.prefix}:leased") == 0
    assert 0 < await r.ttl(f"{wq.prefix}:res:f1") <= 60
    await sub.close()
    assert not await r.exists(f"{wq.prefix}:res:f1")


async def test_subscription_drops_repeated_sequence_numbers(cluster):
    gw = cluster()
    sub = await gw.subscribe("d1")
    key = f"{gw.prefix}:res:d1"
    import json

    from gateway.messages import output_to_dict
    for seq, text, fin in [(1, "a", "0"), (2, "b", "0"), (2, "b", "0"), (1, "a", "0"), (3, "c", "1"), (3, "c", "1")]:
        out = RequestOutput(request_id="d1", text=text, completion_tokens=seq, finished=fin == "1")
        await gw._r.xadd(key, {"seq": seq, "fin": fin, "tok": "", "data": json.dumps(output_to_dict(out))})
    outs = await collect(sub, timeout=2)
    assert [o.text for o in outs] == ["a", "b", "c"]
    assert sub.duplicates_dropped == 3


async def test_cancel_running_reaches_worker_and_frees_it(cluster):
    gw = cluster()
    engine = FakeEngine(max_running_requests=2, step_s=0.02)
    w = await cluster.worker(engine)
    sub = await gw.subscribe("c1")
    await gw.put(qitem("c1", max_tokens=10_000))
    await sub.get(timeout=5)
    t0 = time.monotonic()
    await gw.cancel("c1")
    while "c1" not in engine.aborted:
        assert time.monotonic() - t0 < 2
        await asyncio.sleep(0.01)
    for _ in range(100):
        if w.stats().in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert w.stats().in_flight == 0 and not engine.has_unfinished()
    assert not await gw._r.exists(f"{gw.prefix}:item:c1") and await gw._r.zcard(f"{gw.prefix}:leased") == 0
    await sub.close()


async def test_cancel_missed_on_the_channel_is_caught_by_renewal(cluster):
    gw = cluster()
    engine = FakeEngine(max_running_requests=2, step_s=0.02)
    await cluster.worker(engine, lease_s=0.3)  # renews every 0.1 s
    sub = await gw.subscribe("c2")
    await gw.put(qitem("c2", max_tokens=10_000))
    await sub.get(timeout=5)
    await gw._r.delete(f"{gw.prefix}:item:c2")  # the item is gone but no cancel message was sent
    for _ in range(100):
        if "c2" in engine.aborted:
            break
        await asyncio.sleep(0.02)
    assert "c2" in engine.aborted
    await sub.close()


async def test_queued_past_deadline_gets_timeout_not_run(cluster):
    gw = cluster(reap_interval_s=0.05)
    gw.start_reaper()
    sub = await gw.subscribe("late")
    await gw.put(qitem("late", deadline=time.time() + 0.2))  # no worker takes it in time
    out = await sub.get(timeout=3)
    assert isinstance(out, ErrorOutput) and out.error_code == "queue_timeout" and out.finished
    assert await gw.depth() == 0
    engine = FakeEngine()
    await cluster.worker(engine)
    await asyncio.sleep(0.2)
    assert "late" not in engine.added


async def test_graceful_stop_hands_back_with_tokens(cluster):
    gw = cluster()
    e1 = FakeEngine(max_running_requests=2, step_s=0.05)
    w1 = await cluster.worker(e1, lease_s=5.0)
    sub = await gw.subscribe("h1")
    await gw.put(qitem("h1", max_tokens=40))
    first = await sub.get(timeout=5)
    await asyncio.sleep(0.2)
    await w1.stop(grace_s=0.1)  # cannot finish 40 tokens in 0.1 s: hands it back, no error to the client
    assert await gw.depth() == 1
    await cluster.worker(FakeEngine(max_running_requests=2), lease_s=5.0)
    outs = [first] + await collect(sub)
    assert "".join(o.text for o in outs) == expected(40)
    assert outs[-1].finish_reason == "length"


async def test_heartbeats_list_live_workers(cluster):
    gw = cluster(heartbeat_ttl_s=0.5)
    assert await gw.workers() == []
    engine = FakeEngine(max_running_requests=3)
    engine.stats = type("Stats", (), {"busy_seconds": 1.25})()  # the real engine's step-time counter
    w = await cluster.worker(engine, heartbeat_ttl_s=0.5)
    await asyncio.sleep(0.3)
    [info] = await gw.workers()
    assert info.capacity == 3 and info.model == "fake-model" and info.in_flight == 0
    assert info.busy_seconds == 1.25  # the router's busy ratio across workers
    assert info.kv_usage == 0.0  # the dashboard's KV gauge, for workers elsewhere too
    assert info.worker_id == w.queue.consumer_id
    await w.stop()
    assert await gw.workers() == []


async def test_redis_restart_loses_nothing(redis_server, cluster):
    gw = cluster(reap_interval_s=0.2)
    gw.start_reaper()
    engine = FakeEngine(max_running_requests=8, step_s=0.02)
    await cluster.worker(engine, lease_s=3.0)
    subs = {f"r{i}": await gw.subscribe(f"r{i}") for i in range(6)}
    for rid in list(subs)[:3]:
        await gw.put(qitem(rid, max_tokens=60))
    await asyncio.gather(*(subs[rid].get(timeout=5) for rid in list(subs)[:3]))
    await asyncio.to_thread(redis_server.restart, 0.5)  # AOF keeps the data
    for rid in list(subs)[3:]:  # new requests after the restart
        await gw.put(qitem(rid, max_tokens=20))
    results = await asyncio.gather(*(collect(s, timeout=20) for s in subs.values()))
    for rid, outs in zip(list(subs), results):
        n = 60 if rid in ("r0", "r1", "r2") else 20
        text = "".join(o.text for o in outs)
        # r0..r2: the first output was consumed above.
        assert text in (expected(n), expected(n)[1:]), (rid, text)
        assert outs[-1].completion_tokens == n
