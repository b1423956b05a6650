"""The middleware that turns every failure into OpenAI's error shape (`gateway.errors.APIError`), and
the status of each kind of output that ends a request without an answer.

A stack trace or an HTML page would break the clients, so everything that leaves the gateway goes
through `error_middleware`: pydantic's validation errors, malformed JSON, aiohttp's own HTTP exceptions
and anything unexpected (a 500) are answered in the same shape as a raised `APIError`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from engine import RequestOutput
from gateway.errors import APIError, Failure
from gateway.messages import ErrorOutput

log = logging.getLogger("sluice.gateway")


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 whose `param` is the dotted field path."""
    errors = exc.errors(include_url=False)
    # A union reports one error per branch; our own ValueError (e.g. "only text parts") says the most.
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    loc = [str(p) for p in err.get("loc", ()) if not str(p).startswith("function-")]
    # Drop pydantic's union-branch labels (e.g. "str", "list[...]") from the path.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool", "list")]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}. Sluice does not implement it; "
                             "remove it.", param=param, code="unsupported_parameter")
    message = f"{param}: {msg}" if param else msg
    return APIError(400, message, param=param, code="invalid_value" if loc else None)


def from_http_exception(exc: web.HTTPException) -> APIError:
    status = exc.status
    if status == 404:
        return APIError(404, f"Not found: {exc.reason}", code="not_found")
    if status == 405:
        return APIError(405, "Method not allowed", code="method_not_allowed")
    if status == 413:
        return APIError(413, "Request body too large", code="request_too_large")
    return APIError(status, exc.text or exc.reason or "error")


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return e.to_response()
    except ValidationError as e:
        return validation_error(e).to_response()
    except json.JSONDecodeError as e:
        return APIError(400, f"Malformed JSON body: {e.msg}", code="invalid_json").to_response()
    except web.HTTPException as e:
        if e.status < 400:  # redirects and the like pass through
            raise
        return from_http_exception(e).to_response()
    except (ConnectionResetError, ConnectionError):
        raise  # the client went away; nothing to answer
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, "Internal server error", type="server_error").to_response()


# ---------------------------------------------------------------- outputs that end a request badly

_BY_FAILURE: dict[Failure, tuple[int, str, float | None]] = {
    # failure: (status, default code, Retry-After)
    Failure.INVALID_REQUEST: (400, "invalid_request", None),
    Failure.TIMED_OUT: (504, "queue_timeout", None),
    Failure.UNAVAILABLE: (503, "unavailable", 1.0),
    Failure.ENGINE: (500, "engine_error", None),
    Failure.PROVIDER: (502, "provider_error", None),
}


def error_for_output(out: RequestOutput) -> APIError | None:
    """The HTTP error of an output that ends its request without an answer (None for a good one)."""
    if isinstance(out, ErrorOutput):
        status, code, retry_after = _BY_FAILURE[out.failure]
        return APIError(status, out.error or "request failed", param=out.error_param,
                        code=out.error_code or code, retry_after=retry_after)
    if out.error_code is not None:  # the engine refused the request as sent
        return APIError(400, out.error or "invalid request", param=out.error_param, code=out.error_code)
    if out.finish_reason == "error" or out.error:
        return APIError(500, out.error or "engine error", type="server_error", code="engine_error")
    if out.finish_reason == "abort":
        return APIError(503, "The request was aborted (server shutting down).", code="aborted", retry_after=1)
    return None
