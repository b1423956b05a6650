"""The dashboard's routes: `GET /dashboard` and `/dashboard/static/{name}` (the page's files) and
`GET /dashboard/data` (its JSON, built by `observability.dashboard.DashboardData` from the metrics
registry and the running gateway, with the Batch API runner's progress). Admin-only once keys exist,
like /metrics (`admission/auth.py`)."""

from __future__ import annotations

from aiohttp import web

from gateway.http import batches
from gateway.observability.dashboard import DashboardData, asset
from gateway.state import STATE

DATA: web.AppKey[DashboardData] = web.AppKey("sluice_dashboard", DashboardData)


async def page(request: web.Request) -> web.Response:
    found = asset(request.match_info.get("name", "index.html"))
    if found is None:
        raise web.HTTPNotFound()
    body, content_type = found
    return web.Response(body=body, content_type=content_type, charset="utf-8",
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": "default-src 'self'; img-src 'self' data:"})


async def data(request: web.Request) -> web.Response:
    body = await request.app[DATA].build()
    body["batches"] = await request.app[batches.RUNNER].progress()
    return web.json_response(body, headers={"Cache-Control": "no-store"})


def setup(app: web.Application) -> None:
    app[DATA] = DashboardData(app[STATE])
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/data", data)
    app.router.add_get("/dashboard/static/{name}", page)
