"""Request parsing, templating and tokenizing off the event loop (gateway/http/offload.py): huge requests
leave /health fast on the real gateway, and the size bounds are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid

import aiohttp
import openai
import pytest

from tests.fixtures.fake_gateway import fake_gateway

MSG = [{"role": "user", "content": "hi"}]


def _client(base: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


async def _health_latencies_during(base: str, send) -> tuple[list[float], object]:
    """Probe /health every 10 ms while `send()` runs; returns the probe latencies and send()'s result."""
    latencies: list[float] = []
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(send(s))
        while not task.done():
            t0 = time.perf_counter()
            async with s.get(base + "/health") as r:
                assert r.status == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)
        return latencies, task.result()


def _p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.serial
async def test_huge_requests_leave_health_fast(real_gateway):
    gw = real_gateway
    headers = {"Authorization": f"Bearer {gw.key}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.base + "/v1/models", headers=headers) as r:
            model = (await r.json())["data"][0]["id"]

    def poster(body: dict):
        data = json.dumps(body).encode()

        async def send(s: aiohttp.ClientSession):
            t0 = time.perf_counter()
            async with s.post(gw.base + "/v1/chat/completions", data=data, headers=headers) as r:
                return r.status, await r.json(), time.perf_counter() - t0
        return send

    # 100,000 one-character messages (3.4 MB): refused with a 400 that says why, without a stall.
    many = {"model": model, "messages": [{"role": "user", "content": "a"}] * 100_000, "max_tokens": 1}
    lat, (status, body, _) = await _health_latencies_during(gw.base, poster(many))
    assert status == 400 and body["error"]["code"] == "too_many_messages", body
    assert _p99(lat) < 0.05, f"/health p99 {_p99(lat) * 1000:.1f} ms while parsing 100k messages"

    # 1,200 messages of ~720 characters (0.87 MB, under every bound): templated and tokenized off the loop,
    # cut to the context (prompt_truncation), and answered.
    words = " ".join(f"word{i}" for i in range(100))
    long = {"model": model, "max_tokens": 1, "prompt_truncation": "middle",
            "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} {words}"} for _ in range(1200)]}
    lat, (status, body, took) = await _health_latencies_during(gw.base, poster(long))
    assert status == 200, body
    assert len(lat) >= 10, f"the request took {took:.2f}s: too short to tell"
    assert _p99(lat) < 0.05, f"/health p99 {_p99(lat) * 1000:.1f} ms (median {statistics.median(lat) * 1000:.1f})"


async def test_size_bounds_are_400s_naming_the_field(tmp_path):
    async with fake_gateway(tmp_path, server={"max_messages": 10, "max_prompt_chars": 1000}) as (base, app, _):
        c = _client(base)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="fake-model", messages=MSG * 11)
        assert e.value.body["param"] == "messages" and e.value.body["code"] == "too_many_messages"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x" * 1001}])
        assert e.value.body["code"] == "prompt_too_long"
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="fake-model", prompt="x" * 1001)
        assert e.value.body["param"] == "prompt" and e.value.body["code"] == "prompt_too_long"
        r = await c.chat.completions.create(model="fake-model", messages=MSG * 10, max_tokens=2)
        assert r.choices[0].finish_reason == "length"


async def test_the_preparation_helper_runs_at_a_lower_priority():
    """The helper does one large request's work: it must not take the CPU from the engine's steps."""
    import os

    from gateway.http.offload import CHILD_NICENESS, Offloader, RequestLimits
    from gateway.openai.schema import CompletionRequest

    off = Offloader(RequestLimits(), inline_body_bytes=16)
    try:
        body = json.dumps({"model": "m", "prompt": "x" * 1000}).encode()
        req = await off.parse(body, CompletionRequest)  # larger than inline: parsed in the helper
        assert req.prompt == "x" * 1000
        pids = list(off._pool._processes)  # type: ignore[union-attr]
        assert pids
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + CHILD_NICENESS) for pid in pids)
    finally:
        off.close()


def test_the_helper_leaves_when_its_gateway_is_killed(tmp_path):
    """SIGKILL of the gateway process: its helper (and the resource tracker holding the helper's pipe) must not
    live on as orphans."""
    import os
    import signal
    import subprocess
    import sys

    from tests.fixtures.servers import ROOT

    script = (
        "import asyncio, json, time\n"
        "from gateway.http.offload import Offloader, RequestLimits\n"
        "from gateway.openai.schema import CompletionRequest\n"
        "async def main():\n"
        "    off = Offloader(RequestLimits(), inline_body_bytes=16)\n"
        "    await off.parse(json.dumps({'model': 'm', 'prompt': 'x' * 100}).encode(), CompletionRequest)\n"
        "    print(*off._pool._processes, flush=True)\n"
        "    time.sleep(60)\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        helper = int(proc.stdout.readline().split()[0])  # type: ignore[union-attr]
        os.kill(helper, 0)  # alive
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.kill(helper, 0)
            except ProcessLookupError:
                break
            # reparented to init (or a subreaper): reap it if it became our child
            with __import__("contextlib").suppress(ChildProcessError):
                os.waitpid(helper, os.WNOHANG)
            time.sleep(0.2)
        else:
            raise AssertionError(f"the helper {helper} outlived its killed gateway")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.serial
async def test_starting_the_helper_does_not_stall_the_event_loop():
    """The helper starts on first use with the pickled tokenizer (megabytes) written into a pipe that the
    new process reads only once its interpreter is up. Written from the event loop, that stalled every
    stream for the helper's start (3.2 s under load, measured); it must happen off the loop."""
    from gateway.http.offload import Offloader, RequestLimits
    from tests.fixtures.big_tokenizer import BigTokenizer

    tok = BigTokenizer()
    off = Offloader(RequestLimits(), inline_prompt_chars=10)
    off.set_tokenizer(tok)
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        ids = await off.encode(tok, "one three five seven " * 10)  # long: tokenized in the (new) helper
        assert list(ids) == [3, 5, 4, 5] * 10
    finally:
        done.set()
        await ticker
        off.close()
    assert len(gaps) > 5, "the helper started too fast to tell"
    assert max(gaps) < 0.15, f"the event loop stalled {max(gaps):.2f}s while the helper started"


def test_a_gateway_stopping_while_its_helper_starts_leaves_no_stack_trace():
    """Stopped right after start (SIGTERM at once after /ready), the gateway exited while the new helper
    still unpickled its start-up arguments, and the helper printed a FileNotFoundError stack trace."""
    import subprocess
    import sys

    script = (
        "import asyncio\n"
        "from gateway.http.offload import Offloader, RequestLimits\n"
        "from tests.fixtures.big_tokenizer import BigTokenizer\n"
        "async def main():\n"
        "    off = Offloader(RequestLimits())\n"
        "    off.set_tokenizer(BigTokenizer())\n"
        "    off.warm()\n"
        "    await asyncio.sleep(0.05)\n"
        "    off.close()\n"
        "asyncio.run(main())\n"
        "print('closed')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
