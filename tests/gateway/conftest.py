"""Gateway fixtures: an in-process app on a fake engine (fast). The real gateway and redis-server
session fixtures live in tests/servers.py (registered by tests/conftest.py)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib
from pathlib import Path

from aiohttp.test_utils import TestServer

from gateway.admission.keys import KeyStore
from gateway.http.app import create_app
from gateway.settings import Settings
from gateway.state import STATE
from tests.gateway.fake_engine import FakeEngine
from tests.servers import ROOT, RealGateway, RedisServer, _have_redis_server, free_port  # noqa: F401


@contextlib.asynccontextmanager
async def fake_gateway(tmp_path: Path, engine: FakeEngine | None = None, **settings_kw):
    """A gateway on a fake engine, served on a real local port. Yields (base_url, app, engine)."""
    settings_kw.setdefault("auth", {"keys_file": str(tmp_path / "keys.json")})
    settings = Settings(**settings_kw)
    engine = engine or FakeEngine()
    app = create_app(settings, engine=engine, keys=KeyStore(settings.auth.keys_file))
    server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    state = app[STATE]
    for _ in range(200):
        if state.ready:
            break
        import asyncio
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.port}", app, engine
    finally:
        engine.gate.set()
        await server.close()


