"""The dashboard (/dashboard, /dashboard/data): admin-only once keys exist, and in a real browser (Debian's
Chromium, Playwright) its figures match /metrics while traffic runs, stale data is marked, and the figures
are in labelled tables for keyboard and screen-reader users. The screenshot is kept in
var/test-artifacts/dashboard.png."""

from __future__ import annotations

import asyncio
import base64
import shutil
import time
from decimal import ROUND_HALF_UP, Decimal

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission.keys import KeyStore
from gateway.observability.dashboard import histogram_quantile
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.fake_gateway import fake_gateway
from tests.fixtures.providers import LOCAL_MODEL, REMOTE_MODEL, chat, gateway, provider_cfg
from tests.gateway.observability.conftest import ARTIFACTS

LOCAL_PRICE = {"input_per_m": 0.1, "output_per_m": 0.2}


class KVFakeEngine(FakeEngine):
    """The fake engine with a KV pool (8 of 64 blocks per running request) and busy time, as the real one reports."""

    def __init__(self) -> None:
        super().__init__(max_running_requests=4, step_s=0.002)

    def kv_usage(self) -> float:
        return 8 * len(self.running) / 64


def test_histogram_quantile():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.4, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 5.0)]) == 0.1  # past the last finite bound


async def _get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


def _basic(key: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"ops:{key}".encode()).decode()}


async def test_dashboard_is_admin_only_once_keys_exist(tmp_path):
    async with fake_gateway(tmp_path) as (base, _app, _eng):
        status, headers, body = await _get(base + "/dashboard")  # no keys: loopback, public like /metrics
        assert status == 200 and b"<h1>Sluice dashboard</h1>" in body
        assert headers["Content-Type"].startswith("text/html")
        status, _, _ = await _get(base + "/dashboard/data")
        assert status == 200
        store = KeyStore(tmp_path / "keys.json")
        user = store.create("alice", "pro")
        admin = store.create("ops", "pro", admin=True)
        for path in ("/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js"):
            status, headers, _ = await _get(base + path)
            assert status == 401 and headers["WWW-Authenticate"].startswith("Basic"), path
            status, _, _ = await _get(base + path, _basic("sk-wrong"))
            assert status == 401, path
            status, _, _ = await _get(base + path, _basic(user))
            assert status == 403, path
            status, _, _ = await _get(base + path, {"Authorization": f"Bearer {user}"})
            assert status == 403, path
            status, _, _ = await _get(base + path, _basic(admin))
            assert status == 200, path
            status, _, _ = await _get(base + path, {"Authorization": f"Bearer {admin}"})
            assert status == 200, path
        status, _, _ = await _get(base + "/dashboard/static/dashboard.py", _basic(admin))
        assert status == 404  # only the page's own files
        status, _, _ = await _get(base + "/dashboard/static/../app.py", _basic(admin))
        assert status != 200
        status, _, _ = await _get(base + "/metrics", _basic(admin))  # Basic is the dashboard's only
        assert status == 401


# ---------------------------------------------------------------- the page in a browser


async def _traffic(base: str, keys: dict[str, str], stop: asyncio.Event) -> int:
    sent = 0
    async with aiohttp.ClientSession() as s:
        async def one(key: str, body: dict) -> None:
            async with s.post(base + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                assert r.status == 200, await r.text()

        while not stop.is_set():
            await asyncio.gather(
                one(keys["alice"], chat(LOCAL_MODEL, "hello local world", max_tokens=12, stream=True)),
                one(keys["bob"], chat(LOCAL_MODEL, "hi there", max_tokens=6)),
                one(keys["alice"], chat(REMOTE_MODEL, "a remote question", stream=True)),
                one(keys["bob"], chat(REMOTE_MODEL, "another one")))
            sent += 4
            await asyncio.sleep(0.05)
    return sent


def _scrape(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _sum(m: dict, name: str, by, **where) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for (n, labels), v in m.items():
        lab = dict(labels)
        if n != name or any(lab.get(k) != w for k, w in where.items()):
            continue
        k = tuple(by(lab)) if callable(by) else tuple(lab[b] for b in by)
        out[k] = out.get(k, 0.0) + v
    return out


def _to_fixed(x: float, digits: int) -> str:
    """What JavaScript's `x.toFixed(digits)` prints: the exact binary value rounded half up (21.25 -> "21.3"),
    where Python's format rounds half to even ("21.2")."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


async def _figures(page) -> dict[str, tuple[str, str | None]]:
    return await page.eval_on_selector_all(
        "td[data-key]", "els => Object.fromEntries(els.map(e => [e.dataset.key, [e.textContent, e.dataset.value]]))")


async def _wait_refresh_after(page, t: float) -> None:
    await page.wait_for_function(
        "t => { const s = document.getElementById('status'); return s.dataset.state === 'live' && "
        "Number(s.dataset.generatedAt) > t; }", arg=t, timeout=15_000)


async def test_dashboard_in_browser_matches_metrics(tmp_path, providers, chromium):
    a, b = providers
    b.faults = [("status", 500)] * 6  # b is tried first: its errors open its circuit (5 failures)
    store = KeyStore(tmp_path / "keys.json")
    admin = store.create("ops", "pro", admin=True)
    provs = [provider_cfg(b, order=0), provider_cfg(a, order=1)]
    async with gateway(tmp_path, provs, engine=KVFakeEngine(), keys={"alice": "pro", "bob": "standard"},
                       routing={"local_price": LOCAL_PRICE}) as (base, _app, _eng, keys):
        ctx = await chromium(http_credentials={"username": "ops", "password": admin},
                             viewport={"width": 1280, "height": 900})
        page = await ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # (Chromium logs the Basic auth challenge and the aborted refreshes below as failed loads.)
        page.on("console", lambda m: errors.append(m.text) if m.type == "error"
                and not m.text.startswith("Failed to load resource") else None)
        stop = asyncio.Event()
        traffic = asyncio.create_task(_traffic(base, keys, stop))
        try:
            resp = await page.goto(base + "/dashboard")
            assert resp is not None and resp.status == 200
            # Live, with rates over a window, while traffic runs.
            await page.wait_for_function(
                "() => { const d = window.sluiceDashboard && window.sluiceDashboard.last; return d && d.rate_window_s "
                "&& d.requests.some(r => r.backend === 'local' && r.per_s > 0) "
                "&& d.requests.some(r => r.backend === 'remote' && r.per_s > 0) "
                "&& d.latency.ttft.length > 0; }", timeout=30_000)
            await _wait_refresh_after(page, time.time())
            live = await _figures(page)
            for k in ("requests/pro/local/per_s", "requests/standard/local/per_s", "requests/pro/remote/per_s",
                      "tokens/pro/local/completion/per_s", "tokens/standard/remote:a/completion/per_s"):
                assert k in live and float(live[k][0]) > 0, (k, [x for x in sorted(live) if x.startswith("tokens")])
            assert (await page.text_content("#window")).endswith(" s")
            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, ARTIFACTS / "dashboard.png")
        finally:
            stop.set()
            sent = await traffic
        assert sent >= 8

        # Traffic over: the next refresh must show exactly what /metrics says.
        t_stop = time.time()
        await asyncio.sleep(0.1)
        await _wait_refresh_after(page, t_stop + 0.05)
        shown = await _figures(page)
        status, _, body = await _get(base + "/metrics", {"Authorization": f"Bearer {admin}"})
        assert status == 200
        m = _scrape(body.decode())

        for (tier, backend), v in _sum(m, "sluice_route_decisions_total", ("tier", "backend")).items():
            assert shown[f"requests/{tier}/{backend}/total"][0] == str(round(v)), (tier, backend)
        store = KeyStore(tmp_path / "keys.json")  # with the gateway's keys
        tier_of = {store.label_for("alice"): "pro", store.label_for("bob"): "standard"}
        toks = _sum(m, "sluice_usage_tokens_total", lambda lab: (tier_of[lab["key"]], lab["backend"], lab["kind"]))
        assert toks[("pro", "local", "completion")] > 0 and toks[("standard", "remote:a", "completion")] > 0
        for (tier, backend, kind), v in toks.items():
            if kind in ("prompt", "completion"):
                assert shown[f"tokens/{tier}/{backend}/{kind}/total"][0] == str(round(v))
        for tier in ("pro", "standard"):
            depth = m[("sluice_queue_depth", frozenset({("tier", tier)}))]
            assert shown[f"queue/{tier}/depth"][0] == str(round(depth))
        for (tier, backend), v in _sum(m, "sluice_ttft_seconds_count", ("tier", "backend")).items():
            assert shown[f"ttft/{tier}/{backend}/count"][0] == str(round(v))
            buckets = [(float(le), c) for (le,), c in _sum(m, "sluice_ttft_seconds_bucket", ("le",), tier=tier,
                                                            backend=backend).items()]
            assert float(shown[f"ttft/{tier}/{backend}/p50"][1]) == pytest.approx(histogram_quantile(0.5, buckets))
            p99 = histogram_quantile(0.99, buckets)
            assert float(shown[f"ttft/{tier}/{backend}/p99"][1]) == pytest.approx(p99)
            assert shown[f"ttft/{tier}/{backend}/p99"][0] == _to_fixed(p99 * 1000, 1)
        for (key, model), v in _sum(m, "sluice_usage_cost_total", ("key", "model")).items():
            assert float(shown[f"spend/{key}/{model}"][1]) == pytest.approx(v)
            assert shown[f"spend/{key}/{model}"][0] == _to_fixed(v, 6)
        # Provider b failed and its circuit opened; a answered.
        errs = _sum(m, "sluice_remote_attempts_total", ("provider",), provider="b")
        assert shown["provider/b/errors"][0] == str(round(sum(v for (n, lab), v in m.items()
                                                               if n == "sluice_remote_attempts_total"
                                                               and dict(lab)["provider"] == "b"
                                                               and dict(lab)["outcome"] != "ok")))
        assert errs and float(shown["provider/b/errors"][0]) >= 5
        assert shown["provider/b/circuit"][0].startswith("open")
        assert shown["provider/a/circuit"][0] == "closed"
        assert float(shown["provider/a/ok"][0]) > 0
        # Savings: local tokens at the first provider's prices (b, by order: 1.0 / 2.0 per M) vs local_price.
        local = _sum(m, "sluice_usage_tokens_total", ("kind",), model=LOCAL_MODEL, backend="local")
        p, c = local[("prompt",)], local[("completion",)]
        local_cost = (p * LOCAL_PRICE["input_per_m"] + c * LOCAL_PRICE["output_per_m"]) / 1e6
        at_remote = (p * 1.0 + c * 2.0) / 1e6
        k = f"savings/{LOCAL_MODEL}/local"
        assert float(shown[f"{k}/cost"][1]) == pytest.approx(local_cost)
        assert float(shown[f"{k}/remote"][1]) == pytest.approx(at_remote)
        assert shown[f"{k}/saved"][0] == f"{at_remote - local_cost:.6f}"
        k = f"savings/{REMOTE_MODEL}/remote:a"  # a remote answer: its own cost, nothing saved
        assert shown[f"{k}/saved"][0] == "0.000000"
        assert shown[f"{k}/remote"][0] == shown[f"{k}/cost"][0]
        assert float(await page.get_attribute("#savings-summary", "data-saved")) == pytest.approx(
            at_remote - local_cost)
        # Engine: idle now; the KV pool is free once nothing runs.
        assert shown["engine/kv"][0] == "0.0 %"
        assert float(shown["engine/kv"][1]) == m[("sluice_engine_kv_usage_ratio", frozenset())]
        assert shown["engine/busy"][0].endswith("%")
        assert shown["worker/embedded/state"][0] == "idle"

        # Stale: failed refreshes are marked, and recover.
        await page.route("**/dashboard/data", lambda route: route.abort())
        await page.wait_for_function("() => document.getElementById('status').dataset.state === 'stale'",
                                     timeout=10_000)
        assert "STALE" in await page.text_content("#status")
        await page.unroute("**/dashboard/data")
        await _wait_refresh_after(page, time.time())

        # Keyboard and screen reader: headings, labelled tables behind the charts, a skip link first.
        for name in ("Traffic by tier and backend", "Queue by tier", "Latency", "Engine and workers",
                     "Remote providers", "Spend and savings"):
            await page.get_by_role("heading", name=name, level=2).wait_for(timeout=2000)
        for caption in ("Requests routed (per second and total)", "Tokens (per second and total)",
                        "Queue depth and estimated wait", "Provider health", "Spend by key and model",
                        "Savings by model and backend", "Workers", "Engine"):
            assert await page.get_by_role("table", name=caption, exact=True).count() == 1, caption
        for chart in await page.query_selector_all("svg.chart"):
            assert await chart.get_attribute("role") == "img" and await chart.get_attribute("aria-labelledby")
        await page.keyboard.press("Tab")
        assert await page.evaluate("document.activeElement.textContent") == "Skip to the figures"
        assert await page.get_attribute("#status", "aria-live") == "polite"
        assert not errors, errors


async def test_dashboard_shows_batches_their_rate_eta_and_the_lanes_share(tmp_path, chromium):
    """A batch draining on a slow engine: /dashboard/data and the page show its lines done (as the API
    reports them), its lines/s and ETA, and the batch lane's share of the engine."""
    import json

    import openai

    store = KeyStore(tmp_path / "keys.json")
    admin, alice = store.create("ops", "pro", admin=True), store.create("alice", "pro")
    engine = FakeEngine(max_running_requests=8, max_model_len=256, step_s=0.01)
    async with fake_gateway(tmp_path, engine, batches={"max_in_flight": 2}) as (base, _app, _):
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=alice, max_retries=0)
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"q{i}"}],
                           "max_tokens": 20}} for i in range(200)]
        f = await c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
                                 purpose="batch")
        b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        ctx = await chromium(http_credentials={"username": "ops", "password": admin})
        page = await ctx.new_page()
        await page.goto(base + "/dashboard")
        k = f"batch/{b.id}"
        await page.wait_for_function(  # two refreshes apart: a rate
            "k => { const e = document.querySelector(`td[data-key='${k}/per_s']`); return e && e.dataset.value "
            "&& Number(e.dataset.value) > 0; }", arg=k, timeout=60_000)  # (chromium is slow to start under load)
        shown = await _figures(page)
        done, total = (int(x) for x in shown[f"{k}/done"][0].split(" / "))
        assert total == 200 and 0 < done < 200 and shown[f"{k}/status"][0] == "in_progress"
        rate = float(shown[f"{k}/per_s"][1])
        assert float(shown[f"{k}/eta"][1]) == pytest.approx((200 - done) / rate, rel=0.02)
        assert float(shown["lane/fake-model/batch"][1]) <= 2
        assert 0 <= float(shown["lane/fake-model/share"][1]) <= 2 / 8
        got = await c.batches.retrieve(b.id)  # the page's count, at most one refresh old
        assert done <= got.request_counts.completed
        status, _, body = await _get(base + "/dashboard/data", _basic(admin))
        data = json.loads(body)["batches"]
        assert [x["id"] for x in data["batches"]] == [b.id] and data["batches"][0]["owner"] == "alice"
        await page.get_by_role("heading", name="Batches", level=2).wait_for(timeout=2000)
        for caption in ("Unfinished batches", "The batch lane's share of the local engines"):
            assert await page.get_by_role("table", name=caption, exact=True).count() == 1, caption
        await c.batches.cancel(b.id)
