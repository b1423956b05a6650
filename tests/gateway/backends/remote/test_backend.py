"""Remote providers through the gateway (fake local engine), against fault-injecting providers over
real HTTP on loopback: retries, failover, breakers, streaming commit rules, routing, limits, usage."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from gateway.backends.remote.backend import RemoteBackend
from gateway.settings import ProviderSettings, RoutingSettings
from gateway.state import STATE
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.providers import LOCAL_MODEL, REMOTE_MODEL, chat, gateway, post, provider_cfg, stream_text


async def test_providers_are_tried_by_order_and_picked_by_weight_within_an_order():
    def mk(n: str, o: int, w: float = 1.0) -> ProviderSettings:
        return ProviderSettings(name=n, base_url="http://127.0.0.1:1/v1", models={"m": "m"}, order=o, weight=w)
    rb = RemoteBackend([mk("c", 1), mk("a", 0, 9.0), mk("b", 0, 1.0)], RoutingSettings())
    firsts = [rb.order(rb.chain("m"))[0].name for _ in range(2000)]
    assert rb.order(rb.chain("m"))[-1].name == "c"
    assert 0.85 < firsts.count("a") / 2000 < 0.95
    await rb.close()


async def test_remote_only_model_served_with_upstream_model_and_key(tmp_path, providers):
    a, b = providers
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, app, _, _k):
        st, h, body = await post(base, chat(max_tokens=5))
        assert st == 200, body
        assert h["x-sluice-backend"] == "remote:a"
        assert body["model"] == REMOTE_MODEL  # the client's name, not the provider's
        assert body["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4"
        assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 5
        sent = a.requests[-1]
        assert sent["model"] == "up-a" and sent["_auth"] == "Bearer sk-upstream-a"
        assert "prompt_truncation" not in sent and "ignore_eos" not in sent
        assert b.count == 0
        async with aiohttp.ClientSession() as s:  # the remote-only model is listed beside the local one
            async with s.get(base + "/v1/models") as r:
                listed = [m["id"] for m in (await r.json())["data"]]
            async with s.get(f"{base}/v1/models/{REMOTE_MODEL}") as r:
                assert r.status == 200 and (await r.json())["id"] == REMOTE_MODEL
            async with s.get(base + "/v1/models/no-such-model") as r:
                assert r.status == 404
        assert REMOTE_MODEL in listed and LOCAL_MODEL in listed


async def test_429_with_retry_after_then_success(tmp_path, providers):
    a, _ = providers
    a.faults = [("status", 429, 1)]
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
        t0 = time.monotonic()
        st, h, body = await post(base, chat())
        assert st == 200, body
        assert time.monotonic() - t0 >= 0.95  # Retry-After honoured, not the 10 ms backoff
        assert a.count == 2 and h["x-sluice-backend"] == "remote:a"


async def test_429_fails_over_at_once_when_a_fallback_is_healthy(tmp_path, providers):
    a, b = providers
    a.faults = [("status", 429, 20)]
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, *_):
        t0 = time.monotonic()
        st, h, _ = await post(base, chat())
        assert st == 200 and h["x-sluice-backend"] == "remote:b"
        assert time.monotonic() - t0 < 1.0  # did not sleep out A's 20 s
        st, h, _ = await post(base, chat())  # A asked for 20 s: not called again meanwhile
        assert h["x-sluice-backend"] == "remote:b" and a.count == 1


async def test_all_rate_limited_passes_retry_after_to_the_client(tmp_path, providers):
    a, _ = providers
    a.default_fault = ("status", 429, 120)  # longer than max_retry_after_s: answer at once
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
        t0 = time.monotonic()
        st, h, body = await post(base, chat())
        assert st == 429 and h["Retry-After"] == "120", body
        assert body["error"]["code"] == "upstream_rate_limited"
        assert time.monotonic() - t0 < 1.0


async def test_500s_fail_over_and_open_the_breaker(tmp_path, providers):
    a, b = providers
    a.default_fault = ("status", 500)
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)],
                       routing={"breaker_failures": 2}) as (base, app, *_):
        for _ in range(5):
            st, h, _ = await post(base, chat())
            assert st == 200 and h["x-sluice-backend"] == "remote:b"
        assert a.count == 2  # open after 2 failures: A is no longer called
        pa = app[STATE].remote.providers[0]
        assert pa.breaker.state == "open"
        pa.breaker.opened_at -= 60  # cool-down over: one probe goes to A, which is healthy again
        a.default_fault = None
        st, h, _ = await post(base, chat())
        assert h["x-sluice-backend"] == "remote:a" and pa.breaker.state == "closed"


async def test_hang_hits_the_timeout_then_fails_over(tmp_path, providers):
    a, b = providers
    a.faults = [("hang", 10)]
    async with gateway(tmp_path, [provider_cfg(a, timeout_s=0.3), provider_cfg(b, order=1)]) as (base, *_):
        t0 = time.monotonic()
        st, h, _ = await post(base, chat())
        assert st == 200 and h["x-sluice-backend"] == "remote:b"
        assert 0.25 < time.monotonic() - t0 < 2.0


async def test_all_providers_down_is_a_clear_503(tmp_path, providers):
    a, b = providers
    a.default_fault = ("status", 502)
    b.default_fault = ("reset",)
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)],
                       routing={"max_attempts": 2}) as (base, *_):
        st, h, body = await post(base, chat())
        assert st == 503, body
        assert "Retry-After" in h
        assert body["error"]["code"] == "upstream_unavailable"
        assert "a: HTTP 502" in body["error"]["message"] and "b: connection failed" in body["error"]["message"]
        assert a.count == 2 and b.count == 2


async def test_client_errors_are_not_retried(tmp_path, providers):
    a, b = providers
    a.faults = [("status", 400)]
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, *_):
        st, _, body = await post(base, chat())
        assert st == 400 and body["error"]["code"] == "injected_400"
        assert a.count == 1 and b.count == 0


async def test_retries_stay_inside_the_deadline(tmp_path, providers):
    a, _ = providers
    a.default_fault = ("status", 503, 2)  # each try asks for 2 s; the deadline is 1 s
    async with gateway(tmp_path, [provider_cfg(a)], routing={"request_timeout_s": 1.0, "max_attempts": 10}) \
            as (base, *_):
        t0 = time.monotonic()
        st, h, _ = await post(base, chat())
        assert st == 503 and time.monotonic() - t0 < 1.2 and a.count == 1


async def test_stream_dropped_before_first_token_fails_over(tmp_path, providers):
    a, b = providers
    a.faults = [("drop_before_first",)]  # sends a role-only chunk first: not a commitment
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, *_):
        st, h, events = await post(base, chat(stream=True, stream_options={"include_usage": True}))
        assert st == 200 and h["x-sluice-backend"] == "remote:b"
        assert stream_text(events) == "w0 w1 w2 w3 w4 w5 w6 w7"
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
        assert not any("error" in e for e in events if isinstance(e, dict))
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_stream_dropped_after_tokens_ends_with_an_error_event(tmp_path, providers):
    a, b = providers
    a.faults = [("drop_after", 3)]
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, *_):
        st, h, events = await post(base, chat(stream=True))
        assert st == 200 and h["x-sluice-backend"] == "remote:a"
        assert stream_text(events) == "w0 w1 w2"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "mid-stream" in errors[0]["error"]["message"]
        assert b.count == 0  # committed: never replayed elsewhere


async def test_a_stream_broken_mid_answer_continues_on_a_provider_that_can_continue_it(tmp_path, providers):
    """Providers whose `kind` says they continue a partial answer (vLLM here, played by bench/mock_engine.py):
    the broken stream goes on at the next one from the text relayed so far, one stream for the client with
    nothing repeated or missing, and the whole answer's usage. An `openai` provider cannot continue it."""
    from aiohttp.test_utils import TestServer

    from bench.mock_engine import EngineModel, make_app

    dying = TestServer(make_app(EngineModel(max_running=4, decode_ms=5), cut_after=4), host="127.0.0.1")
    healthy = TestServer(make_app(EngineModel(max_running=4, decode_ms=5)), host="127.0.0.1")
    await dying.start_server()
    await healthy.start_server()
    a, b = providers

    def engine_cfg(name: str, server: TestServer, order: int, kind: str) -> dict:
        return {"name": name, "base_url": f"http://127.0.0.1:{server.port}/v1", "models": {REMOTE_MODEL: "up"},
                "timeout_s": 2.0, "order": order, "kind": kind}
    try:
        async with gateway(tmp_path, [engine_cfg("v1", dying, 0, "vllm"), engine_cfg("v2", healthy, 1, "vllm")]) \
                as (base, *_):
            st, h, events = await post(base, chat(stream=True, max_tokens=12, stream_options={"include_usage": True}))
            assert st == 200 and h["x-sluice-backend"] == "remote:v1"  # the header went out with v1's first text
            assert stream_text(events) == "".join(f" t{i}" for i in range(1, 13))
            assert not any("error" in e for e in events if isinstance(e, dict))
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
        async with gateway(tmp_path, [engine_cfg("v1", dying, 0, "vllm"), provider_cfg(b, order=1)]) as (base, *_):
            st, h, events = await post(base, chat(stream=True, max_tokens=12))
            assert stream_text(events) == " t1 t2 t3 t4"
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1 and "mid-stream" in errors[0]["error"]["message"]
            assert b.count == 0  # a plain OpenAI API cannot continue it: never replayed there
    finally:
        await dying.close()
        await healthy.close()


async def test_stream_relays_chunk_by_chunk(tmp_path, providers):
    a, _ = providers
    a.itl_s = 0.05
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
        import aiohttp
        arrivals = []
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/chat/completions", json=chat(stream=True)) as r:
                async for raw in r.content:
                    if b'"content":"' in raw and b'"content":""' not in raw:
                        arrivals.append(time.monotonic())
        gaps = [y - x for x, y in zip(arrivals, arrivals[1:])]
        assert len(arrivals) == 8 and min(gaps) > 0.03  # not bunched


async def test_legacy_completions_remote_stream_and_json(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
        st, h, body = await post(base, {"model": REMOTE_MODEL, "prompt": "a b c", "max_tokens": 3},
                                 path="/v1/completions")
        assert st == 200 and body["choices"][0]["text"] == "w0 w1 w2" and body["usage"]["prompt_tokens"] == 3
        st, h, events = await post(base, {"model": REMOTE_MODEL, "prompt": "a b c", "stream": True},
                                   path="/v1/completions")
        assert st == 200 and stream_text(events) == "w0 w1 w2 w3 w4 w5 w6 w7"


# ---------------------------------------------------------------- routing between local and remote


async def test_local_first_when_the_model_is_served_both_ways(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
        st, h, body = await post(base, chat(LOCAL_MODEL, max_tokens=4))
        assert st == 200 and h["x-sluice-backend"] == "local" and a.count == 0


async def test_local_failure_before_first_token_retries_remotely(tmp_path, providers):
    a, _ = providers
    engine = FakeEngine()
    async with gateway(tmp_path, [provider_cfg(a)], engine=engine) as (base, app, *_):
        engine.fail_next_step = True
        st, h, body = await post(base, chat(LOCAL_MODEL, max_tokens=4))
        assert st == 200, body
        assert h["x-sluice-backend"] == "remote:a" and body["choices"][0]["message"]["content"] == "w0 w1 w2 w3"


async def test_no_engine_worker_ready_goes_remote(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, app, *_):
        await app[STATE].local_worker.stop()
        st, h, _ = await post(base, chat(LOCAL_MODEL, max_tokens=4))
        assert st == 200 and h["x-sluice-backend"] == "remote:a"


async def test_full_local_queue_overflows(tmp_path, providers):
    a, _ = providers
    engine = FakeEngine(max_running_requests=1, step_s=0.02)
    async with gateway(tmp_path, [provider_cfg(a)], engine=engine, queue={"max_depth": {"pro": 1, "standard": 1}},
                       tiers={"pro": {"priority": 0}, "standard": {"priority": 1}}) as (base, *_):
        res = await asyncio.gather(*[post(base, chat(LOCAL_MODEL, max_tokens=10)) for _ in range(6)])
        backends = [h["x-sluice-backend"] for st, h, _ in res]
        assert all(st == 200 for st, _, _ in res)
        assert "local" in backends and "remote:a" in backends


@pytest.mark.slow
async def test_saturation_standard_overflows_while_pro_stays_local(tmp_path, providers):
    a, _ = providers
    engine = FakeEngine(max_running_requests=2, step_s=0.02)
    tiers = {"pro": {"priority": 0, "max_queue_wait_ms": 10000}, "standard": {"priority": 1, "max_queue_wait_ms": 150}}
    async with gateway(tmp_path, [provider_cfg(a)], engine=engine, tiers=tiers,
                       keys={"p": "pro", "s": "standard"}) as (base, app, _, keys):
        # warm up: the router learns the engine's completion rate
        await asyncio.gather(*[post(base, chat(LOCAL_MODEL, max_tokens=10), keys["p"]) for _ in range(4)])
        std = [asyncio.create_task(post(base, chat(LOCAL_MODEL, max_tokens=10), keys["s"])) for _ in range(20)]
        await asyncio.sleep(0.1)
        pro = [asyncio.create_task(post(base, chat(LOCAL_MODEL, max_tokens=10), keys["p"])) for _ in range(4)]
        std_res = await asyncio.gather(*std)
        pro_res = await asyncio.gather(*pro)
        assert all(st == 200 for st, _, _ in std_res + pro_res)
        assert [h["x-sluice-backend"] for _, h, _ in pro_res] == ["local"] * 4
        std_backends = [h["x-sluice-backend"] for _, h, _ in std_res]
        assert std_backends.count("remote:a") >= 10 and "local" in std_backends
        metrics = await _metrics(base, tmp_path)
        assert 'sluice_route_decisions_total{backend="remote",reason="queue_wait",tier="standard"}' in metrics


async def _metrics(base: str, tmp_path=None) -> str:
    """/metrics; with keys (tmp_path's keys file) it needs an admin key, made here."""
    import aiohttp
    headers = {}
    if tmp_path is not None:
        from gateway.admission.keys import KeyStore
        headers["Authorization"] = "Bearer " + KeyStore(tmp_path / "keys.json").create("ops", "pro", admin=True)
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/metrics", headers=headers) as r:
            return await r.text()


# ---------------------------------------------------------------- limits and usage


async def test_rpm_limit_exact_with_retry_after(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)], keys={"k": "standard"},
                       limits={"keys": {"k": {"rpm": 30}}}) as (base, app, _, keys):
        app[STATE].limiter.clock = lambda: 6000.0 + 12.5  # inside one window, 47.5 s before the next
        res = await asyncio.gather(*[post(base, chat(max_tokens=1), keys["k"]) for _ in range(40)])
        ok = [r for r in res if r[0] == 200]
        limited = [r for r in res if r[0] == 429]
        assert len(ok) == 30 and len(limited) == 10
        assert limited[0][1]["Retry-After"] == "48" and limited[0][2]["error"]["code"] == "rate_limit_exceeded"
        assert a.count == 30


async def test_tpm_limit_within_a_few_percent(tmp_path, providers):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)], keys={"k": "standard"},
                       limits={"tiers": {"standard": {"tpm": 1000}}}) as (base, app, _, keys):
        app[STATE].limiter.clock = lambda: 6000.0
        served = 0
        for _ in range(200):  # 2 prompt + 8 completion tokens each
            st, _, body = await post(base, chat(), keys["k"])
            if st == 429:
                break
            served += body["usage"]["total_tokens"]
        assert 1000 <= served <= 1030


async def test_budget_refuses_once_spent(tmp_path, providers):
    a, _ = providers
    # each request costs 2 * 1/1e6 + 8 * 2/1e6 = 18e-6
    async with gateway(tmp_path, [provider_cfg(a)], keys={"k": "standard"},
                       limits={"keys": {"k": {"budget": 50e-6}}}) as (base, app, _, keys):
        codes = [(await post(base, chat(), keys["k"]))[0] for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        st, _, body = await post(base, chat(), keys["k"])
        assert body["error"]["code"] == "insufficient_quota"


async def test_usage_totals_equal_the_sum_of_responses(tmp_path, providers):
    a, b = providers
    a.cached_tokens = 1
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1, input_price_per_m=3.0)],
                       keys={"k": "pro", "other": "pro"}) as (base, app, _, keys):
        want = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "requests": 0}
        cost = 0.0
        bodies = [chat(content="one two three", max_tokens=3), chat(LOCAL_MODEL, max_tokens=5),
                  chat(stream=True, stream_options={"include_usage": True}),
                  chat(LOCAL_MODEL, stream=True, max_tokens=4, stream_options={"include_usage": True}),
                  {"model": REMOTE_MODEL, "prompt": "x y", "max_tokens": 2}]
        a.faults = [(), (), ("status", 500)]  # the third remote call fails over to b
        for body in bodies:
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            st, h, resp = await post(base, body, keys["k"], path=path)
            assert st == 200
            u = resp["usage"] if isinstance(resp, dict) else resp[-2]["usage"]
            want["prompt_tokens"] += u["prompt_tokens"]
            want["completion_tokens"] += u["completion_tokens"]
            want["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
            want["requests"] += 1
            be = h["x-sluice-backend"]
            if be != "local":
                pin = 1.0 if be == "remote:a" else 3.0
                cost += (u["prompt_tokens"] * pin + u["completion_tokens"] * 2.0) / 1e6
        await post(base, chat(), keys["other"])  # someone else's usage is not ours
        import aiohttp
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/usage", headers={"Authorization": f"Bearer {keys['k']}"}) as r:
                usage = await r.json()
        t = usage["totals"]
        assert {k: t[k] for k in want} == want
        assert t["cost"] == pytest.approx(cost)
        assert set(usage["by_backend"]) == {"local", "remote:a", "remote:b"}
        assert usage["by_model"][LOCAL_MODEL]["requests"] == 2
        metrics = await _metrics(base, tmp_path)
        assert any(line.startswith('sluice_usage_tokens_total{backend="remote:b",key="')  # key: a short id
                   and 'kind="prompt",model="remote-model"}' in line for line in metrics.splitlines())
        for name in ("sluice_ttft_seconds_bucket", "sluice_inter_token_seconds_bucket", "sluice_e2e_seconds_bucket",
                     "sluice_queue_seconds_bucket", "sluice_queue_depth", "sluice_engine_busy_ratio"):
            assert name in metrics, name


async def test_overload_is_a_fast_503_not_a_growing_queue(tmp_path, providers):
    a, _ = providers
    a.ttft_s = 0.5
    async with gateway(tmp_path, [provider_cfg(a, max_concurrent=2)]) as (base, *_):
        t0 = time.monotonic()
        tasks = [asyncio.create_task(post(base, chat())) for _ in range(6)]
        await asyncio.sleep(0.05)
        res = await asyncio.gather(*tasks)
        codes = sorted(st for st, _, _ in res)
        assert codes == [200, 200, 503, 503, 503, 503]
        refused = [(h, b) for st, h, b in res if st == 503]
        assert all(h["Retry-After"] == "1" for h, _ in refused)
        assert "concurrency limit" in refused[0][1]["error"]["message"]
        assert a.count == 2 and time.monotonic() - t0 < 1.5
