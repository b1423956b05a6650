"""Authentication: `Authorization: Bearer <key>` → the key's tier, stored on the request.

With no keys at all the gateway serves anonymously, but only on a loopback address (the CLI refuses
to start otherwise); once a key exists every /v1 request needs one. Keys are never logged.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Awaitable, Callable

from aiohttp import web

from gateway.errors import APIError
from gateway.keys import KeyStore

log = logging.getLogger("sluice.gateway")

PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})
TIER_KEY: web.RequestKey[str] = web.RequestKey("sluice_tier", str)
KEY_NAME: web.RequestKey[str] = web.RequestKey("sluice_key_name", str)


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


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def make_auth_middleware(keys: KeyStore, anonymous_tier: str):
    @web.middleware
    async def auth_middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        if not keys.has_keys():
            request[TIER_KEY] = anonymous_tier
            return await handler(request)
        token = _bearer(request)
        if token is None:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                           type="authentication_error", code="invalid_api_key")
        record = keys.lookup(token)
        if record is None:
            raise APIError(401, "Incorrect API key provided.", type="authentication_error",
                           code="invalid_api_key")
        request[TIER_KEY] = record.tier
        request[KEY_NAME] = record.name
        return await handler(request)

    return auth_middleware
