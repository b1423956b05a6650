"""bench/mock_engine.py, the simulated engine replica for routing measurements: the OpenAI SDK
against it, its concurrency limit and waiting queue as vLLM's metrics report them, priority order under
`--policy priority`, and prefix-cache hits for a shared prefix."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
from aiohttp.test_utils import TestServer

from bench.mock_engine import ENGINE, EngineModel, make_app


def _metrics(text: str) -> dict[str, float]:
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line}


async def _server(**model) -> TestServer:
    server = TestServer(make_app(EngineModel(**model)), host="127.0.0.1")
    await server.start_server()
    return server


async def test_sdk_answers_and_metrics_show_running_and_waiting():
    server = await _server(max_running=2, decode_ms=20, per_seq_ms=0)
    try:
        c = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
        tasks = [asyncio.create_task(c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=10))
            for i in range(4)]
        await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics")) as r:
            m = _metrics(await r.text())
        assert m["vllm:num_requests_running"] == 2 and m["vllm:num_requests_waiting"] == 2
        assert m["vllm:kv_cache_usage_perc"] == 1.0
        answers = await asyncio.gather(*tasks)
        assert all(a.choices[0].message.content == "".join(f" t{i}" for i in range(1, 11)) for a in answers)
        stream = await c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=3, stream=True,
                                                 messages=[{"role": "user", "content": "s"}])
        assert "".join([ch.choices[0].delta.content or "" async for ch in stream]) == " t1 t2 t3"
    finally:
        await server.close()


async def test_priority_policy_serves_the_lower_number_first():
    server = await _server(max_running=1, decode_ms=5, per_seq_ms=0, policy="priority")
    try:
        c = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
        done: list[str] = []

        async def ask(name: str, priority: int, n: int) -> None:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": name}], max_tokens=n,
                                            extra_body={"priority": priority})
            done.append(name)
        first = asyncio.create_task(ask("first", 1, 20))
        eng = server.app[ENGINE]
        for _ in range(500):  # running (not merely sent) before the others arrive: they wait behind it
            if eng.running:
                break
            await asyncio.sleep(0.01)
        assert eng.running
        queued = [asyncio.create_task(ask("standard", 1, 2)), asyncio.create_task(ask("pro", 0, 2))]
        await asyncio.gather(first, *queued)
        assert done == ["first", "pro", "standard"]
    finally:
        await server.close()


async def test_a_shared_prefix_hits_the_prefix_cache():
    server = await _server(block_chars=16)
    try:
        eng = server.app[ENGINE]
        c = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
        context = "Records are short and the answers are too. " * 8
        for q in ("first question", "second question"):
            await c.chat.completions.create(model="m", messages=[{"role": "system", "content": context},
                                                                 {"role": "user", "content": q}], max_tokens=1)
        assert eng.hits >= len(context) - 16 and eng.queries > 2 * len(context)
    finally:
        await server.close()


async def test_sdk_embeddings_are_the_texts_hash_vectors_each_one_engine_step():
    from bench.mock_engine import mock_vector

    server = await _server(max_running=1, decode_ms=30, per_seq_ms=0)
    try:
        c = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
        task = asyncio.create_task(c.embeddings.create(model="m", input=["one", "two", "three"]))
        seen = set()  # (running, waiting) while it is embedded: one input a step, the rest waiting
        async with aiohttp.ClientSession() as s:
            while not task.done():
                async with s.get(server.make_url("/metrics")) as r:
                    m = _metrics(await r.text())
                seen.add((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]))
                await asyncio.sleep(0.005)
        assert max(running for running, _ in seen) == 1 and (1, 2) in seen
        out = await task
        assert [d.embedding for d in out.data] == [mock_vector(t) for t in ("one", "two", "three")]
        assert mock_vector("one") != mock_vector("two") and out.usage.prompt_tokens > 0
    finally:
        await server.close()
