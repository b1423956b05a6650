"""What every layer may raise or report when a request cannot be answered: `APIError`, an error with an
HTTP status and OpenAI's error fields, and `Failure`, the kind of failure an output ends with.

Both sit at the bottom so that admission, routing and the backends can refuse a request in the client's
own terms (a 429 with Retry-After, a 503 naming its cause) without importing the HTTP layer. Clients
(the OpenAI SDK in particular) map status codes to exception classes and read
`{"error": {"message", "type", "param", "code"}}`, so this is the one shape an error leaves in.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from aiohttp import web

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error fields; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            # Up, not to the nearest: a provider's 120 s window read 0.6 s later is 119.4 s, and a client
            # told 119 would come back before the window ends.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after - 1e-6)))
        return web.json_response(self.body(), status=self.status, headers=headers)


class Failure(enum.StrEnum):
    """Why a request ended without an answer; the HTTP layer turns each into a status."""

    INVALID_REQUEST = "invalid_request"  # cannot be served as sent (the engine refused it)
    TIMED_OUT = "timed_out"  # still queued at its deadline
    UNAVAILABLE = "unavailable"  # shutting down or aborted: retrying elsewhere may work
    ENGINE = "engine"  # the local engine failed
    PROVIDER = "provider"  # a remote provider failed mid-answer


__all__ = ["APIError", "Failure"]
