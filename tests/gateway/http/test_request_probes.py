"""Issue 9 items 3, 4, 7, 8 and 9: the probes that broke the gateway, as regression tests.

Each test drives a real server over HTTP: the session's `sluice serve` with the real model where the
engine matters, a gateway on the fake engine (fast, deterministic) where only the HTTP layer and the
queues do.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import uuid

import aiohttp
import openai
import pytest

from gateway.queue.redis import RedisQueue
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway

MSG = [{"role": "user", "content": "hi"}]


def _client(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


# ---------------------------------------------------------------- item 3: one request cannot break the step


@pytest.mark.model
def test_top_k_overflow_next_to_a_running_stream_leaves_it_intact(real_gateway):
    gw = real_gateway
    c = openai.OpenAI(base_url=gw.base + "/v1", api_key=gw.key, max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": "Count from one to twenty in words."}],
               max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    alone = c.chat.completions.create(**ask).choices[0].message.content

    first_chunk = threading.Event()
    streamed: list[str] = []
    finish: list[str | None] = []

    def stream() -> None:
        for chunk in c.chat.completions.create(**ask, stream=True):
            if chunk.choices:
                streamed.append(chunk.choices[0].delta.content or "")
                finish.append(chunk.choices[0].finish_reason)
                first_chunk.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(60)
    for top_k in (2**63, 9223372036854775808, -2):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=1.0,
                                      extra_body={"top_k": top_k})
        assert e.value.body["param"] == "top_k"
    # The largest accepted top_k (above the vocabulary: no cut) samples normally, next to the stream.
    r = c.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=1.0,
                                  extra_body={"top_k": 2**31 - 1})
    assert r.choices[0].finish_reason in ("length", "stop")
    t.join(120)
    assert "".join(streamed) == alone and finish[-1] == "length"


# ---------------------------------------------------------------- item 4: one request cannot freeze the loop


async def _health_latencies_during(base: str, send) -> tuple[list[float], object]:
    """Probe /health every 10 ms while `send()` runs; returns the probe latencies and send()'s result."""
    latencies: list[float] = []
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(send(s))
        while not task.done():
            t0 = time.perf_counter()
            async with s.get(base + "/health") as r:
                assert r.status == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        return latencies, task.result()


def _p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)]


@pytest.mark.model
@pytest.mark.slow
async def test_huge_requests_leave_health_fast(real_gateway):
    gw = real_gateway
    headers = {"Authorization": f"Bearer {gw.key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.base + "/v1/models", headers=headers) as r:
            model = (await r.json())["data"][0]["id"]

    def poster(body: dict):
        data = json.dumps(body).encode()

        async def send(s: aiohttp.ClientSession):
            t0 = time.perf_counter()
            async with s.post(gw.base + "/v1/chat/completions", data=data, headers=headers) as r:
                return r.status, await r.json(), time.perf_counter() - t0
        return send

    # 100,000 one-character messages (3.4 MB): refused with a 400 that says why, without a stall.
    many = {"model": model, "messages": [{"role": "user", "content": "a"}] * 100_000, "max_tokens": 1}
    lat, (status, body, _) = await _health_latencies_during(gw.base, poster(many))
    assert status == 400 and body["error"]["code"] == "too_many_messages", body
    assert _p99(lat) < 0.05, f"/health p99 {_p99(lat) * 1000:.1f} ms while parsing 100k messages"

    # 1,200 messages of ~720 characters (0.87 MB, under every bound): templated and tokenized off the loop,
    # cut to the context (prompt_truncation), and answered.
    words = " ".join(f"word{i}" for i in range(100))
    long = {"model": model, "max_tokens": 1, "prompt_truncation": "middle",
            "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} {words}"} for _ in range(1200)]}
    lat, (status, body, took) = await _health_latencies_during(gw.base, poster(long))
    assert status == 200, body
    assert len(lat) >= 10, f"the request took {took:.2f}s: too short to tell"
    assert _p99(lat) < 0.05, f"/health p99 {_p99(lat) * 1000:.1f} ms (median {statistics.median(lat) * 1000:.1f})"


async def test_size_bounds_are_400s_naming_the_field(tmp_path):
    async with fake_gateway(tmp_path, server={"max_messages": 10, "max_prompt_chars": 1000}) as (base, app, _):
        c = _client(base)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="fake-model", messages=MSG * 11)
        assert e.value.body["param"] == "messages" and e.value.body["code"] == "too_many_messages"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x" * 1001}])
        assert e.value.body["code"] == "prompt_too_long"
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="fake-model", prompt="x" * 1001)
        assert e.value.body["param"] == "prompt" and e.value.body["code"] == "prompt_too_long"
        r = await c.chat.completions.create(model="fake-model", messages=MSG * 10, max_tokens=2)
        assert r.choices[0].finish_reason == "length"


def test_chat_templating_is_linear_in_the_conversation():
    """The old loop re-sliced the rest of the rendered text per message: quadratic in its length."""
    from engine import EngineConfig, load_frontend

    tok = load_frontend(EngineConfig()).tokenizer

    def seconds(n: int) -> float:
        msgs = [{"role": "user", "content": "a"}] * n
        t0 = time.perf_counter()
        tok.apply_chat_template(msgs)
        return time.perf_counter() - t0

    seconds(500)
    small, large = min(seconds(4000) for _ in range(2)), min(seconds(32000) for _ in range(2))
    # Linear: ~8x. The old re-slicing loop: ~30x here (and 23 s for 100,000 messages).
    assert large / small < 14, f"8x the messages took {large / small:.1f}x the time"


# ---------------------------------------------------------------- item 7: deadlines on both queues


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


# ---------------------------------------------------------------- item 8: the smaller ones


async def test_seed_nesting_and_n_bounds(tmp_path):
    async with fake_gateway(tmp_path, queue={"max_depth": {"pro": 8, "standard": 2}}) as (base, app, _):
        c = _client(base)
        for seed, n in ((2**70, 1), (2**64 - 1, 2), (2**63, 1), (-(2**63) - 1, 1)):
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="fake-model", messages=MSG, seed=seed, n=n, max_tokens=2)
            assert e.value.body["param"] == "seed"
        r = await c.chat.completions.create(model="fake-model", messages=MSG, seed=2**63 - 1, n=2, max_tokens=2)
        assert len(r.choices) == 2
        with pytest.raises(openai.BadRequestError) as e:  # more choices than the tier can ever queue
            await c.chat.completions.create(model="fake-model", messages=MSG, n=3, max_tokens=2)
        assert e.value.body["param"] == "n"
        async with aiohttp.ClientSession() as s:
            deep = b'{"model": "fake-model", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
            async with s.post(base + "/v1/chat/completions", data=deep) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------- item 9: nothing accepted is ignored


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("prediction", {"type": "content", "content": "x"}),
    ("logit_bias", {"not-a-token": 5}),
    ("top_logprobs", 3),  # without logprobs: true
    ("tool_choice", "required"),  # without tools
    ("audio", {"voice": "alloy", "format": "mp3"}),
    ("store", True),
    ("service_tier", "flex"),
    ("not_an_openai_field", 1),
])
async def test_unimplemented_fields_are_refused_by_name(tmp_path, field, value):
    async with fake_gateway(tmp_path) as (base, app, engine):
        with pytest.raises(openai.BadRequestError) as e:
            await _client(base).chat.completions.create(model="fake-model", messages=MSG, max_tokens=2,
                                                        extra_body={field: value})
        assert e.value.body["param"] == field and field in e.value.body["message"]
        assert not engine.added


async def test_harmless_values_of_unimplemented_fields_pass(tmp_path):
    async with fake_gateway(tmp_path) as (base, app, _):
        r = await _client(base).chat.completions.create(
            model="fake-model", messages=MSG, max_tokens=2, presence_penalty=0, frequency_penalty=0,
            response_format={"type": "text"}, store=False, service_tier="auto", tool_choice="none", user="u-1")
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            await _client(base).completions.create(model="fake-model", prompt="x", echo=True)
        assert "echo" in e.value.body["message"]


@pytest.mark.parametrize("bias,bad", [
    ({"٢٨": 5}, "٢٨"), ({"２８": 5}, "２８"), ({"0028": 5}, "0028"), ({"²": 5}, "²"), ({"+28": 5}, "+28"),
    ({" 28": 5}, " 28"), ({"28\n": 5}, "28\n"), ({"28": 100, "028": -100}, "028"), ({"2147483648": 1}, "2147483648"),
])
async def test_logit_bias_keys_are_canonical_ascii_token_ids(tmp_path, bias, bad):
    async with fake_gateway(tmp_path) as (base, app, engine):
        for create in (lambda c: c.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2,
                                                           logit_bias=bias),
                       lambda c: c.completions.create(model="fake-model", prompt="x", max_tokens=2, logit_bias=bias)):
            with pytest.raises(openai.BadRequestError) as e:
                await create(_client(base))
            err = e.value.body
            assert err["param"] == "logit_bias" and repr(bad) in err["message"], err
            assert "invalid literal" not in err["message"]
        assert not engine.added


def test_canonical_logit_bias_keys_map_to_their_ids():
    from gateway.http.offload import RequestLimits, parse_request
    from gateway.openai.schema import CompletionRequest

    body = {"model": "m", "prompt": "x", "logit_bias": {"0": -1, "28": 5, "2147483647": 1}}
    req = parse_request(json.dumps(body).encode(), CompletionRequest, RequestLimits())
    assert req.logit_bias_ids() == {0: -1.0, 28: 5.0, 2147483647: 1.0}
