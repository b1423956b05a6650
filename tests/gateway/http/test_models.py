"""Several chat models in one gateway: each id (and alias) reaches its own pool's engine, through its own
queue; /v1/models lists them all; an unknown one is a 404 naming the served ones."""

from __future__ import annotations

import aiohttp

from gateway.state import STATE
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway


async def test_two_chat_models_each_served_by_their_own_engine(tmp_path):
    other = FakeEngine()
    models = [{"id": "small"}, {"id": "big", "aliases": ["gpt-4o-mini"]}]
    async with fake_gateway(tmp_path, models=models, engines={"big": other}) as (base, app, first):
        async with aiohttp.ClientSession() as s:
            async def ask(model: str) -> tuple[int, dict]:
                async with s.post(base + "/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                    return r.status, await r.json()
            for model in ("small", "big", "gpt-4o-mini", "big"):
                status, body = await ask(model)
                assert status == 200 and body["model"] == ("big" if model == "gpt-4o-mini" else model), body
            status, body = await ask("nope")
            assert status == 404 and "small" in body["error"]["message"] and "gpt-4o-mini" in body["error"]["message"]
            async with s.get(base + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["small", "big", "gpt-4o-mini"]
        state = app[STATE]
        assert state.pool_for("small").queue is not state.pool_for("big").queue
    assert len(first.added) == 1 and len(other.added) == 3
