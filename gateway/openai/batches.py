"""The Batch API's protocol: the create request, the Batch object, and the lines of its files."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOW_S = 24 * 3600


class CreateBatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)


def new_batch(batch_id: str, req: CreateBatch) -> dict[str, Any]:
    now = int(time.time())
    return {"id": batch_id, "object": "batch", "endpoint": req.endpoint, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": req.metadata or {}}


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The Batch object as sent: fields that are null left out (the spec types them without null)."""
    return {k: v for k, v in batch.items() if v is not None}


def line_error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def validate_line(n: int, obj: Any, endpoint: str, seen: set[str]) -> dict[str, Any] | None:
    """The error of input line `n` (1-based), or None: an object with a new custom_id, method POST, the
    batch's endpoint as url, and an object body without `stream`."""
    if not isinstance(obj, dict):
        return line_error(n, "invalid_json_line", f"line {n} is not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return line_error(n, "missing_required_parameter", f"line {n} has no string `custom_id`", "custom_id")
    if cid in seen:
        return line_error(n, "duplicate_custom_id", f"line {n}: custom_id {cid!r} is used by an earlier line",
                          "custom_id")
    seen.add(cid)
    if obj.get("method") != "POST":
        return line_error(n, "invalid_method", f"line {n}: `method` must be POST", "method")
    if obj.get("url") != endpoint:
        return line_error(n, "mismatched_endpoint", f"line {n}: `url` {obj.get('url')!r} is not the batch's "
                                                    f"endpoint {endpoint}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return line_error(n, "missing_required_parameter", f"line {n} has no object `body`", "body")
    if body.get("stream"):
        return line_error(n, "invalid_value", f"line {n}: batch lines cannot stream", "body.stream")
    if not isinstance(body.get("model"), str):
        return line_error(n, "missing_required_parameter", f"line {n}: `body.model` is missing", "body.model")
    return None
