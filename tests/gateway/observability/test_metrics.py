"""/metrics (gateway/observability/metrics.py) on a gateway served like `sluice serve`: a stream closed
right after [DONE] counts as the 200 it was; /metrics needs an admin key once keys exist and never shows
key names unless configured to."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gateway.admission.keys import KeyStore
from gateway.state import STATE
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.served_gateway import served_gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _get(base: str, path: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(base + path, headers=headers) as r:
            return r.status, await r.text()


async def _stream_then_close_at_done(port: int, key: str | None) -> bytes:
    """A raw HTTP client that closes its socket the moment it has read `[DONE]` (as SDKs do)."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth +
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"[DONE]" not in got:
        chunk = await asyncio.wait_for(reader.read(4096), 10)
        assert chunk, got
        got += chunk
    writer.transport.abort()  # gone at once, before the server finished its own bookkeeping
    return got


async def test_stream_closed_right_after_done_counts_as_200(tmp_path):
    async with served_gateway(tmp_path, engine=FakeEngine()) as gw:
        # Usage accounting after [DONE] takes a moment (Redis round trips in production): the window
        # in which a client that already read [DONE] hangs up.
        usage = gw.app[STATE].usage
        record = usage.record

        async def slow_record(*args, **kwargs):
            await asyncio.sleep(0.1)
            return await record(*args, **kwargs)

        usage.record = slow_record
        for _ in range(10):
            got = await _stream_then_close_at_done(gw.port, None)
            assert got.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.5)
        status, text = await _get(gw.base, "/metrics")
        assert status == 200
        lines = [ln for ln in text.splitlines() if ln.startswith("sluice_requests_total{")]
        assert any('status="200"' in ln and ln.endswith(" 10.0") for ln in lines), lines
        assert not any('status="499"' in ln for ln in lines), lines


async def test_metrics_need_an_admin_key_once_keys_exist(tmp_path):
    kf = tmp_path / "keys.json"
    async with served_gateway(tmp_path) as gw:
        assert (await _get(gw.base, "/metrics"))[0] == 200  # no keys, loopback: public
        user = KeyStore(kf).create("team-a", "pro")
        admin = KeyStore(kf).create("ops", "standard", admin=True)
        for path in ("/health", "/ready"):
            assert (await _get(gw.base, path))[0] == 200, path  # stay public
        st, text = await _get(gw.base, "/metrics")
        assert st == 401 and "invalid_api_key" in text
        st, text = await _get(gw.base, "/metrics", user)
        assert st == 403 and "admin_key_required" in text
        st, text = await _get(gw.base, "/metrics", admin)
        assert st == 200 and "sluice_requests_total" in text
        st, text = await _get(gw.base, "/v1/../metrics", user)  # no other spelling gets around it
        assert st in (403, 404), st


@pytest.mark.parametrize("mode", ["id", "name"])
async def test_metric_key_labels_hide_key_names_unless_configured(tmp_path, mode):
    kf = tmp_path / "keys.json"
    name = "acme-secret-project"
    key = KeyStore(kf).create(name, "pro")
    admin = KeyStore(kf).create("ops", "standard", admin=True)
    async with served_gateway(tmp_path, metrics={"key_labels": mode}) as gw:
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.base + "/v1/chat/completions", json=CHAT,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200
        await asyncio.sleep(0.2)
        st, text = await _get(gw.base, "/metrics", admin)
        assert st == 200
        usage = [ln for ln in text.splitlines() if ln.startswith("sluice_usage_requests_total{")]
        short_id = next(r.short_id for r in gw.keys.records if r.name == name)
        if mode == "id":
            assert name not in text
            assert any(f'key="{short_id}"' in ln for ln in usage), usage
        else:
            assert any(f'key="{name}"' in ln for ln in usage), usage
