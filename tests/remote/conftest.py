"""Fixtures for remote routing: fault-injecting providers on loopback and a gateway in front of them."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.admission.keys import KeyStore
from tests.gateway.conftest import RedisServer, fake_gateway, free_port  # noqa: F401
from tests.gateway.fake_engine import FakeEngine
from tests.remote.mock_provider import MockProvider

REMOTE_MODEL = "remote-model"  # served only by providers
LOCAL_MODEL = "fake-model"  # the fake engine's model; providers may serve it too (overflow)


def provider_cfg(m: MockProvider, *, order: int = 0, models: dict[str, str] | None = None, **kw: Any) -> dict:
    return {"name": m.name, "base_url": m.base_url, "api_key_env": f"SLUICE_TEST_{m.name.upper()}_KEY",
            "models": models or {REMOTE_MODEL: f"up-{m.name}", LOCAL_MODEL: f"up-{m.name}"},
            "input_price_per_m": 1.0, "output_price_per_m": 2.0, "timeout_s": 2.0, "order": order, **kw}


@pytest.fixture
async def providers():
    os.environ["SLUICE_TEST_A_KEY"] = "sk-upstream-a"
    os.environ["SLUICE_TEST_B_KEY"] = "sk-upstream-b"
    a = await MockProvider("a", tokens=8).start()
    b = await MockProvider("b", tokens=8).start()
    yield a, b
    await a.stop()
    await b.stop()


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, provs: list[dict], *, engine: FakeEngine | None = None,
                  keys: dict[str, str] | None = None, routing: dict | None = None, **kw: Any):
    """A gateway (fake engine) with providers. `keys`: {name: tier} created first. Yields
    (base, app, engine, {name: key})."""
    store = KeyStore(tmp_path / "keys.json")
    made = {name: store.create(name, tier) for name, tier in (keys or {}).items()}
    r = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "breaker_cooldown_s": 30.0, **(routing or {})}
    async with fake_gateway(tmp_path, engine=engine, providers=provs, routing=r, **kw) as (base, app, eng):
        yield base, app, eng, made


def chat(model: str = REMOTE_MODEL, content: str = "hello there", **kw: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


async def post(base: str, body: dict, key: str | None = None, path: str = "/v1/chat/completions"):
    """(status, headers, json body or list of SSE events)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + path, json=body, headers=headers) as r:
            if body.get("stream") and r.status == 200:
                events = []
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                return r.status, r.headers, events
            return r.status, r.headers, await r.json()


def stream_text(events: list) -> str:
    out = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(out)
