"""gateway/errors.py: the OpenAI-style error body and its Retry-After."""

from __future__ import annotations

from gateway.errors import APIError


def test_retry_after_rounds_up_so_a_client_never_comes_back_early():
    def header(seconds: float) -> str:
        return APIError(429, "m", retry_after=seconds).to_response().headers["Retry-After"]

    assert header(119.4) == "120" and header(120.0) == "120" and header(47.5) == "48"
    assert header(0.2) == "1" and header(2.0000000001) == "2"
