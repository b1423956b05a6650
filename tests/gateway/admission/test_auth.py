"""Revoking a key (gateway/admission/auth.py) on a gateway served like `sluice serve`: its running streams
end with a `key_revoked` error event, its running JSON requests get 401 `key_revoked`, other keys' streams
go on, and the key gets 401 from then on."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from gateway.admission.keys import KeyStore
from gateway.state import STATE
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.served_gateway import served_gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_revoking_a_key_stops_its_running_stream(tmp_path):
    kf = tmp_path / "keys.json"
    key = KeyStore(kf).create("leaver", "pro")
    other = KeyStore(kf).create("stayer", "pro")
    engine = FakeEngine(step_s=0.05)
    async with served_gateway(tmp_path, engine=engine) as gw:
        body = {**CHAT, "max_tokens": 200, "stream": True}

        async def stream(k: str) -> list[str]:
            events = []
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.base + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {k}"}) as r:
                    assert r.status == 200
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            events.append(line[6:])
            return events

        leaver = asyncio.create_task(stream(key))
        stayer = asyncio.create_task(stream(other))
        await asyncio.sleep(1.0)  # both well under way (200 tokens take 10 s)
        t0 = time.monotonic()
        KeyStore(kf).revoke("leaver")  # what `sluice keys revoke leaver` does
        events = await asyncio.wait_for(leaver, 5)
        assert time.monotonic() - t0 < 2.0
        assert events[-1] != "[DONE]"
        err = json.loads(events[-1])
        assert err["error"]["code"] == "key_revoked"
        # The engine stopped generating for it; the other key's stream goes on to its end.
        await asyncio.sleep(0.3)
        assert any(rid.startswith("chatcmpl") for rid in engine.aborted) or len(engine.running) == 1
        assert not stayer.done()
        events = await asyncio.wait_for(stayer, 20)
        assert events[-1] == "[DONE]"
        # And the revoked key gets 401 from now on.
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.base + "/v1/chat/completions", json=CHAT,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 401
        # A non-streamed request of a revoked key is stopped too (401 key_revoked).
        k3 = KeyStore(kf).create("third", "pro")

        async def plain() -> tuple[int, dict]:
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.base + "/v1/chat/completions", json={**CHAT, "max_tokens": 200},
                                  headers={"Authorization": f"Bearer {k3}"}) as r:
                    return r.status, await r.json()

        t = asyncio.create_task(plain())
        await asyncio.sleep(0.8)
        KeyStore(kf).revoke("third")
        st, body3 = await asyncio.wait_for(t, 5)
        assert st == 401 and body3["error"]["code"] == "key_revoked"
        assert gw.app[STATE].keys.key_mode
