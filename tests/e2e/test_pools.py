"""Engine pools with real replicas: two `sluice serve` processes with the real model (the session's
gateway and one started here, same engine settings) behind a gateway that serves from the pool alone.
Requests spread over both; a replica SIGKILLed under concurrent streams loses none of them (the streams on
it continue on the other, greedy text equal to an uninterrupted run, nothing repeated); it is taken out,
and taken back once restarted. With both full, waiting requests leave pro first, and past the tier's target
a request overflows to a provider or, with none, is refused early with 429."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.admission.keys import KeyStore
from gateway.http.app import create_app
from gateway.settings import Settings
from gateway.state import STATE
from tests.fixtures.servers import ROOT, free_port, wait_http_ok

pytestmark = [pytest.mark.slow, pytest.mark.model]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Write one sentence about the sea.", "List three fruits.", "What is a CPU? Answer briefly.",
           "Say hello in French and in Spanish."]


class Replica:
    """A second `sluice serve` with the session gateway's engine settings and keys, chat model only."""

    def __init__(self, real_gateway, tmp) -> None:
        self.port = free_port()
        self.log = tmp / "replica-b.log"
        cfg = tmp / "replica.toml"
        cfg.write_text('[[models]]\nkind = "chat"\n')
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT), "SLUICE_CONFIG": str(cfg),
                    "SLUICE_AUTH__KEYS_FILE": str(real_gateway.keys_file),
                    "SLUICE_ENGINE__KV_CACHE_TOKENS": "16384", "SLUICE_ENGINE__WIDE_MIN_ROWS": "0",
                    "SLUICE_ENGINE__MAX_MODEL_LEN": "2048"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port)],
                                     env=self.env, cwd=ROOT, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        wait_http_ok(f"http://127.0.0.1:{self.port}/ready", self.proc, self.log)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def replicas(real_gateway, tmp_path_factory):
    b = Replica(real_gateway, tmp_path_factory.mktemp("pool"))
    b.start()
    admin = KeyStore(real_gateway.keys_file).create(f"pool-{os.getpid()}", "pro", admin=True)
    os.environ["SLUICE_TEST_POOL_KEY"] = admin  # requests at pro, and /metrics (an admin key's)
    yield real_gateway, b
    if b.proc is not None and b.proc.poll() is None:
        b.proc.terminate()
        b.proc.wait(20)


def _settings(tmp_path, a, b) -> Settings:
    def engine(name: str, base: str) -> dict:
        return {"name": name, "base_url": base + "/v1", "kind": "sluice", "models": [MODEL],
                "api_key_env": "SLUICE_TEST_POOL_KEY"}
    return Settings(auth={"keys_file": str(tmp_path / "keys.json")}, server={"prepare_helper_at_start": False},
                    engines=[engine("a", a.base), engine("b", f"http://127.0.0.1:{b.port}")],
                    routing={"breaker_failures": 2, "breaker_cooldown_s": 1.0})


async def _stream(s: aiohttp.ClientSession, base: str, prompt: str, n: int, first: asyncio.Event | None = None,
                  ignore_eos: bool = False):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "stream": True, **({"ignore_eos": True} if ignore_eos else {})}
    text = []
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        backend = r.headers["x-sluice-backend"]
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text.append(chunk["choices"][0]["delta"].get("content") or "")
            if first is not None and "".join(text):
                first.set()
    return backend, "".join(text)


async def _loads(*bases: str) -> dict[str, tuple[float, float]]:
    """Each replica's (in flight, waiting) as its /metrics says (the pool's admin key reads them)."""
    from gateway.backends.pool.load import parse_load
    headers = {"Authorization": f"Bearer {os.environ['SLUICE_TEST_POOL_KEY']}"}
    out = {}
    async with aiohttp.ClientSession(headers=headers) as s:
        for base in bases:
            async with s.get(base + "/metrics") as r:
                load = parse_load("sluice", await r.text())
            out[base] = (load.running, load.waiting)
    return out


async def _idle(*bases: str, timeout: float = 120) -> None:
    """Until nothing runs or waits on any of the replicas (what an earlier test left there ends)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = await _loads(*bases)
        if not any(sum(v) for v in loads.values()):
            return
        assert time.monotonic() < deadline, f"replicas still busy after {timeout} s: {loads}"
        await asyncio.sleep(0.2)


async def test_a_pool_of_real_replicas_spreads_survives_a_sigkill_and_takes_the_replica_back(tmp_path, replicas):
    a, b = replicas
    app = create_app(_settings(tmp_path, a, b), keys=KeyStore(tmp_path / "keys.json"), no_engine=True)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    pool = app[STATE].engines
    assert pool is not None
    try:
        async with aiohttp.ClientSession() as s:
            # Reference: each prompt alone on replica a, directly.
            ref = {}
            headers = {"Authorization": f"Bearer {os.environ['SLUICE_TEST_POOL_KEY']}"}
            async with aiohttp.ClientSession(headers=headers) as direct:
                for p in PROMPTS:
                    _, ref[p] = await _stream(direct, a.base, p, 32)
            # Spread: concurrent requests land on both replicas.
            seen = await asyncio.gather(*(_stream(s, base, PROMPTS[i % 4], 8) for i in range(8)))
            assert {bk for bk, _ in seen} == {"engine:a", "engine:b"}
            # SIGKILL b under 8 concurrent streams once each has its first text.
            firsts = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.create_task(_stream(s, base, PROMPTS[i % 4], 32, firsts[i])) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
            b.kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for i, (_, text) in enumerate(results):
                assert text == ref[PROMPTS[i % 4]], (i, text, ref[PROMPTS[i % 4]])
            # Some began on b (the header names where a stream began): those were continued on a.
            assert {bk for bk, _ in results} == {"engine:a", "engine:b"}
            # Taken out: new requests go to a; restarted: taken back.
            rb = next(r for r in pool.replicas if r.name == "b")
            deadline = time.monotonic() + 10
            while rb.breaker.state == "closed" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert rb.breaker.state != "closed"
            assert (await _stream(s, base, PROMPTS[0], 4))[0] == "engine:a"
            await asyncio.to_thread(b.start)
            deadline = time.monotonic() + 15
            while rb.breaker.state != "closed" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert rb.breaker.state == "closed"
            seen = await asyncio.gather(*(_stream(s, base, PROMPTS[i % 4], 8) for i in range(8)))
            assert "engine:b" in {bk for bk, _ in seen}
    finally:
        await server.close()
        await pool.close()


async def test_full_real_replicas_serve_pro_first_then_overflow_or_refuse_early(tmp_path, replicas):
    """Both replicas full (one request each, `max_in_flight = 1`): waiting requests leave Sluice's tier queue
    pro first; past the tier's target a request goes to a provider, or with none is refused at once."""
    from tests.fixtures.mock_provider import MockProvider

    a, b = replicas
    store = KeyStore(tmp_path / "keys.json")
    pro, std = store.create("p", "pro"), store.create("s", "standard")

    def engine(name: str, base: str) -> dict:
        return {"name": name, "base_url": base + "/v1", "kind": "sluice", "models": [MODEL],
                "api_key_env": "SLUICE_TEST_POOL_KEY", "max_in_flight": 1}

    engines = [engine("a", a.base), engine("b", f"http://127.0.0.1:{b.port}")]

    async def serving(target_ms: float, providers: list[dict]):
        # both replicas idle first: a stream of the last gateway's still ending on one would be in this one's
        # first poll of its load (others' requests) until its next, leaving it no room (max_in_flight 1)
        await _idle(a.base, f"http://127.0.0.1:{b.port}")
        settings = Settings(auth={"keys_file": str(tmp_path / "keys.json")}, server={"prepare_helper_at_start": False},
                            engines=engines, providers=providers,
                            tiers={"pro": {"priority": 0, "max_queue_wait_ms": target_ms},
                                   "standard": {"priority": 1, "max_queue_wait_ms": target_ms}})
        app = create_app(settings, keys=store, no_engine=True)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        return app, server, f"http://127.0.0.1:{server.port}"

    async def fill(s: aiohttp.ClientSession, base: str, n: int = 96) -> list[asyncio.Task]:
        """Both replicas busy with a long answer each (`n` tokens), once both have begun (`serving` waited for
        both idle); a filling stream that ends or fails before both began fails here with its error."""
        firsts = [asyncio.Event(), asyncio.Event()]
        busy = [asyncio.create_task(_stream(s, base, PROMPTS[i], n, firsts[i], ignore_eos=n > 96)) for i in range(2)]
        deadline = time.monotonic() + 90
        while not all(f.is_set() for f in firsts):
            ended = [t for t in busy if t.done()]
            assert not ended, f"a filling stream ended before both began: {ended[0].exception() or ended[0].result()}"
            assert time.monotonic() < deadline, (
                f"both replicas had not begun in 90 s: {await _loads(a.base, f'http://127.0.0.1:{b.port}')}")
            await asyncio.sleep(0.05)
        return busy

    def session(key: str) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"})

    app, server, base = await serving(60000, [])
    try:
        async with session(std) as s, session(pro) as p:
            # 384 tokens each (ignore_eos): still running when the waiting requests come 0.3 s later, so these
            # wait in Sluice's queue (with 96, a replica that began first could be done by then)
            busy = await fill(s, base, 384)
            done: list[str] = []

            async def short(sess: aiohttp.ClientSession, who: str) -> None:
                backend, _ = await _stream(sess, base, PROMPTS[2], 4)
                assert backend in ("engine:a", "engine:b")
                done.append(who)

            waiting = [asyncio.create_task(short(s, f"standard{i}")) for i in range(3)]
            await asyncio.sleep(0.3)  # the standard ones wait in Sluice's queue first
            waiting.append(asyncio.create_task(short(p, "pro")))
            await asyncio.wait_for(asyncio.gather(*busy, *waiting), 120)
            # Dispatched in tier order as the replicas free up: pro within the first two, though it came last
            # (first come, first served would start it after two standard ones had finished).
            assert done.index("pro") <= 1, done
    finally:
        await server.close()
        await app[STATE].engines.close()

    os.environ["SLUICE_TEST_UP_KEY"] = "sk-upstream"
    up = await MockProvider("up", tokens=4).start()
    provider = {"name": "up", "base_url": up.base_url, "api_key_env": "SLUICE_TEST_UP_KEY", "models": {MODEL: "up-m"},
                "input_price_per_m": 1.0, "output_price_per_m": 2.0, "timeout_s": 5.0}
    try:
        for providers in ([provider], []):
            app, server, base = await serving(200, providers)
            try:
                async with session(std) as s:
                    # answers far longer than the 200 ms target (the replica that began first must not be near
                    # its end when the request comes), cancelled once it is decided
                    busy = await fill(s, base, 1024)
                    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[3]}], "max_tokens": 4}
                    t0 = time.monotonic()
                    async with s.post(base + "/v1/chat/completions", json=body) as r:
                        answer = await r.json()
                        if providers:  # past the target: overflow to the provider
                            assert r.status == 200 and r.headers["x-sluice-backend"] == "remote:up", answer
                        else:  # no provider: refused at once, not after waiting
                            assert r.status == 429 and answer["error"]["code"] == "engines_busy", answer
                            assert r.headers["Retry-After"]
                            assert time.monotonic() - t0 < 1.0
                    for task in busy:
                        task.cancel()
                    await asyncio.gather(*busy, return_exceptions=True)
            finally:
                await server.close()
                await app[STATE].engines.close()
    finally:
        await up.stop()
