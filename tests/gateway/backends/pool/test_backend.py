"""PoolBackend against simulated replicas (bench/mock_engine.py over real HTTP): the tier order kept in
front of a FIFO engine, the room level learnt from its metrics, a dead replica skipped and taken back,
and a bounded wait when every replica is full."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from aiohttp.test_utils import TestServer

from bench.mock_engine import EngineModel, make_app
from bench.server import free_port
from gateway.backends.pool.backend import PoolBackend, PoolBusy
from gateway.backends.pool.replica import HEADROOM, START_LEVEL
from gateway.errors import APIError
from gateway.messages import GenerationRequest, Target
from gateway.openai.schema import ChatCompletionRequest
from gateway.settings import EngineReplicaSettings, RoutingSettings

MODEL = "m"
_ids = itertools.count()


async def _replica(**model) -> TestServer:
    server = TestServer(make_app(EngineModel(**model), model_name=MODEL), host="127.0.0.1")
    await server.start_server()
    return server


def _settings(name: str, server: TestServer | None, port: int | None = None, **kw) -> EngineReplicaSettings:
    port = port if port is not None else server.port  # type: ignore[union-attr]
    return EngineReplicaSettings(name=name, base_url=f"http://127.0.0.1:{port}/v1", models=[MODEL],
                                 **{"kind": "vllm", **kw})


def _gen(tier: str = "standard", priority: int = 1, tokens: int = 5, text: str = "hi",
         key: str | None = None) -> GenerationRequest:
    api = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=tokens,
                                stream=True)
    return GenerationRequest(request_id=f"r{next(_ids)}", target=Target.RELAY, model=MODEL, api=api, tier=tier,
                             priority=priority, key=key)


async def _answer(pool: PoolBackend, gen: GenerationRequest, events: list | None = None) -> tuple[str, str]:
    stream = await pool.submit(gen)
    async with stream:
        text = ""
        async for ch in stream:
            if events is not None and not text and ch.output.text:
                events.append(gen.tier)
            text += ch.output.text
        return stream.backend, text


@pytest.fixture
def routing() -> RoutingSettings:
    return RoutingSettings(breaker_failures=2, breaker_cooldown_s=0.3, backoff_base_s=0.01, backoff_max_s=0.05)


async def test_pro_leaves_first_when_the_replica_is_full(routing):
    server = await _replica(max_running=1, decode_ms=15, per_seq_ms=0)
    pool = PoolBackend([_settings("a", server, max_in_flight=1)], routing)
    try:
        events: list[str] = []
        first = asyncio.create_task(_answer(pool, _gen(tokens=10), events))
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(_answer(pool, _gen(tokens=3), events)) for _ in range(3)]
        await asyncio.sleep(0.02)
        pro = asyncio.create_task(_answer(pool, _gen("pro", 0, tokens=3), events))
        results = await asyncio.gather(first, *waiting, pro)
        assert all(b == "engine:a" and t == "".join(f" t{i}" for i in range(1, len(t.split()) + 1))
                   for b, t in results)
        assert events == ["standard", "pro", "standard", "standard", "standard"]
    finally:
        await pool.close()
        await server.close()


async def test_the_room_level_is_learnt_from_the_engines_queue(routing):
    server = await _replica(max_running=2, decode_ms=20, per_seq_ms=0)
    pool = PoolBackend([_settings("a", server)], routing)
    try:
        r = pool.replicas[0]
        assert r.level == START_LEVEL  # a slow start: nothing learnt yet
        tasks = [asyncio.create_task(_answer(pool, _gen(tokens=40))) for _ in range(5)]
        deadline = time.monotonic() + 5
        while not r.learnt and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert r.learnt and r.level == 2 + HEADROOM  # the engine ran 2 and queued the rest
        late = asyncio.create_task(_answer(pool, _gen(tokens=2)))
        await asyncio.sleep(0.1)
        assert r.reserved == 0 and not late.done() and len(pool._waiters) == 1  # held in Sluice, not the engine
        await asyncio.gather(*tasks, late)
    finally:
        await pool.close()
        await server.close()


async def test_a_dead_replica_is_skipped_then_taken_back_when_it_answers_again(routing):
    alive = await _replica(max_running=8, decode_ms=5)
    dead_port = free_port()
    pool = PoolBackend([_settings("a", None, port=dead_port), _settings("b", alive)], routing)
    try:
        for _ in range(4):  # a is least loaded first each time: its refusals move the request to b
            backend, text = await _answer(pool, _gen())
            assert backend == "engine:b" and text
        a = pool.replicas[0]
        deadline = time.monotonic() + 5
        while a.breaker.state == "closed" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert a.breaker.state != "closed" and not a.has_room()
        revived = TestServer(make_app(EngineModel(max_running=8, decode_ms=5), model_name=MODEL),
                             host="127.0.0.1", port=dead_port)
        await revived.start_server()
        try:
            deadline = time.monotonic() + 5
            while a.breaker.state != "closed" and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert a.breaker.state == "closed" and a.has_room()  # its metrics answered: back in the pool
            assert "engine:a" in {(await _answer(pool, _gen()))[0] for _ in range(4)}  # idle ties take turns
        finally:
            await revived.close()
    finally:
        await pool.close()
        await alive.close()


async def test_full_replicas_hold_a_request_no_longer_than_allowed(routing):
    server = await _replica(max_running=1, decode_ms=30, per_seq_ms=0)
    pool = PoolBackend([_settings("a", server, max_in_flight=1)], routing)
    try:
        busy = asyncio.create_task(_answer(pool, _gen(tokens=20)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(PoolBusy):
            await pool.submit(_gen(), max_wait_s=0.2)
        assert 0.15 < time.monotonic() - t0 < 1.0
        assert pool._waiters == [] and pool.replicas[0].reserved == 0
        await busy
    finally:
        await pool.close()
        await server.close()


async def test_a_key_flooding_the_pool_cannot_push_another_keys_request_behind_its_flood(routing):
    server = await _replica(max_running=1, decode_ms=10, per_seq_ms=0)
    pool = PoolBackend([_settings("a", server, max_in_flight=1)], routing)
    try:
        order: list[str] = []

        async def one(key: str, i: int) -> None:
            gen = _gen(tokens=3, key=key)
            stream = await pool.submit(gen)
            order.append(f"{key}{i}")
            async with stream:
                async for _ in stream:
                    pass

        flood = [asyncio.create_task(one("heavy", i)) for i in range(6)]
        await asyncio.sleep(0.05)  # heavy0 runs, heavy1-5 wait for room
        light = asyncio.create_task(one("light", 0))
        await asyncio.gather(*flood, light)
        # Arrival order would send it 7th; fair share sends it after the flood's next request.
        assert order.index("light0") <= 2, order
        assert [o for o in order if o.startswith("heavy")] == [f"heavy{i}" for i in range(6)]
    finally:
        await pool.close()
        await server.close()


async def test_the_wait_for_room_is_the_target_less_the_replicas_first_token_time(routing):
    server = await _replica(max_running=1, decode_ms=30, per_seq_ms=0)
    pool = PoolBackend([_settings("a", server, max_in_flight=1)], routing)
    try:
        for s in (0.2, 0.2, 0.2):
            pool.replicas[0].first_token.observe(s)  # its first token takes 0.2 s once sent
        busy = asyncio.create_task(_answer(pool, _gen(tokens=20)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(PoolBusy):
            await pool.submit(_gen(), max_wait_s=0.5)  # 0.3 s of waiting for room, not 0.5
        assert 0.2 < time.monotonic() - t0 < 0.45
        await busy
    finally:
        await pool.close()
        await server.close()


async def test_a_request_that_cannot_get_room_in_time_leaves_at_once(routing):
    server = await _replica(max_running=1, decode_ms=20, per_seq_ms=0)
    pool = PoolBackend([_settings("a", server, max_in_flight=1)], routing)
    try:
        for _ in range(3):  # three requests of ~0.1 s on its one slot: room opens about 10 times a second
            await _answer(pool, _gen(tokens=4))
        waiting = [asyncio.create_task(_answer(pool, _gen(tokens=4))) for _ in range(6)]
        await asyncio.sleep(0.03)
        t0 = time.monotonic()
        with pytest.raises(PoolBusy):  # 6 ahead at ~10/s: ~0.7 s, past its 0.3 s
            await pool.submit(_gen(), max_wait_s=0.3)
        assert time.monotonic() - t0 < 0.1
        await asyncio.gather(*waiting)
        t0 = time.monotonic()
        stream = await pool.submit(_gen(), max_wait_s=0.3)  # nobody ahead: room now
        await stream.aclose()
        assert time.monotonic() - t0 < 0.1
    finally:
        await pool.close()
        await server.close()


async def test_vllms_extras_go_to_replicas_that_apply_them_and_keep_away_from_others(routing):
    from gateway.backends.pool.backend import PoolStream

    pool = PoolBackend([_settings("v", None, port=9), _settings("l", None, port=9, kind="llama-server")], routing)
    try:
        gen = _gen(tokens=4)
        gen.api = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        top_k=5, ignore_eos=True, stream=True)
        v, llama = pool.replicas
        stream = PoolStream(pool, gen, [v], v)
        body = stream._body(v)
        assert body["top_k"] == 5 and body["ignore_eos"] is True
        await stream.aclose()
        assert (await pool.admit(gen, 0.1)) is v  # the llama-server replica would drop them
        v.reserved -= 1
        only_llama = PoolBackend([_settings("l", None, port=9, kind="llama-server")], routing)
        with pytest.raises(APIError) as e:
            await only_llama.admit(gen, 0.1)
        assert e.value.status == 400 and e.value.param == "top_k"
        await only_llama.close()
    finally:
        await pool.close()


async def test_the_tier_is_passed_as_the_engines_priority_when_configured(routing):
    server = await _replica(max_running=1, decode_ms=15, per_seq_ms=0, policy="priority")
    pool = PoolBackend([_settings("a", server, pass_priority=True)], routing)
    try:
        events: list[str] = []
        first = asyncio.create_task(_answer(pool, _gen(tokens=10), events))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(_answer(pool, _gen(tokens=3), events)) for _ in range(2)]
        await asyncio.sleep(0.05)
        pro = asyncio.create_task(_answer(pool, _gen("pro", 0, tokens=3), events))
        await asyncio.gather(first, *rest, pro)
        # the level was never learnt before they were sent: the engine's own priority queue ordered them
        assert events[:2] == ["standard", "pro"]
    finally:
        await pool.close()
        await server.close()


async def test_a_stream_broken_on_one_replica_is_continued_on_another_without_repeats_or_gaps(routing):
    dying = TestServer(make_app(EngineModel(max_running=4, decode_ms=5), model_name=MODEL, cut_after=4),
                       host="127.0.0.1")
    await dying.start_server()
    healthy = await _replica(max_running=4, decode_ms=5)
    pool = PoolBackend([_settings("a", dying), _settings("b", healthy)], routing)
    try:
        for _ in range(2):  # idle replicas take turns: one of the two starts on a
            stream = await pool.submit(_gen(tokens=12))
            pieces, finish = [], None
            async with stream:
                async for ch in stream:
                    pieces.append(ch.output.text)
                    if ch.output.finished:
                        finish = ch.output
            # From a: 4 then it died, and b continued with the other 8 only; or all 12 from b.
            assert "".join(pieces) == "".join(f" t{i}" for i in range(1, 13))
            assert stream.backend == "engine:b"
            assert finish is not None and finish.finish_reason == "length" and finish.completion_tokens == 12
        assert pool.replicas[0].breaker.consecutive == 1  # a died mid-stream once
    finally:
        await pool.close()
        await dying.close()
        await healthy.close()


async def test_a_llama_server_replica_continues_a_broken_stream_and_its_echo_of_the_partial_is_dropped(routing):
    """llama-server continues a final assistant message but streams the given part back before the new
    text (seen with bench.pool_kill: "The ocean isThe ocean is a vast ..."); the relay drops that echo."""
    dying = TestServer(make_app(EngineModel(max_running=4, decode_ms=5), model_name=MODEL, cut_after=4,
                                llama_continue=True), host="127.0.0.1")
    llama = TestServer(make_app(EngineModel(max_running=4, decode_ms=5), model_name=MODEL, llama_continue=True),
                       host="127.0.0.1")
    await dying.start_server()
    await llama.start_server()
    pool = PoolBackend([_settings("a", dying, kind="llama-server"), _settings("b", llama, kind="llama-server")],
                       routing)
    try:
        for _ in range(2):  # idle replicas take turns: one of the two starts on a, dies and is continued on b
            stream = await pool.submit(_gen(tokens=12))
            async with stream:
                pieces = [ch.output.text async for ch in stream]
            assert "".join(pieces) == "".join(f" t{i}" for i in range(1, 13))
            assert stream.backend == "engine:b"
        assert pool.replicas[0].breaker.consecutive == 1  # a died mid-stream once
    finally:
        await pool.close()
        await dying.close()
        await llama.close()


async def test_a_broken_stream_with_nowhere_to_continue_ends_with_an_error(routing):
    dying = TestServer(make_app(EngineModel(max_running=4, decode_ms=5), model_name=MODEL, cut_after=3),
                       host="127.0.0.1")
    await dying.start_server()
    pool = PoolBackend([_settings("a", dying)], routing)
    try:
        stream = await pool.submit(_gen(tokens=12))
        outs = []
        async with stream:
            async for ch in stream:
                outs.append(ch.output)
        assert "".join(o.text for o in outs) == " t1 t2 t3"
        assert outs[-1].finish_reason == "error" and outs[-1].completion_tokens == 3
    finally:
        await pool.close()
        await dying.close()
