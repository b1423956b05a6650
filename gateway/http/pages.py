"""OpenAI's cursor pages (`limit`, `after`): one list shape for files, batches and a response's items."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import APIError


def limit_of(query: Mapping[str, str], default: int, most: int) -> int:
    try:
        limit = int(query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise APIError(400, f"`limit` must be an integer from 1 to {most:,}.", param="limit", code="invalid_value")
    return limit


def page(items: list[dict[str, Any]], query: Mapping[str, str], *, default: int, most: int) -> dict[str, Any]:
    """The list object of `items` (already in order, each with an `id`) after the `after` cursor, at most
    `limit` of them."""
    limit = limit_of(query, default, most)
    after = query.get("after")
    if after is not None:
        at = next((i for i, x in enumerate(items) if x["id"] == after), None)
        if at is None:
            raise APIError(400, f"`after`: no object '{after}' in this list.", param="after", code="invalid_value")
        items = items[at + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}
