"""Authentication: `Authorization: Bearer <key>` → the key's tier, stored on the request.

With no keys at all the gateway serves anonymously, but only on a loopback address (the CLI refuses
to start otherwise); once a key exists every /v1 request needs one. Keys are never logged.

Key mode is sticky (see admission/keys.py): a keys file that is deleted, emptied, corrupted or left with
no keys while the gateway runs never opens it; every authenticated route answers 503
`keys_unavailable` (and the error is logged, rate-limited) until the file is fixed.

Every authenticated request looks at the keys file (one `stat`, about a microsecond; a re-read only
when it changed), so a key created, a key revoked and a file that breaks take effect at once.

`/health` and `/ready` are public. `/metrics` and the dashboard (`/dashboard`, `/dashboard/data`) are
public only while no keys exist; in key mode they need an admin key (`sluice keys create --admin`); the
dashboard also takes it as an HTTP Basic password, so a browser can send it. Revoking a key stops its
running requests: each keyed request is registered while it runs, and a watcher re-reads the keys file every
`REVOKE_POLL_S` while any is in flight; a revoked key's non-streamed requests end with 401
`key_revoked`, its streams with an error event of the same code (and no `[DONE]`).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.admission.keys import KeyStore
from gateway.errors import APIError
from gateway.observability.ratelog import RateLimitedLog

log = logging.getLogger("sluice.gateway")
_ratelog = RateLimitedLog(log)

PUBLIC_PATHS = frozenset({"/health", "/ready"})
# The operator's dashboard (http/dashboard.py): a browser sends the admin key as the password of
# HTTP Basic auth (any user name); the challenge makes it ask for one.
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/data", "/dashboard/static/{name}"})
ADMIN_PATHS = frozenset({"/metrics"}) | DASHBOARD_PATHS  # public without keys; an admin key once keys exist
REVOKE_POLL_S = 0.5
TIER_KEY: web.RequestKey[str] = web.RequestKey("sluice_tier", str)
KEY_NAME: web.RequestKey[str] = web.RequestKey("sluice_key_name", str)
# The response once prepared (headers sent), for the access log's status and a revoked stream's error.
RESPONSE: web.RequestKey[web.StreamResponse] = web.RequestKey("sluice_response", web.StreamResponse)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class InsecureBindError(RuntimeError):
    pass


def check_bind_allowed(host: str, keys: KeyStore) -> str:
    """The auth mode for a bind address; raises when it would expose an unauthenticated server."""
    if keys.has_keys():
        return "api-keys"
    if is_loopback(host):
        return "none (no API keys exist; serving without auth on loopback only)"
    raise InsecureBindError(
        f"refusing to serve on {host} without API keys: create one with "
        f"`sluice keys create --name NAME --tier pro|standard` (keys file {keys.path}), "
        "or bind to 127.0.0.1")


def _bearer(request: web.Request, basic: bool = False) -> str | None:
    """The key of `Authorization: Bearer <key>`; with `basic`, also the password of HTTP Basic auth."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if basic and scheme.lower() == "basic" and token.strip():
        try:
            token = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return None
        return token.strip() or None
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _dashboard_challenge(message: str) -> web.Response:
    return web.Response(status=401, text=message + "\n",
                        headers={"WWW-Authenticate": 'Basic realm="sluice dashboard", charset="UTF-8"',
                                 "Cache-Control": "no-store"})


def _route_path(request: web.Request) -> str:
    """The route the request matched (so no spelling of a path reaches /metrics as a /v1 route)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def _keys_unavailable(keys: KeyStore) -> APIError:
    _ratelog.error("keys-unavailable", "refusing API requests: %s", keys.problem)
    return APIError(503, "API keys cannot be checked on this gateway right now (its keys file is missing or "
                         "unreadable); the request was refused. Retry later.",
                    type="server_error", code="keys_unavailable", retry_after=5)


class _InFlight:
    """Keyed requests while they run, so revoking a key stops them."""

    def __init__(self, keys: KeyStore):
        self.keys = keys
        self.by_key: dict[str, set[asyncio.Task]] = {}
        self.revoked: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None

    async def run(self, request: web.Request, handler, key_hash: str) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self.by_key.setdefault(key_hash, set()).add(task)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if task not in self.revoked or task.uncancel() > 0:
                raise  # the client went away, or the server is stopping
            return await self._revoked(request)
        finally:
            tasks = self.by_key.get(key_hash)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self.by_key[key_hash]
            self.revoked.discard(task)

    async def _watch(self) -> None:
        while self.by_key:
            await asyncio.sleep(REVOKE_POLL_S)
            try:
                self.keys.reload_if_changed()
            except Exception:  # never let bookkeeping kill the watcher
                log.exception("re-reading the keys file failed")
                continue
            for key_hash, tasks in list(self.by_key.items()):
                if not self.keys.is_revoked(key_hash):
                    continue
                for t in list(tasks):
                    if t not in self.revoked and not t.done():
                        self.revoked.add(t)
                        t.cancel("sluice: API key revoked")
                        log.info("stopping a running request: its API key was revoked")

    @staticmethod
    async def _revoked(request: web.Request) -> web.StreamResponse:
        err = APIError(401, "The API key was revoked.", type="authentication_error", code="key_revoked")
        resp = request.get(RESPONSE)
        if resp is None or not resp.prepared:
            raise err
        try:  # a stream already under way: end it with an error event (no [DONE])
            data = json.dumps(err.body(), separators=(",", ":")).encode()
            await resp.write(b"data: " + data + b"\n\n")
            await resp.write_eof()
        except (RuntimeError, ConnectionError):  # already finished, or the client left
            pass
        return resp


def make_auth_middleware(keys: KeyStore, anonymous_tier: str):
    inflight = _InFlight(keys)

    @web.middleware
    async def auth_middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        path = _route_path(request)
        if path in PUBLIC_PATHS:
            return await handler(request)
        keys.reload_if_changed()
        if keys.problem is not None:
            raise _keys_unavailable(keys)
        if not keys.key_mode:
            request[TIER_KEY] = anonymous_tier
            return await handler(request)
        dashboard = path in DASHBOARD_PATHS
        token = _bearer(request, basic=dashboard)
        if token is None:
            if dashboard:
                return _dashboard_challenge("The dashboard needs an admin key (as the password).")
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                           type="authentication_error", code="invalid_api_key")
        record = keys.lookup(token, reload=False)  # the file was looked at above
        if record is None:
            if dashboard:
                return _dashboard_challenge("Incorrect API key provided.")
            raise APIError(401, "Incorrect API key provided.", type="authentication_error",
                           code="invalid_api_key")
        if path in ADMIN_PATHS:
            if not record.admin:
                raise APIError(403, f"{path} needs an admin key (`sluice keys create --admin`).",
                               type="permission_error", code="admin_key_required")
            return await handler(request)
        request[TIER_KEY] = record.tier
        request[KEY_NAME] = record.name
        return await inflight.run(request, handler, record.key_hash)

    return auth_middleware
