"""Routing by capability: what the local text model cannot serve goes to a provider that serves the
model, counted and labelled; the request reaches the provider as the client sent it."""

from __future__ import annotations

from gateway.state import STATE
from tests.fixtures.providers import LOCAL_MODEL, gateway, post, provider_cfg

IMAGE = [{"type": "text", "text": "What is in this picture?"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]


async def test_an_image_part_goes_to_a_provider_that_serves_the_model(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, app, engine, _keys):
        st, h, body = await post(base, {"model": LOCAL_MODEL, "messages": [{"role": "user", "content": IMAGE}],
                                        "max_tokens": 4})
        assert st == 200 and h["x-sluice-backend"] == "remote:a", body
        assert not engine.added  # never reached the local engine
        sent = a.requests[-1]
        assert sent["messages"][0]["content"][1]["type"] == "image_url"  # relayed as sent
        counted = app[STATE].metrics.decisions.labels("standard", "remote", "capability")._value.get()
        assert counted == 1
        st, h, _ = await post(base, {"model": LOCAL_MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4, "repetition_penalty": 1.1, "min_tokens": 1})
        assert st == 200 and h["x-sluice-backend"] == "local"  # text stays local


async def test_without_such_a_provider_it_is_a_400_naming_the_part(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a, models={"remote-model": "up-a"})]) as (base, *_):
        st, _, body = await post(base, {"model": LOCAL_MODEL, "messages": [{"role": "user", "content": IMAGE}]})
        assert st == 400 and body["error"]["param"] == "messages.0.content"
        assert body["error"]["code"] == "unsupported_content"
