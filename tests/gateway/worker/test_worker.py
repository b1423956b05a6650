"""EngineWorker against the fake engine: one engine thread, capacity-bound pulls, aborts, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import EngineRequest, SamplingParams
from gateway.errors import Failure
from gateway.messages import ErrorOutput, QueueItem, WorkerStats
from gateway.queue.memory import MemoryQueue
from gateway.worker.engine_api import Engine
from gateway.worker.worker import EngineWorker
from tests.fixtures.fake_engine import FakeEngine


def qitem(rid: str, max_tokens: int = 3, prompt: str = "abc") -> QueueItem:
    return QueueItem(request=EngineRequest(request_id=rid, prompt_token_ids=[ord(c) for c in prompt],
                                           sampling=SamplingParams(max_tokens=max_tokens)), tier="standard")


@pytest.fixture
async def setup():
    engine = FakeEngine(max_running_requests=2)
    queue = MemoryQueue(max_wait_ms=0)
    worker = EngineWorker(engine, queue, poll_s=0.05, idle_wait_s=0.05)
    await worker.start()
    yield engine, queue, worker
    engine.gate.set()
    await worker.stop()


async def run_one(queue, rid, **kw):
    sub = await queue.subscribe(rid)
    await queue.put(qitem(rid, **kw))
    outs = []
    while True:
        out = await sub.get(timeout=5)
        outs.append(out)
        if out.finished:
            await sub.close()
            return outs


async def test_generates_and_uses_one_thread(setup):
    engine, queue, worker = setup
    results = await asyncio.gather(*(run_one(queue, f"r{i}", max_tokens=4) for i in range(6)))
    for outs in results:
        assert "".join(o.text for o in outs) == "abca"
        assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 4
    assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
    assert worker.stats().in_flight == 0


def test_the_fake_engine_has_everything_the_engine_protocol_declares():
    assert isinstance(FakeEngine(), Engine)
    assert not isinstance(object(), Engine)


async def test_stats_report_what_the_engine_declares(setup):
    engine, queue, worker = setup
    await run_one(queue, "s", max_tokens=3)
    stats = worker.stats()
    assert stats.busy_seconds == engine.stats.busy_seconds > 0
    assert stats.kv_usage == engine.kv_usage() == 0.0
    assert stats.to_dict()["kv_usage"] == 0.0  # it travels in heartbeats
    assert stats.prefill_tokens == engine.stats.prefill_tokens > 0  # the prompt was computed
    assert stats.prefill_pending == engine.pending_prefill_tokens() == 0
    assert WorkerStats.from_dict(stats.to_dict()).prefill_tokens == stats.prefill_tokens


async def test_pulls_only_up_to_capacity(setup):
    engine, queue, worker = setup
    engine.gate.clear()  # stall the engine
    subs = [await queue.subscribe(f"c{i}") for i in range(5)]
    for i in range(5):
        await queue.put(qitem(f"c{i}"))
    await asyncio.sleep(0.3)
    assert worker.stats().in_flight == 2
    assert await queue.depth("standard") == 3
    engine.gate.set()
    for s in subs:
        while not (await s.get(timeout=5)).finished:
            pass


async def test_items_beyond_every_tier_are_reported_apart():
    """A worker told the tiers' lowest priority counts what runs below it (Batch API lines) as background."""
    engine = FakeEngine(max_running_requests=4)
    queue = MemoryQueue(max_wait_ms=0)
    worker = EngineWorker(engine, queue, poll_s=0.05, idle_wait_s=0.05, background_above=1)
    await worker.start()
    try:
        engine.gate.clear()
        subs = [await queue.subscribe(f"b{i}") for i in range(3)]
        for i in range(3):
            it = qitem(f"b{i}")
            it.request.priority = 2 if i else 1  # b0 interactive (standard), b1 and b2 batch lines
            await queue.put(it)
        await asyncio.sleep(0.3)
        stats = worker.stats()
        assert (stats.in_flight, stats.background) == (3, 2) and stats.to_dict()["background"] == 2
        engine.gate.set()
        for sub in subs:
            while not (await sub.get(timeout=5)).finished:
                pass
        assert (worker.stats().in_flight, worker.stats().background) == (0, 0)
    finally:
        engine.gate.set()
        await worker.stop()


async def test_cancel_aborts_in_engine(setup):
    engine, queue, worker = setup
    sub = await queue.subscribe("long")
    await queue.put(qitem("long", max_tokens=10_000))
    await sub.get(timeout=5)  # it is running
    await queue.cancel("long")
    for _ in range(100):
        if "long" in engine.aborted:
            break
        await asyncio.sleep(0.02)
    assert "long" in engine.aborted
    assert not engine.has_unfinished()
    for _ in range(50):
        if worker.stats().in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert worker.stats().in_flight == 0


async def test_rejected_request_gets_error_output(setup):
    engine, queue, worker = setup
    outs = await run_one(queue, "bad", max_tokens=999_999)
    assert len(outs) == 1 and isinstance(outs[0], ErrorOutput)
    assert outs[0].finish_reason == "error" and outs[0].error_code == "fake_rejection"
    assert outs[0].failure is Failure.INVALID_REQUEST
    outs = await run_one(queue, "good")  # the worker lives on
    assert outs[-1].finish_reason == "length"


async def test_step_failure_fails_in_flight_and_worker_survives(setup):
    engine, queue, worker = setup
    engine.gate.clear()
    sub = await queue.subscribe("x")
    await queue.put(qitem("x", max_tokens=5))
    await asyncio.sleep(0.1)
    engine.fail_next_step = True
    engine.gate.set()
    out = await sub.get(timeout=5)
    assert out.finished and out.finish_reason == "error" and isinstance(out, ErrorOutput)
    assert out.failure is Failure.ENGINE
    assert worker.running
    outs = await run_one(queue, "after")
    assert outs[-1].finish_reason == "length"
