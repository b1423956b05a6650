"""Serving the app on a socket without letting slow or idle clients exhaust it.

aiohttp has no header-read timeout and no connection limit: a client that opens a connection and
sends nothing, or half a request line, holds a socket and a file descriptor until its keep-alive
timer (an hour by default) fires. Here every connection goes through `GuardedRequestHandler`:

- headers: a connection must complete a request's headers within `server.header_timeout_s` of opening
  (or of the first byte of a later request on a keep-alive connection); otherwise it is closed (with a
  408 when it had sent part of a request);
- body: the `body_timeout` middleware (http/middleware.py) reads the body within `server.body_timeout_s`
  after the headers, or answers 408 and closes;
- idle keep-alive connections close after `server.keepalive_timeout_s`;
- at most `server.max_connections` are open: a new one beyond it closes the oldest connection that has
  no request under way (an idle or half-sent one: this is what keeps /health answering through a
  flood of half-open connections), and when every connection has a request under way the new one is
  answered 503 `too_many_connections` and closed.

`accept()` failures (out of file descriptors), refusals and malformed requests (a NUL byte in a header,
a bad request line: answered 400 by aiohttp, which logged an ERROR with a traceback for each, before any
authentication) are logged rate-limited (`gateway.observability.ratelog`: one line per 10 s with the
count left out), never once per event. `serve(app, settings)` is what `sluice serve` runs,
on the event loop `loop_factory(server.event_loop)` makes (uvloop when installed: its C loop and
transports cost less CPU per request than asyncio's).
"""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import json
import logging
import resource
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.errors import APIError
from gateway.observability.ratelog import RateLimitedLog
from gateway.settings import Settings
from gateway.worker.engine_api import Engine

log = logging.getLogger("sluice.server")
_ratelog = RateLimitedLog(log)

_REFUSED_LINGER_S = 1.0  # a refused connection is kept this long so the client reads the 503, not a reset
_MAX_LINGERING = 256  # beyond this many refused connections lingering at once, close at once


def _raw_response(status: str, code: str, message: str, retry_after: int | None = None) -> bytes:
    err = APIError(int(status.split()[0]), message, code=code)
    body = json.dumps(err.body(), separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {status}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """Limits and bookkeeping shared by every connection of one server."""

    def __init__(self, header_timeout_s: float, max_connections: int):
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.open: dict[GuardedRequestHandler, None] = {}  # accepted and counted, oldest first
        self.lingering = 0
        self.refused = 0
        self.evicted = 0
        self.header_timeouts = 0
        self.malformed = 0

    def make_room(self) -> bool:
        """Close the oldest connection without a request under way; False when every one has one."""
        for conn in self.open:
            if conn.idle:
                self.open.pop(conn, None)
                self.evicted += 1
                _ratelog.warning("evict", "connection limit (%d) reached: closing the oldest idle connection "
                                 "(%d closed so far)", self.max_connections, self.evicted)
                conn.force_close()
                return True
        return False


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol with a header-read deadline and the guard's connection limit."""

    __slots__ = ("_guard", "_hdr_handle", "_hdr_count", "_hdr_partial", "_refused")

    def __init__(self, manager: Any, *, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._hdr_handle: asyncio.TimerHandle | None = None
        self._hdr_count = 0
        self._hdr_partial = False
        self._refused = False

    @property
    def idle(self) -> bool:
        """No request under way: waiting for (the rest of) a request's headers, or between requests."""
        return not (self._request_in_progress or self._messages or self._force_close)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        if len(g.open) >= g.max_connections and not g.make_room():
            self._refuse(transport)
            return
        super().connection_made(transport)
        g.open[self] = None
        self._arm_header_timer(partial=False)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        self._refused = True
        self.transport = transport  # type: ignore[assignment]
        g.refused += 1
        _ratelog.warning("refuse", "connection limit (%d) reached with every connection busy: answering 503 "
                         "(%d refused so far)", g.max_connections, g.refused)
        t: Any = transport
        t.write(_raw_response("503 Service Unavailable", "too_many_connections",
                              f"Too many open connections (limit {g.max_connections}); retry shortly.",
                              retry_after=1))
        if g.lingering >= _MAX_LINGERING or not t.can_write_eof():
            t.close()
            return
        t.write_eof()  # half-close: the client reads the answer; what it still sends is discarded
        g.lingering += 1
        self._hdr_handle = self._loop.call_later(_REFUSED_LINGER_S, t.close)

    def _arm_header_timer(self, partial: bool) -> None:
        self._hdr_partial = partial
        if self._hdr_handle is None:
            self._hdr_count = self._request_count
            self._hdr_handle = self._loop.call_later(self._guard.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._hdr_handle is not None:
            self._hdr_handle.cancel()
            self._hdr_handle = None

    def _header_timeout(self) -> None:
        self._hdr_handle = None
        if self._request_count != self._hdr_count or not self.idle or self.transport is None:
            return  # headers arrived (or a request is under way): nothing to do
        g = self._guard
        g.header_timeouts += 1
        _ratelog.info("header-timeout", "closing a connection that sent no complete request headers within "
                      "%.0fs (%d so far)", g.header_timeout_s, g.header_timeouts)
        if self._hdr_partial:
            self.transport.write(_raw_response("408 Request Timeout", "header_timeout",
                                               f"Request headers not received within {g.header_timeout_s:g}s."))
        self.force_close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:
            self._disarm_header_timer()  # a request's headers are complete
        elif self.idle:
            self._arm_header_timer(partial=True)  # the first bytes of a request (or more of them)
        # else: body bytes of the request under way (body_timeout_middleware times those)

    def eof_received(self) -> None:
        return None  # the transport closes

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse is the client's fault: the same 400 answer, one rate-limited
        line instead of a traceback each (anyone can send them, no key needed). Other errors: aiohttp's."""
        if not (isinstance(exc, HttpProcessingError) and 400 <= status < 500 and request.writer.output_size == 0):
            return super().handle_error(request, status, exc, message)
        g = self._guard
        g.malformed += 1
        _ratelog.info("malformed", "answered %d to a malformed HTTP request from %s: %s (%d so far)", status,
                      request.remote, ascii(exc.message or type(exc).__name__)[:200], g.malformed)
        resp = web.Response(status=status, text=message or exc.message or "Bad Request", content_type="text/plain")
        resp.force_close()
        return resp

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_header_timer()
        if self._refused:
            self._guard.lingering = max(0, self._guard.lingering - 1)
            self.transport = None
            return
        self._guard.open.pop(self, None)
        super().connection_lost(exc)


class GuardedServer(web.Server):
    guard: ConnectionGuard

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, guard=self.guard, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """`web.AppRunner` whose connections are `GuardedRequestHandler`s sharing `guard`."""

    def __init__(self, app: web.Application, *, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GuardedServer  # same object and state; only the protocol factory differs
        server.guard = self.guard  # type: ignore[attr-defined]
        return server


# ---------------------------------------------------------------- running it


_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def install_accept_error_logging(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio reports each failed accept() (e.g. out of file descriptors) through the loop's exception
    handler, with a traceback each time; log those rate-limited instead."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message", ""))
        if (isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS) or message.startswith("socket.accept()"):
            _ratelog.error("accept", "cannot accept connections: %s (%s); lower server.max_connections or raise "
                           "the open-files limit (ulimit -n)", message or "accept failed", exc)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def effective_max_connections(wanted: int) -> int:
    """Raise the open-files limit toward what `wanted` connections need; if it stays lower, use fewer
    connections (with a warning) so the limit is reached before the process runs out of descriptors."""
    reserve = 128  # the engine, logs, the keys file, Redis and provider connections
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = wanted + reserve
        if soft != resource.RLIM_INFINITY and soft < need:
            target = need if hard == resource.RLIM_INFINITY else min(need, hard)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
        if soft != resource.RLIM_INFINITY and soft < need:
            lowered = max(1, soft - reserve)
            log.warning("server.max_connections=%d needs %d open files but the limit is %d (ulimit -n): "
                        "serving at most %d connections", wanted, need, soft, lowered)
            return lowered
    except (ValueError, OSError) as e:
        log.warning("could not check the open-files limit: %s", e)
    return wanted


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop for `server.event_loop`: None is asyncio's default; "auto" is uvloop when it is
    installed; "uvloop" requires it."""
    if choice == "asyncio" or (choice == "auto" and importlib.util.find_spec("uvloop") is None):
        return None
    try:
        import uvloop
    except ImportError as e:
        raise RuntimeError("server.event_loop = \"uvloop\" but uvloop is not installed "
                           "(pip install uvloop, or set it to \"auto\" or \"asyncio\")") from e
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def serve(app: web.Application, settings: Any, *, host: str | None = None,
                port: int | None = None) -> tuple[GuardedAppRunner, web.TCPSite]:
    """Start the app on host:port (defaults: settings.server) with the connection guard; returns the
    runner (cleanup() stops it) and the site (its port is the bound one)."""
    s = settings.server
    install_accept_error_logging(asyncio.get_running_loop())
    guard = ConnectionGuard(s.header_timeout_s, effective_max_connections(s.max_connections))
    runner = GuardedAppRunner(app, guard=guard, handler_cancellation=True, access_log=None,
                              shutdown_timeout=s.shutdown_grace_s, keepalive_timeout=s.keepalive_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host if host is not None else s.host, port if port is not None else s.port)
    await site.start()
    return runner, site


async def run_server(settings: Settings, stop: asyncio.Event, *, engine: Engine | None = None,
                     no_engine: bool = False) -> None:
    """`sluice serve`: check the keys and the bind address, serve until `stop`, then drain."""
    from gateway.admission.auth import check_bind_allowed
    from gateway.admission.keys import KeyStore
    from gateway.http.app import create_app
    from gateway.state import STATE

    keys = KeyStore(settings.auth.keys_file, strict=True)  # a corrupt keys file: refuse to start
    auth_mode = check_bind_allowed(settings.server.host, keys)
    if not keys.has_keys():
        log.warning("no API keys in %s: serving WITHOUT authentication (loopback only); "
                    "create one with `sluice keys create`", keys.path)
    app = create_app(settings, engine=engine, keys=keys, no_engine=no_engine)
    runner, site = await serve(app, settings)
    state = app[STATE]
    # Wait for the engine to give the one informative start line (capacity needs the engine).
    while state.load_error is None and not stop.is_set() and not (no_engine and not state.pools) and (
            state.local_worker is None if not no_engine else state.model_name is None):
        await asyncio.sleep(0.05)
    capacity = state.local_worker.capacity if state.local_worker else 0
    log.info("sluice serving on http://%s:%d model=%s max_model_len=%d capacity=%d running "
             "(+%s queued per tier) auth=%s queue=%s loop=%s%s", settings.server.host, settings.server.port,
             state.model_name, state.max_model_len, capacity, dict(settings.queue.max_depth), auth_mode,
             "redis" if settings.redis_url else "in-process",
             type(asyncio.get_running_loop()).__module__.split(".")[0],
             " (no engine: workers run elsewhere)" if no_engine and state.pools else
             " (no engine: engine replicas only)" if no_engine else "")
    if settings.engines:
        log.info("engine replicas: %s", ", ".join(f"{e.name} ({e.kind}, {e.base_url}: {', '.join(e.models)})"
                                                  for e in settings.engines))
    await stop.wait()
    # Graceful: refuse new requests (503 + Retry-After), stop listening, let open streams finish
    # within shutdown_grace_s, then hand the local engine's unfinished requests back (Redis) and exit.
    log.info("shutting down: draining open requests for up to %.0fs", settings.server.shutdown_grace_s)
    state.draining = True
    await runner.cleanup()
    log.info("stopped")
