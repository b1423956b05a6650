"""The HTTP layer on a fake engine: shapes, errors, auth, overload, cancellation. Fast (no model)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from gateway.admission.keys import KeyStore
from gateway.state import STATE
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

MSG = [{"role": "user", "content": "hi"}]


def client(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=10)


async def test_chat_roundtrip_and_usage(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        r = await client(base).chat.completions.create(model="fake-model", messages=MSG, max_tokens=5)
        prompt = "user: hi\nassistant: "
        assert r.choices[0].message.content == prompt[:5]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 5
        assert r.usage.total_tokens == len(prompt) + 5
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


async def test_stream_shape(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        stream = await client(base).chat.completions.create(
            model="fake-model", messages=MSG, max_tokens=4, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "user"
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


async def test_n_fanout_and_completions(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        c = client(base)
        r = await c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=3, n=3, seed=7)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert r.usage.completion_tokens == 9
        assert sorted(rid[-2:] for rid in engine.added[-3:]) == ["-0", "-1", "-2"]
        r = await c.completions.create(model="fake-model", prompt="xyz", max_tokens=4)
        assert r.choices[0].text == "xyzx" and r.object == "text_completion"
        r = await c.completions.create(model="fake-model", prompt=[65, 66], max_tokens=3)
        assert r.choices[0].text == "ABA"
        r = await c.completions.create(model="fake-model", prompt="ab")  # default max_tokens 16
        assert r.usage.completion_tokens == 16
        stream = await c.completions.create(model="fake-model", prompt="ab", max_tokens=3, stream=True)
        assert "".join([ch.choices[0].text async for ch in stream]) == "aba"


async def test_models_and_health(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        c = client(base)
        models = await c.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
        assert (await c.models.retrieve("fake-model")).id == "fake-model"
        with pytest.raises(openai.NotFoundError) as e:
            await c.models.retrieve("nope")
        assert e.value.body["code"] == "model_not_found"
        async with aiohttp.ClientSession() as s:
            for path in ("/health", "/ready", "/metrics"):
                async with s.get(base + path) as r:
                    assert r.status == 200, path
                    assert r.headers.get("x-request-id")


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"max_tokens": 1000}, "max_tokens"),  # fake context is 256
])
async def test_validation_errors(tmp_path, body, param):
    async with fake_gateway(tmp_path) as (base, app, engine):
        full = {"model": "fake-model", "messages": MSG, **body}
        with pytest.raises(openai.BadRequestError) as e:
            await client(base).chat.completions.create(**full)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "invalid_request_error"
        assert e.value.body["param"] == param, e.value.body


async def test_text_parts_flattened_and_unknown_fields_refused(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        r = await client(base).chat.completions.create(
            model="fake-model", max_tokens=3, extra_body={"top_k": 5},
            messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
        assert r.choices[0].message.content == "sys"
        with pytest.raises(openai.BadRequestError) as e:
            await client(base).chat.completions.create(model="fake-model", max_tokens=3, messages=MSG,
                                                       extra_body={"whatever": 1})
        assert e.value.body["param"] == "whatever" and e.value.body["code"] == "unsupported_parameter"


async def test_raw_http_errors(tmp_path):
    async with fake_gateway(tmp_path, server={"max_body_bytes": 4096}) as (base, app, engine):
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/chat/completions", data=b"{not json",
                              headers={"x-request-id": "my-id-1"}) as r:
                assert r.status == 400 and r.headers["x-request-id"] == "my-id-1"
                body = await r.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}
            async with s.post(base + "/v1/chat/completions", data=b"x" * 10_000) as r:
                assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"
            async with s.get(base + "/v1/nope") as r:
                assert r.status == 404 and "error" in await r.json()
            async with s.get(base + "/v1/chat/completions") as r:
                assert r.status == 405 and "error" in await r.json()
            async with s.post(base + "/v1/chat/completions", json=[1, 2]) as r:
                assert r.status == 400
        with pytest.raises(openai.NotFoundError) as e:
            await client(base).chat.completions.create(model="gpt-4", messages=MSG)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


async def test_engine_rejection_is_400(tmp_path):
    async with fake_gateway(tmp_path, engine=FakeEngine(max_model_len=2_000_000)) as (base, app, engine):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                await client(base).chat.completions.create(model="fake-model", messages=MSG,
                                                           max_tokens=999_999, stream=stream)
            assert e.value.body["code"] == "fake_rejection"


async def test_an_unasked_output_budget_stays_within_the_engines_room(tmp_path):
    """No max_tokens: the budget is what the engine can hold (its KV pool, req_max_output_len), not the rest
    of the context, which it would refuse; a max_tokens above that room is the engine's 400."""
    async with fake_gateway(tmp_path, engine=FakeEngine(output_room=6)) as (base, app, engine):
        r = await client(base).chat.completions.create(model="fake-model", messages=MSG)
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
        r = await client(base).completions.create(model="fake-model", prompt="ab")  # default 16, room 6
        assert r.usage.completion_tokens == 6
        with pytest.raises(openai.BadRequestError) as e:
            await client(base).chat.completions.create(model="fake-model", messages=MSG, max_tokens=7)
        assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "max_tokens")


async def test_context_length_exceeded(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, engine):
        with pytest.raises(openai.BadRequestError) as e:
            await client(base).chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "x" * 300}])
        assert e.value.body["code"] == "context_length_exceeded"


async def test_queue_full_is_503_with_retry_after(tmp_path):
    engine = FakeEngine(max_running_requests=1)
    engine.gate.clear()  # the engine stalls: one request in flight, the rest queue up
    async with fake_gateway(tmp_path, engine=engine, queue={"max_depth": {"pro": 1, "standard": 1}}) as (
            base, app, _):
        c = client(base)
        queue = app[STATE].queue

        async def until(cond) -> None:  # polled, not slept: the machine may be slow
            for _ in range(600):
                value = cond()
                if asyncio.iscoroutine(value):
                    value = await value
                if value:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("condition not reached")

        def ask():
            return asyncio.create_task(c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2))

        tasks = [ask()]
        await until(lambda: len(engine.added) == 1)  # the first is in the (stalled) engine
        tasks.append(ask())
        await until(lambda: queue.depth("standard"))  # the second waits in the queue
        assert await queue.depth("standard") == 1
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/chat/completions",
                              json={"model": "fake-model", "messages": MSG, "max_tokens": 2}) as r:
                assert r.status == 503
                assert int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["code"] == "queue_full"
        with pytest.raises(openai.InternalServerError) as e:
            await c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2, stream=True)
        assert e.value.status_code == 503
        engine.gate.set()
        done = await asyncio.gather(*tasks)
        assert all(d.choices[0].finish_reason == "length" for d in done)


async def test_auth_with_keys(tmp_path):
    keys_file = tmp_path / "keys.json"
    store = KeyStore(keys_file)
    key = store.create("alice", "pro")
    async with fake_gateway(tmp_path, auth={"keys_file": str(keys_file)}) as (base, app, engine):
        with pytest.raises(openai.AuthenticationError) as e:
            await client(base, "sk-wrong").chat.completions.create(model="fake-model", messages=MSG, max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/chat/completions", json={"model": "fake-model", "messages": MSG}) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
            async with s.get(base + "/health") as r:
                assert r.status == 200
        r = await client(base, key).chat.completions.create(model="fake-model", messages=MSG, max_tokens=1)
        assert r.choices[0].message.content == "u"
        # A key created while the server runs works at once (mtime reload); revoking locks it out.
        key2 = KeyStore(keys_file).create("bob", "standard")
        await client(base, key2).chat.completions.create(model="fake-model", messages=MSG, max_tokens=1)
        KeyStore(keys_file).revoke("bob")
        with pytest.raises(openai.AuthenticationError):
            await client(base, key2).chat.completions.create(model="fake-model", messages=MSG, max_tokens=1)


async def test_disconnect_mid_stream_aborts(tmp_path):
    engine = FakeEngine(step_s=0.01)
    async with fake_gateway(tmp_path, engine=engine) as (base, app, _):
        async with aiohttp.ClientSession() as s:
            resp = await s.post(base + "/v1/chat/completions", json={
                "model": "fake-model", "messages": MSG, "max_tokens": 200, "stream": True})
            assert resp.status == 200
            await resp.content.readline()
            resp.close()  # drop the connection mid-stream
        worker = app[STATE].local_worker
        for _ in range(200):
            if worker.stats().in_flight == 0 and not engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert worker.stats().in_flight == 0 and engine.aborted
        r = await client(base).chat.completions.create(model="fake-model", messages=MSG, max_tokens=2)
        assert r.choices[0].finish_reason == "length"


async def test_disconnect_non_stream_aborts(tmp_path):
    engine = FakeEngine(step_s=0.01, max_model_len=5000)
    async with fake_gateway(tmp_path, engine=engine) as (base, app, _):
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(base + "/v1/chat/completions", timeout=aiohttp.ClientTimeout(total=0.3), json={
                    "model": "fake-model", "messages": MSG, "max_tokens": 1000})
        for _ in range(200):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert engine.aborted and not engine.has_unfinished()
