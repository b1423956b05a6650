"""The server (gateway/http/server.py): slow or idle connections cannot exhaust it.

A connection that sends nothing or a partial request is closed within the header timeout; a body
that does not arrive in time gets 408; beyond `max_connections` the oldest idle connection is closed
(so /health still answers through a flood of half-open connections), and when every connection has
a request under way a new one is refused with 503; accept() errors are logged rate-limited."""

from __future__ import annotations

import asyncio
import errno
import logging
import time

import aiohttp
import pytest

from gateway.http.server import install_accept_error_logging, loop_factory
from tests.fixtures.served_gateway import served_gateway


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> tuple[bool, bytes]:
    """(closed by the server in time, what it sent before closing)."""
    got = b""
    deadline = time.monotonic() + seconds
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(4096), max(0.01, deadline - time.monotonic()))
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionError:
        return True, got


async def _health(base: str, timeout: float = 3.0) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(base + "/health") as r:
            return r.status


async def test_partial_or_silent_connections_are_closed_within_the_header_timeout(tmp_path):
    async with served_gateway(tmp_path, server={"header_timeout_s": 1.0}) as gw:
        t0 = time.monotonic()
        partial = await asyncio.open_connection("127.0.0.1", gw.port)
        partial[1].write(b"GET /health HT")
        silent = await asyncio.open_connection("127.0.0.1", gw.port)
        headers_only = await asyncio.open_connection("127.0.0.1", gw.port)
        headers_only[1].write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        for (reader, writer), what in ((partial, "partial request line"), (silent, "nothing sent"),
                                       (headers_only, "unfinished headers")):
            closed, got = await _closed_within(reader, 1.0 + 1.0 - (time.monotonic() - t0) + 0.5)
            assert closed, f"{what}: connection still open after header_timeout + 1 s"
            if what != "nothing sent":
                assert got.startswith(b"HTTP/1.1 408"), got
            writer.close()
        assert time.monotonic() - t0 < 2.5
        # A client that completes its request in time is served; its keep-alive connection then
        # only has to be idle-timed, and a second request on it still works.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_body_that_does_not_arrive_gets_408(tmp_path):
    async with served_gateway(tmp_path, server={"body_timeout_s": 1.0}) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        closed, got = await _closed_within(reader, 1.0 + 1.5)
        assert closed and got.startswith(b"HTTP/1.1 408"), got
        assert b"body_timeout" in got and time.monotonic() - t0 < 2.5
        writer.close()


async def test_a_flood_of_idle_connections_cannot_lock_out_health(tmp_path):
    limit = 8
    async with served_gateway(tmp_path, server={"max_connections": limit, "header_timeout_s": 30.0}) as gw:
        flood = []
        for _ in range(4 * limit):
            r, w = await asyncio.open_connection("127.0.0.1", gw.port)
            w.write(b"GET /health HTTP/1.1\r\n")  # half-open: headers never finished
            flood.append((r, w))
        await asyncio.sleep(0.2)
        assert len(gw.guard.open) <= limit
        for _ in range(5):
            assert await _health(gw.base) == 200
        # The oldest half-open connections were closed to make room (before: all 32 stay open).
        closed = [(await _closed_within(r, 0.5))[0] for r, _ in flood[: 2 * limit]]
        assert all(closed)
        for _, w in flood:
            w.close()


async def test_beyond_the_limit_with_every_connection_busy_new_ones_get_503(tmp_path):
    limit = 6
    async with served_gateway(tmp_path, server={"max_connections": limit, "header_timeout_s": 30.0,
                                                "body_timeout_s": 30.0}) as gw:
        busy = []
        for _ in range(limit):  # requests under way: headers in, body still arriving
            r, w = await asyncio.open_connection("127.0.0.1", gw.port)
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            busy.append((r, w))
        await asyncio.sleep(0.3)
        for _ in range(3):
            r, w = await asyncio.open_connection("127.0.0.1", gw.port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            closed, got = await _closed_within(r, 3.0)
            assert closed and got.startswith(b"HTTP/1.1 503"), got
            assert b"too_many_connections" in got and b"Retry-After: 1" in got
            w.close()
        assert gw.guard.refused == 3
        for r, w in busy:  # the busy ones were not touched
            assert not (await _closed_within(r, 0.05))[0]
            w.close()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if len(gw.guard.open) < limit:
                break
        assert await _health(gw.base) == 200


async def test_accept_errors_are_logged_rate_limited(caplog):
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    install_accept_error_logging(loop)
    try:
        with caplog.at_level(logging.ERROR):
            for _ in range(1000):  # what asyncio reports when accept() fails for lack of descriptors
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
        lines = [r for r in caplog.records if "Too many open files" in r.getMessage()]
        assert 1 <= len(lines) <= 2, len(lines)
        assert "Traceback" not in caplog.text
    finally:
        loop.set_exception_handler(previous)


def test_the_guard_holds_on_uvloop_too(tmp_path):
    """`sluice serve` runs on uvloop when it is installed (`server.event_loop = "auto"`); the guard uses
    the loop's timers and transports, so it is checked there as well."""
    pytest.importorskip("uvloop")
    assert loop_factory("asyncio") is None
    factory = loop_factory("auto")
    assert factory is not None
    with asyncio.Runner(loop_factory=factory) as runner:
        assert type(runner.get_loop()).__module__.startswith("uvloop")
        runner.run(test_partial_or_silent_connections_are_closed_within_the_header_timeout(tmp_path / "a"))
        runner.run(test_a_body_that_does_not_arrive_gets_408(tmp_path / "b"))
        runner.run(test_beyond_the_limit_with_every_connection_busy_new_ones_get_503(tmp_path / "c"))
