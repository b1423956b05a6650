"""Malformed requests cannot flood the log (gateway/http/server.py), end to end: a real `sluice serve` with
API keys gets 2,000 requests with a NUL byte in a header on raw sockets (no key needed to send them). Each
is answered 400; the log gains at most a few rate-limited lines (aiohttp's own handler logs an ERROR and an
11-line traceback for each)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.fixtures.processes import CHAT, Gateway, create_key, start_mock, stop_all, write_config
from tests.fixtures.servers import free_port

pytestmark = pytest.mark.slow

BAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX: \x00\r\n\r\n"


def _send_bad(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(BAD)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        return got


def _wait_loaded(gw: Gateway, timeout: float = 60.0) -> None:
    """Until the default embedding model has loaded (chat is remote-only here, so /ready stays 503)."""
    deadline = time.monotonic() + timeout
    while "engine ready: embedding" not in gw.text():
        assert time.monotonic() < deadline, "the embedding model never loaded"
        time.sleep(0.1)


def test_2000_malformed_requests_add_at_most_a_few_log_lines(tmp_path):
    mock, mport = start_mock(tmp_path)
    procs = [mock]
    port = free_port()
    cfg = write_config(tmp_path / "sluice.toml", port=port, mock_port=mport, tmp_path=tmp_path)
    key = create_key(cfg, "team-a")
    try:
        gw = Gateway(cfg, tmp_path / "gw.log", port)
        procs.append(gw.proc)
        assert gw.call("/v1/chat/completions", key, CHAT)[0] == 200
        _wait_loaded(gw)  # every model loaded: their start-up lines are not counted as noise
        before = gw.text().count("\n")
        answers = [_send_bad(port) for _ in range(2000)]
        assert all(a.split(b" ", 2)[1] == b"400" for a in answers), answers[0][:200]
        st, body = gw.call("/v1/chat/completions", key, CHAT)  # still serving
        assert st == 200, body
        assert gw.call("/health", None)[0] == 200
        added = gw.text().splitlines()[before:]
        noise = [ln for ln in added if "POST /v1/chat/completions 200" not in ln]
        assert len(noise) <= 3, f"{len(noise)} lines, e.g.:\n" + "\n".join(noise[:15])
        assert "Traceback" not in "\n".join(noise)
    finally:
        stop_all(procs)
