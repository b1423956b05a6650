"""`/v1/files`: upload (multipart, `purpose=batch`, JSONL), list, retrieve, content, delete; per API key.

An upload is streamed to disk (not held in memory, and not bound by the JSON body limit) up to
`[files] max_mb`, then checked: a batch file is JSON Lines, one object per line; the first bad line
is a 400 naming it. Nothing is stored for a refused upload.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.errors import APIError
from gateway.http import pages, routes
from gateway.state import STATE, GatewayState
from gateway.store.files import FileStore

FILES = web.AppKey("files_store", FileStore)
PURPOSES = ("batch",)  # what Sluice does with files: batches (/v1/batches)
CHUNK = 1 << 16


def _owner(request: web.Request) -> str | None:
    return routes.caller(request, request.app[STATE]).key


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No file with id '{file_id}' found.", param="file_id", code="not_found")


def check_jsonl(path: str) -> str | None:
    """Why the file is not JSON Lines of objects (the first bad line), or None."""
    n = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                return f"line {n} is not JSON ({e.args[0] if e.args else e})"
            if not isinstance(obj, dict):
                return f"line {n} is not a JSON object"
    return None if n else "the file is empty"


async def upload(request: web.Request) -> web.Response:
    store, state = request.app[FILES], request.app[STATE]
    limit = int(state.settings.files.max_mb * 1e6)
    timeout_s = state.settings.server.body_timeout_s
    if not request.content_type.startswith("multipart/"):
        raise APIError(400, "Upload a file as multipart/form-data with the fields `file` and `purpose`.",
                       param="file", code="invalid_value")
    file_id = f"file-{os.urandom(12).hex()}"
    tmp = store.temp_path(file_id)
    purpose: str | None = None
    filename: str | None = None
    size = 0
    try:
        try:
            reader = await request.multipart()
        except (ValueError, AssertionError, KeyError) as e:
            raise APIError(400, f"The multipart body cannot be read ({e}).", param="file",
                           code="invalid_value") from None
        async for part in _parts(reader):
            if part.name == "purpose":
                try:
                    purpose = (await part.text()).strip()
                except (ValueError, LookupError):  # not text in its declared charset
                    raise APIError(400, "`purpose` is not text.", param="purpose", code="invalid_value") from None
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                with open(tmp, "wb") as out:
                    while chunk := await _chunk(part, timeout_s):
                        size += len(chunk)
                        if size > limit:
                            raise APIError(413, f"The file is larger than {limit:,} bytes ([files] max_mb).",
                                           param="file", code="file_too_large")
                        out.write(chunk)
            else:
                raise APIError(400, f"`{part.name}` is not supported by Sluice; send `file` and `purpose` only.",
                               param=part.name, code="invalid_value")
        if filename is None:
            raise APIError(400, "The upload has no `file` field.", param="file", code="invalid_value")
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose {purpose!r} is not supported by Sluice; use `batch` (files here feed "
                                "/v1/batches).", param="purpose", code="invalid_value")
        problem = check_jsonl(str(tmp))
        if problem is not None:
            raise APIError(400, f"A batch file must be JSON Lines, one request object per line: {problem}.",
                           param="file", code="invalid_file")
        f = await store.commit(_owner(request), file_id, filename, purpose, size)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return web.json_response(f.as_openai())


async def _chunk(part: BodyPartReader, timeout_s: float) -> bytes:
    """The next piece of an upload; a client that stops sending for timeout_s gets a 408."""
    try:
        async with asyncio.timeout(timeout_s):
            return await part.read_chunk(CHUNK)
    except TimeoutError:
        raise APIError(408, f"The upload stalled for {timeout_s:g}s.", code="body_timeout") from None


async def _parts(reader: object) -> AsyncIterator[BodyPartReader]:
    while True:
        try:
            part = await reader.next()  # type: ignore[attr-defined]
        except (ValueError, AssertionError, HttpProcessingError) as e:  # a malformed part's headers
            raise APIError(400, f"The multipart body cannot be read ({type(e).__name__}).", param="file",
                           code="invalid_value") from None
        if part is None:
            return
        if not isinstance(part, BodyPartReader):
            raise APIError(400, "Nested multipart bodies are not supported.", param="file", code="invalid_value")
        yield part


async def list_files(request: web.Request) -> web.Response:
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "`order` must be asc or desc.", param="order", code="invalid_value")
    files = await request.app[FILES].list(_owner(request), q.get("purpose"), order)
    return web.json_response(pages.page([f.as_openai() for f in files], q, default=10_000, most=10_000))


async def retrieve(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    f = await request.app[FILES].get(_owner(request), file_id)
    if f is None:
        raise _not_found(file_id)
    return web.json_response(f.as_openai())


async def content(request: web.Request) -> web.StreamResponse:
    file_id = request.match_info["file_id"]
    store = request.app[FILES]
    f = await store.get(_owner(request), file_id)
    if f is None or not store.path(file_id).exists():
        raise _not_found(file_id)
    return web.FileResponse(store.path(file_id), headers={"Content-Type": "application/octet-stream"})


async def delete(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if not await request.app[FILES].delete(_owner(request), file_id):
        raise _not_found(file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[FILES].close()


def setup(app: web.Application, state: GatewayState) -> None:
    app[FILES] = FileStore(state.settings.files_dir())
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve)
    app.router.add_delete("/v1/files/{file_id}", delete)
    app.router.add_get("/v1/files/{file_id}/content", content)
    app.cleanup_ctx.append(_lifecycle)
