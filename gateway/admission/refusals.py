"""The answers admission gives when spend forbids a request: one wording and one code each, wherever the
refusal is decided (the limits middleware, or the reservation when the request is routed)."""

from __future__ import annotations

from gateway.errors import APIError

USAGE_RETRY_AFTER_S = 5


def budget_spent(budget: float, held: float = 0.0) -> APIError:
    """429 `insufficient_quota`: the key's spend (plus what its requests in flight hold) reached its budget.
    With holds in the way a retry may succeed once they settle, so it says when to retry."""
    if held > 0:
        return APIError(429, f"This key's budget ({budget}) is spent or held by its requests in flight (each holds "
                             "its worst-case cost until it ends); retry when they finish.",
                        type="insufficient_quota", code="insufficient_quota", retry_after=1)
    return APIError(429, f"This key's budget ({budget}) is spent.", type="insufficient_quota",
                    code="insufficient_quota")


def usage_unavailable() -> APIError:
    """503 `usage_unavailable`: spend cannot be recorded or read right now (the usage ledger cannot be
    written, or Redis is unreachable); the request is refused so that nothing is served unbilled."""
    return APIError(503, "Usage cannot be recorded on this gateway right now (its usage ledger or usage store is "
                         "failing), so the request was refused. Retry later.",
                    type="server_error", code="usage_unavailable", retry_after=USAGE_RETRY_AFTER_S)
