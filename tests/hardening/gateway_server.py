"""A gateway on a fake engine served the way `sluice serve` serves it (gateway.http.server: connection
guard, timeouts), on a real port, for the hardening tests of auth, connections and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.admission.auth import check_bind_allowed
from gateway.admission.keys import KeyStore
from gateway.http.app import create_app
from gateway.http.server import ConnectionGuard, serve
from gateway.settings import Settings
from gateway.state import STATE
from tests.gateway.fake_engine import FakeEngine


@dataclass
class Served:
    base: str
    port: int
    app: Any
    engine: FakeEngine
    keys: KeyStore
    guard: ConnectionGuard


@contextlib.asynccontextmanager
async def served_gateway(tmp_path: Path, *, host: str = "127.0.0.1", engine: FakeEngine | None = None,
                         server: dict | None = None, **settings_kw: Any):
    """Like `sluice serve` (keys file checked at start, bind check, guarded runner), on a fake engine."""
    settings_kw.setdefault("auth", {"keys_file": str(tmp_path / "keys.json")})
    settings = Settings(server={"shutdown_grace_s": 1.0, **(server or {})}, **settings_kw)
    keys = KeyStore(settings.auth.keys_file, strict=True)
    check_bind_allowed(host, keys)
    engine = engine or FakeEngine()
    app = create_app(settings, engine=engine, keys=keys)
    runner, site = await serve(app, settings, host=host, port=0)
    state = app[STATE]
    for _ in range(500):
        if state.ready:
            break
        await asyncio.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{site.port}", site.port, app, engine, keys, runner.guard)
    finally:
        engine.gate.set()
        await runner.cleanup()
