"""Provider faults, injected by the mock provider, through the gateway: answers that are not
JSON, bad provider config, credentials the provider refuses, usage after a mid-stream drop, the
overflow estimate with few completions, and 429s as back-pressure rather than faults."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time

import aiohttp
import pytest
from pydantic import ValidationError

from gateway.settings import ProviderSettings
from gateway.state import STATE
from tests.fixtures.fake_engine import FakeEngine
from tests.fixtures.providers import LOCAL_MODEL, chat, gateway, post, provider_cfg, stream_text


async def _get(base: str, path: str, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(base + path, headers=headers) as r:
            return r.status, (await r.json() if "json" in r.content_type else await r.text())


def _attempts(app, provider: str, outcome: str) -> float:
    v = app[STATE].metrics.attempts.labels(provider, outcome)._value.get()
    return v


# ---------------------------------------------------------------- 11: a 200 that is not JSON / not SSE


@pytest.mark.parametrize("fault,stream", [(("html",), False), (("bad_json",), False),
                                          (("bad_json",), True), (("html",), True)])
async def test_unparseable_200_is_a_provider_failure(tmp_path, providers, caplog, fault, stream):
    a, b = providers
    a.faults = [fault]
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, app, *_):
        with caplog.at_level(logging.WARNING, logger="sluice.remote"):
            st, h, body = await post(base, chat(stream=stream))
        assert st == 200, body
        assert h["x-sluice-backend"] == "remote:b"
        if stream:
            assert stream_text(body) == "w0 w1 w2 w3 w4 w5 w6 w7"
            assert not any("error" in e for e in body if isinstance(e, dict))
        pa = app[STATE].remote.providers[0]
        assert pa.breaker.consecutive == 1  # counted against a
        assert _attempts(app, "a", "bad_response") == 1
        assert any("provider a failed" in r.getMessage() for r in caplog.records)


async def test_unparseable_200_without_fallback_is_a_503_not_a_400(tmp_path, providers):
    a, _ = providers
    a.default_fault = ("html",)
    async with gateway(tmp_path, [provider_cfg(a)], routing={"max_attempts": 2}) as (base, *_):
        st, h, body = await post(base, chat())
        assert st == 503, body
        assert body["error"]["code"] == "upstream_unavailable"
        assert "a: " in body["error"]["message"] and "Malformed JSON body" not in body["error"]["message"]
        assert a.count == 2


# ---------------------------------------------------------------- 12: provider config and unclassified errors


@pytest.mark.parametrize("url,words", [("http://user:secret@api.example.com/v1", "credentials"),
                                       ("ftp://api.example.com/v1", "http"),
                                       ("api.example.com/v1", "http"),
                                       ("http:///v1", "host"),
                                       ("http://api.example.com/v1?key=x", "query")])
def test_bad_base_url_is_refused_at_start(url, words):
    with pytest.raises(ValidationError) as ei:
        ProviderSettings(name="p", base_url=url, models={"m": "m"})
    msg = str(ei.value)
    assert words in msg
    assert "secret" not in msg  # the password is never echoed
    from gateway.settings import Settings

    with pytest.raises(ValidationError) as ei:  # as the gateway loads it: an error at start
        Settings(providers=[{"name": "p", "base_url": url, "models": {"m": "m"}}])
    assert "providers.0.base_url" in str(ei.value) and "secret" not in str(ei.value)


def test_duplicate_provider_names_are_refused_at_start():
    from gateway.backends.remote.backend import RemoteBackend
    from gateway.settings import RoutingSettings

    with pytest.raises(ValueError, match="duplicate"):
        RemoteBackend([ProviderSettings(name="p", base_url="http://x/v1", models={"m": "m"}),
                       ProviderSettings(name="p", base_url="http://y/v1", models={"m": "m"})], RoutingSettings())


async def test_unclassified_provider_error_fails_over(tmp_path, providers, caplog):
    """An error no rule knows (here aiohttp's ValueError for credentials in the URL, with the config
    check bypassed) is a failure of that provider: the next one serves, it is counted and logged."""
    a, b = providers
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, app, *_):
        pa = app[STATE].remote.providers[0]
        pa.urls = {e: u.replace("http://", "http://u:p@") for e, u in pa.urls.items()}
        with caplog.at_level(logging.WARNING, logger="sluice.remote"):
            st, h, body = await post(base, chat())
            assert st == 200, body
            assert h["x-sluice-backend"] == "remote:b"
            st, h, events = await post(base, chat(stream=True))
            assert st == 200 and h["x-sluice-backend"] == "remote:b"
        assert pa.breaker.consecutive == 2 and _attempts(app, "a", "error") == 2
        assert any("provider a failed" in r.getMessage() and "ValueError" in r.getMessage()
                   for r in caplog.records)


# ---------------------------------------------------------------- 13: credentials


async def test_unset_api_key_env_warns_at_start_and_shows_in_ready(tmp_path, providers, caplog):
    a, _ = providers
    os.environ.pop("SLUICE_TEST_UNSET_KEY", None)
    with caplog.at_level(logging.WARNING, logger="sluice.remote"):
        async with gateway(tmp_path, [provider_cfg(a, api_key_env="SLUICE_TEST_UNSET_KEY")]) as (base, *_):
            assert any("SLUICE_TEST_UNSET_KEY" in r.getMessage() and r.levelno >= logging.WARNING
                       for r in caplog.records)
            st, ready = await _get(base, "/ready")
            assert "SLUICE_TEST_UNSET_KEY" in ready["providers"]["a"]["error"]


async def test_401_is_a_config_error_opens_the_breaker_and_fails_over(tmp_path, providers, caplog):
    a, b = providers
    a.default_fault = ("status", 401)
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)]) as (base, app, *_):
        with caplog.at_level(logging.WARNING, logger="sluice.remote"):
            st, h, _ = await post(base, chat())
        assert st == 200 and h["x-sluice-backend"] == "remote:b"
        assert a.count == 1
        pa = app[STATE].remote.providers[0]
        assert pa.breaker.state == "open"
        st, h, _ = await post(base, chat())
        assert h["x-sluice-backend"] == "remote:b" and a.count == 1  # not called while open
        st, ready = await _get(base, "/ready")
        pr = ready["providers"]["a"]
        assert pr["circuit"] == "open" and "401" in pr["error"] and "SLUICE_TEST_A_KEY" in pr["error"]
        assert ready["providers"]["b"]["circuit"] == "closed" and ready["providers"]["b"].get("error") is None
        assert any("401" in r.getMessage() and "SLUICE_TEST_A_KEY" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_credentials_without_fallback_answer_at_once(tmp_path, providers, status):
    a, _ = providers
    a.default_fault = ("status", status)
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, *_):
        for _ in range(2):
            t0 = time.monotonic()
            st, h, body = await post(base, chat())
            assert time.monotonic() - t0 < 1.0
            assert st == 503 and body["error"]["code"] == "upstream_misconfigured", body
            assert body["error"]["type"] != "overloaded_error"
            assert f"HTTP {status}" in body["error"]["message"]
        assert a.count == 1  # no retry, and not called again while its breaker is open


# ---------------------------------------------------------------- 14: usage and the error after a drop


async def test_mid_stream_drop_client_usage_equals_billing_and_names_the_provider(tmp_path, providers):
    a, b = providers
    a.faults = [("drop_after", 3)]
    async with gateway(tmp_path, [provider_cfg(a), provider_cfg(b, order=1)], keys={"k": "pro"}) \
            as (base, app, _, keys):
        st, h, events = await post(base, chat(stream=True, stream_options={"include_usage": True}), keys["k"])
        assert st == 200 and stream_text(events) == "w0 w1 w2"
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1
        err = errors[0]
        assert err["code"] == "provider_error" and err["type"] == "server_error"
        assert "`a`" in err["message"] and "mid-stream" in err["message"]
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert len(usage) == 1
        st, billed = await _get(base, "/v1/usage", keys["k"])
        t = billed["totals"]
        assert usage[0]["completion_tokens"] == t["completion_tokens"] == 3
        assert usage[0]["prompt_tokens"] == t["prompt_tokens"]


# ---------------------------------------------------------------- 15: the overflow estimate


async def test_overflow_estimate_without_recent_completions(tmp_path, providers):
    """One slot, busy with a long request, no completion yet: the estimate comes from the engine's step
    rate, so a standard request goes remote instead of waiting seconds behind it."""
    a, _ = providers
    engine = FakeEngine(max_running_requests=1, max_model_len=1024, step_s=0.01)
    tiers = {"pro": {"priority": 0}, "standard": {"priority": 1, "max_queue_wait_ms": 300}}
    async with gateway(tmp_path, [provider_cfg(a)], engine=engine, tiers=tiers) as (base, app, *_):
        estimator = app[STATE].router.estimator
        long = asyncio.create_task(post(base, chat(LOCAL_MODEL, max_tokens=300)))  # ~3 s
        for _ in range(40):  # the step rate is measured while it runs
            await asyncio.sleep(0.05)
            estimator.sample_steps()
            if estimator.step_seconds() is not None:
                break
        assert not long.done() and estimator.completion_rate() == 0
        est = await estimator.estimate_wait("standard")
        assert math.isfinite(est) and est > 0.3
        t0 = time.monotonic()
        st, h, _ = await post(base, chat(LOCAL_MODEL, max_tokens=4))
        assert st == 200 and h["x-sluice-backend"] == "remote:a"
        assert time.monotonic() - t0 < 1.0
        st, h, _ = await long
        assert st == 200 and h["x-sluice-backend"] == "local"


async def test_infinite_estimate_is_not_logged_as_minus_one(tmp_path, providers, caplog):
    a, _ = providers
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, app, *_):
        router = app[STATE].router
        from engine import SamplingParams
        from gateway.messages import GenerationRequest
        from gateway.openai.schema import ChatCompletionRequest
        req = ChatCompletionRequest(**chat(LOCAL_MODEL))
        gen = GenerationRequest(request_id="r1", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=4),
                                model=LOCAL_MODEL, api=req)
        with caplog.at_level(logging.INFO, logger="sluice.router"):
            stream = await router._remote(gen, "queue_wait", time.monotonic(), math.inf)
            await stream.aclose()
        msgs = [r.getMessage() for r in caplog.records if "queue_wait" in r.getMessage()]
        assert msgs and "-1 ms" not in msgs[0] and "unknown" in msgs[0]


# ---------------------------------------------------------------- 16: 429 is back-pressure


async def test_429s_do_not_open_the_breaker(tmp_path, providers):
    a, _ = providers
    a.default_fault = ("status", 429)
    async with gateway(tmp_path, [provider_cfg(a)], routing={"breaker_failures": 2}) as (base, app, *_):
        pa = app[STATE].remote.providers[0]
        for _ in range(4):
            t0 = time.monotonic()
            st, h, body = await post(base, chat())
            assert st == 429 and body["error"]["code"] == "upstream_rate_limited"
            assert "Retry-After" in h
            assert time.monotonic() - t0 < 1.5
        assert pa.breaker.state == "closed" and pa.breaker.consecutive == 0
        a.default_fault = None
        st, h, _ = await post(base, chat())
        assert st == 200 and h["x-sluice-backend"] == "remote:a"


async def test_inside_a_retry_after_window_nothing_else_answers_429_at_once(tmp_path, providers):
    a, _ = providers
    a.faults = [("status", 429, 2)]
    async with gateway(tmp_path, [provider_cfg(a)]) as (base, app, *_):
        first = asyncio.create_task(post(base, chat()))  # it got the 429 itself: waits 2 s and retries
        for _ in range(100):
            await asyncio.sleep(0.02)
            if a.count:
                break
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        st, h, body = await post(base, chat())  # arrives inside a's window: told so at once
        assert time.monotonic() - t0 < 0.5
        assert st == 429 and body["error"]["code"] == "upstream_rate_limited", body
        assert h["Retry-After"] in ("1", "2")
        assert a.count == 1
        st, h, _ = await first
        assert st == 200 and a.count == 2
        assert app[STATE].remote.providers[0].breaker.consecutive == 0
