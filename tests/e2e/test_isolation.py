"""One request cannot stall the others: while a long prompt prefills or a bad grammar is refused, the
streams already running keep their token rate (measured as a ratio against their own rate just before,
on the real model through a running gateway, before and after), and bad grammars are 400s within seconds."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.serial]

MODEL = "SmolLM2-135M-Instruct"
STREAMS = 3


class Streams:
    """Greedy background streams; `rate` and `max_gap` over a window of their token arrival times."""

    def __init__(self, base: str, key: str):
        self.base, self.key = base, key
        self.stamps: list[list[float]] = [[] for _ in range(STREAMS)]
        self.errors: list[bytes] = []

    async def _one(self, s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count from 1 to 900, list {i}."}],
                "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}
        async with s.post(self.base + "/v1/chat/completions", json=body) as r:
            async for raw in r.content:
                if raw.startswith(b"data:"):
                    if b'"error"' in raw:
                        self.errors.append(raw[:300])
                    self.stamps[i].append(time.perf_counter())

    def rate(self, t0: float, t1: float) -> float:
        return sum(sum(t0 <= x <= t1 for x in st) for st in self.stamps) / (t1 - t0) / STREAMS

    def max_gap(self, t0: float, t1: float) -> float:
        gap = 0.0
        for st in self.stamps:
            pts = [x for x in st if x < t0][-1:] + [x for x in st if t0 <= x <= t1] + [t1]
            gap = max(gap, max(b - a for a, b in zip(pts, pts[1:])))
        return gap


async def _with_streams(gw, request) -> tuple[float, float, float, object]:
    """Runs `request(session)` while the background streams run: (base rate: the mean of the two seconds
    before and after, rate during, max gap during, the request's result)."""
    streams = Streams(gw.base, gw.key)
    headers = {"Authorization": f"Bearer {gw.key}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=300)) as s:
        tasks = [asyncio.create_task(streams._one(s, i)) for i in range(STREAMS)]
        await asyncio.sleep(2.0)  # steady state
        b0 = time.perf_counter()
        await asyncio.sleep(2.0)
        t0 = time.perf_counter()
        result = await request(s)
        await asyncio.sleep(max(0.0, t0 + 2.0 - time.perf_counter()))  # a window of two seconds at least
        t1 = time.perf_counter()
        await asyncio.sleep(2.0)  # and after: a decode slows as its context grows, over a long window too
        t2 = time.perf_counter()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert not streams.errors, streams.errors[:1]
    base = (streams.rate(b0, t0) + streams.rate(t1, t2)) / 2
    return base, streams.rate(t0, t1), streams.max_gap(t0, t1), result


def test_a_long_prompt_leaves_running_streams_their_rate(real_gateway):
    """A prompt at the gateway's context limit prefills in chunks whose cost is bounded and shared fairly
    with the running streams (one more stream's worth of each step), instead of 256-token steps deep in
    the context that hold every stream for the whole chunk."""
    prompt = [random.Random(5).randrange(1000, 40000) for _ in range(2000)]

    async def long_prompt(s):
        async with s.post(real_gateway.base + "/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    base, during, gap, answer = asyncio.run(_with_streams(real_gateway, long_prompt))
    assert answer["usage"]["prompt_tokens"] == 2000
    assert during >= 0.5 * base, (base, during)
    assert gap < 1.0, gap


BAD_SCHEMAS = {
    "self_ref": {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
    "ref_loop": {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                           "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
                 "$ref": "#/$defs/a"},
    "8000_properties": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 5, "description": "d" * 30} for i in range(8000)}},
}


def test_bad_schemas_are_quick_400s_and_stall_nobody(real_gateway):
    """Every schema of BAD_SCHEMAS, one after another in one window of the background streams (a window
    costs 8 s; one per schema made this part of make test 16 s longer for the same checks)."""
    def body(name: str) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 16,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMAS[name]}}}

    async def bad(s):
        out = {}
        for name in BAD_SCHEMAS:
            t = time.perf_counter()
            async with s.post(real_gateway.base + "/v1/chat/completions", data=json.dumps(body(name)),
                              headers={"Content-Type": "application/json"}) as r:
                out[name] = (r.status, await r.json(), time.perf_counter() - t)
        return out

    base, during, gap, results = asyncio.run(_with_streams(real_gateway, bad))
    for name, (status, answer, secs) in results.items():
        assert status == 400 and answer["error"]["code"] == "invalid_grammar", (name, answer)
        assert answer["error"]["param"] == "response_format", name
        assert "<state>" not in answer["error"]["message"] and len(answer["error"]["message"]) < 500, name
        assert secs < 4.0, (name, secs)  # the goal is 2 s; a shared CI box gets some slack
    assert gap < 1.0, gap
    assert during >= 0.5 * base, (base, during)
