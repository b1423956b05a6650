"""The Responses stores (gateway/store/responses.py), SQLite and Redis (a real redis-server): per-key rows,
survival across a restart (a new store on the same file or server), the TTL and the size cap evicting
oldest first, a rewrite keeping the chain link, and the SQLite file's 0600 mode."""

from __future__ import annotations

import os
import stat
import time

import pytest

from gateway.store.responses import RedisResponseStore, ResponseStore


def _resp(rid: str, created: float | None = None, pad: int = 0) -> dict:
    return {"id": rid, "object": "response", "created_at": created or time.time(), "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "x" * pad}]}]}


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path):
    """A factory of stores on one backing database (each call: a fresh store object on it)."""
    if request.param == "sqlite":
        path = str(tmp_path / "r.sqlite3")
        return lambda **kw: ResponseStore(path, **kw)
    server = request.getfixturevalue("redis_server")
    prefix = f"t{os.urandom(4).hex()}"
    return lambda **kw: RedisResponseStore(server.url, prefix=prefix, **kw)


async def test_rows_belong_to_their_key_and_survive_a_restart(make_store, tmp_path):
    s = make_store()
    await s.put("alice", _resp("resp_a"), [{"type": "message", "role": "user", "content": "hi"}])
    await s.put("alice", _resp("resp_b"), [], previous_id="resp_a")
    assert await s.get("bob", "resp_a") is None and not await s.delete("bob", "resp_a")
    assert await s.get(None, "resp_a") is None  # anonymous is an owner of its own
    await s.close()
    if isinstance(s, ResponseStore):
        assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    s = make_store()
    a, b = await s.get("alice", "resp_a"), await s.get("alice", "resp_b")
    assert a is not None and a.input_items[0]["content"] == "hi" and a.previous_id is None
    assert b is not None and b.previous_id == "resp_a"
    await s.put("alice", dict(b.response, status="cancelled"))  # a rewrite keeps the input items
    again = await s.get("alice", "resp_b")
    assert again is not None and again.response["status"] == "cancelled" and again.previous_id == "resp_a"
    assert await s.delete("alice", "resp_a") and await s.get("alice", "resp_a") is None
    await s.close()


async def test_expired_rows_are_gone_and_the_size_cap_drops_the_oldest(make_store):
    s = make_store(ttl_s=3600, max_bytes=200_000)
    await s.put("k", _resp("resp_old", created=time.time() - 7200), [])
    if isinstance(s, ResponseStore):  # (Redis: the hash expires ttl_s after its write)
        assert await s.get("k", "resp_old") is None  # past its TTL: not served even before the sweep
    for i in range(300):  # the cap is checked every 100 writes: at the 300th
        await s.put("k", _resp(f"resp_{i:03d}", created=time.time() + i, pad=1000), [])
    rows, size = await s.stats()
    assert size <= 200_000 and 20 <= rows < 300
    assert await s.get("k", "resp_299") is not None and await s.get("k", "resp_000") is None
    await s.close()
