"""Per-request plumbing around every handler: the request id, the access log with its counters, and
the body read timeout (the header timeout lives in the connection handler, http/server.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.admission.auth import RESPONSE, TIER_KEY
from gateway.errors import APIError
from gateway.observability.metrics import Metrics
from gateway.observability.ratelog import RateLimitedLog

log = logging.getLogger("sluice.gateway")
_ratelog = RateLimitedLog(log)

REQUEST_ID: web.RequestKey[str] = web.RequestKey("sluice_request_id", str)
# The client's `user` / `safety_identifier` (an end-user id, as OpenAI uses it): only logged.
END_USER: web.RequestKey[str] = web.RequestKey("sluice_end_user", str)
REQUEST_ID_HEADER = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


def request_id(request: web.Request) -> str:
    """The client's `x-request-id` when it is a sane token, else a fresh one; the same for the whole request."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        client = request.headers.get(REQUEST_ID_HEADER, "")
        rid = client if _VALID_REQUEST_ID.match(client) else os.urandom(16).hex()
        request[REQUEST_ID] = rid
    return rid


async def on_response_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries the request id; the prepared response is kept on the request (the access
    log's status, a revoked stream's error event)."""
    response.headers[REQUEST_ID_HEADER] = request_id(request)
    request[RESPONSE] = response


def access_log(metrics: Metrics) -> web.middleware:  # type: ignore[valid-type]
    @web.middleware
    async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        """One line per API request (never the Authorization header) and the request counters."""
        start = time.monotonic()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            # The handler was cancelled (client gone, or a revoked key's request stopped). Once the headers
            # went out, the status the client got is the response's (a stream whose client closes right
            # after [DONE] is a 200); 499 only when nothing was sent.
            sent = request.get(RESPONSE)
            status = sent.status if sent is not None and sent.prepared else 499
            raise
        finally:
            if request.path.startswith("/v1/"):
                elapsed = time.monotonic() - start
                route = _route_label(request)
                metrics.requests.labels(route, str(status)).inc()
                metrics.request_seconds.labels(route).observe(elapsed)
                end_user = request.get(END_USER)
                log.info("%s %s %d %.3fs request_id=%s tier=%s%s", request.method, request.path, status, elapsed,
                         request_id(request), request.get(TIER_KEY, "-"),
                         "" if end_user is None else f" user={end_user!r}")

    return access_log_middleware


def _route_label(request: web.Request) -> str:
    """The metrics label of a request's path: its route's template (`/v1/responses/{response_id}`), so ids
    in paths cannot grow the label set without bound; paths no route serves share one label."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def body_timeout(timeout_s: float) -> web.middleware:  # type: ignore[valid-type]
    @web.middleware
    async def body_timeout_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Reads a request's body within `server.body_timeout_s` (handlers then get it from the cache)."""
        # A file upload streams to disk in its handler (gateway/http/files.py), with this timeout between
        # chunks and its own size limit, instead of being read whole into memory here.
        upload = request.path == "/v1/files" and request.content_type.startswith("multipart/")
        if request.body_exists and request.method in ("POST", "PUT", "PATCH") and not upload:
            if request.content.is_eof():  # all of it is here already (a small body): nothing to wait for
                await request.read()
                return await handler(request)
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()  # 413 beyond client_max_size, as before
            except TimeoutError:
                _ratelog.info("body-timeout", "closing a connection whose request body did not arrive "
                              "within %.0fs", timeout_s)
                resp = APIError(408, f"The request body did not arrive within {timeout_s:g}s.",
                                code="body_timeout").to_response()
                resp.force_close()
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()  # no lingering read of the rest: answer, then close
                return resp
        return await handler(request)

    return body_timeout_middleware
