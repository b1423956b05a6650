"""Keys fail closed: once a gateway runs with API keys it never serves anonymously again until it is
restarted, whatever happens to the keys file; problems are answered 503 and logged (rate-limited)."""

from __future__ import annotations

import json
import logging
import os

import aiohttp
import pytest

from gateway.admission.keys import KeyStore
from gateway.cli import main
from tests.fixtures.served_gateway import served_gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _post(base: str, key: str | None = None, path: str = "/v1/chat/completions"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + path, json=CHAT, headers=headers) as r:
            return r.status, await r.json()


def _break(kind: str, path) -> None:
    if kind == "deleted":
        os.unlink(path)
    elif kind == "emptied":
        open(path, "w").close()
    elif kind == "no keys":
        with open(path, "w") as f:
            json.dump({"keys": []}, f)
    elif kind == "corrupt":
        with open(path, "w") as f:
            f.write('{"keys": [{"name": "a", "tier"')


BREAKS = ["deleted", "emptied", "no keys", "corrupt"]


@pytest.mark.parametrize("kind", BREAKS)
async def test_public_bind_with_keys_never_opens_when_the_keys_file_breaks(tmp_path, kind, caplog):
    kf = tmp_path / "keys.json"
    key = KeyStore(kf).create("team-a", "pro")
    async with served_gateway(tmp_path, host="0.0.0.0") as gw:
        assert (await _post(gw.base, key))[0] == 200
        assert (await _post(gw.base))[0] == 401
        _break(kind, kf)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            for _ in range(20):
                st, body = await _post(gw.base)
                assert st == 503, (st, body)  # before: 200 (deleted, emptied, no keys) or 400 (corrupt)
                assert body["error"]["code"] == "keys_unavailable"
                st, body = await _post(gw.base, key)
                assert st == 503 and body["error"]["code"] == "keys_unavailable"
            st, _ = await _post(gw.base, path="/v1/completions")
            assert st == 503
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors, "the broken keys file must be logged"
        assert len(errors) <= 4, [r.getMessage() for r in errors]  # rate-limited, not once per request
        assert key not in caplog.text
        # Fixing the file restores service (still in key mode).
        if kind == "corrupt":
            kf.unlink()
        key2 = KeyStore(kf).create("team-b", "standard")
        assert (await _post(gw.base, key2))[0] == 200
        assert (await _post(gw.base))[0] == 401


@pytest.mark.parametrize("kind", BREAKS)
async def test_loopback_keys_created_at_run_time_stay_required(tmp_path, kind):
    kf = tmp_path / "keys.json"
    async with served_gateway(tmp_path) as gw:
        assert (await _post(gw.base))[0] == 200  # no keys: anonymous on loopback
        key = KeyStore(kf).create("late", "pro")
        assert (await _post(gw.base))[0] == 401
        assert (await _post(gw.base, key))[0] == 200
        _break(kind, kf)
        st, body = await _post(gw.base)
        assert st == 503 and body["error"]["code"] == "keys_unavailable", (st, body)


async def test_corrupt_keys_file_at_run_time_without_keys_locks_too(tmp_path):
    """A corrupt file means someone wrote keys: fail closed even if none were seen before."""
    kf = tmp_path / "keys.json"
    async with served_gateway(tmp_path) as gw:
        assert (await _post(gw.base))[0] == 200
        _break("corrupt", kf)
        st, body = await _post(gw.base)
        assert st == 503 and body["error"]["code"] == "keys_unavailable"


def test_serve_refuses_to_start_on_a_corrupt_keys_file(tmp_path, capsys, monkeypatch):
    kf = tmp_path / "keys.json"
    kf.write_text('{"keys": [')
    monkeypatch.setenv("SLUICE_AUTH__KEYS_FILE", str(kf))
    monkeypatch.delenv("SLUICE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    for host in ("127.0.0.1", "0.0.0.0"):
        rc = main(["serve", "--host", host, "--port", "0"])
        err = capsys.readouterr().err
        assert rc == 2 and "corrupt" in err and "refusing to start" in err, err
