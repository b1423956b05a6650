"""The distributed path end to end: a real redis-server (AOF), two `sluice serve --no-engine` gateways
and two `sluice worker` processes with the real engine (fp32, greedy: answers are comparable), plus one
`sluice worker --model all-MiniLM-L6-v2` draining the embedding model's own queue.

One cluster for the module, the scenarios in order: 200 concurrent requests; a worker SIGKILLed
mid-stream; a cancelled stream; Redis restarted mid-run; a batch whose gateway and then a worker are
SIGKILLed; a rolling restart of every process under load.
Every answer is compared with the same request answered alone before the trouble starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.fixtures.servers import ROOT, RedisServer, _have_redis_server, free_port

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.model]

PROMPTS = [f"Write one sentence about {t}." for t in
           ("the sea", "a robot", "coffee", "trains", "owls", "bread", "rain", "chess")]
MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path):
        self.args, self.env, self.log = args, env, log
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env=env, cwd=ROOT,
                                     stdout=open(log, "a"), stderr=subprocess.STDOUT)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.redis = RedisServer(tmp / "redis")
        self.redis.start()
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT),
                    "SLUICE_REDIS_URL": self.redis.url, "SLUICE_AUTH__KEYS_FILE": str(tmp / "keys.json"),
                    "SLUICE_ENGINE__KV_CACHE_TOKENS": "8192", "SLUICE_ENGINE__WIDE_MIN_ROWS": "0",
                    "SLUICE_ENGINE__MAX_RUNNING_REQUESTS": "128",
                    "SLUICE_QUEUE__LEASE_S": "2", "SLUICE_QUEUE__HEARTBEAT_S": "0.5",
                    "SLUICE_QUEUE__FILL_TARGET": "1", "SLUICE_QUEUE__MAX_WAIT_MS": "0",
                    "SLUICE_BATCHES__LEASE_S": "3", "SLUICE_BATCHES__MAX_IN_FLIGHT": "4"}
        self.env.pop("SLUICE_CONFIG", None)
        self.gateways: list[tuple[Proc, int]] = []
        self.workers: list[Proc] = []
        self.embedding_worker: Proc | None = None
        self.n = 0

    def _log(self, name: str) -> Path:
        self.n += 1
        return self.tmp / f"{self.n:02d}-{name}.log"

    def start_worker(self) -> Proc:
        env = {**self.env, "SLUICE_SERVER__SHUTDOWN_GRACE_S": "1"}  # short: exercises the hand-back
        w = Proc(["worker"], env, self._log("worker"))
        self.workers.append(w)
        return w

    def start_embedding_worker(self) -> Proc:
        self.embedding_worker = Proc(["worker", "--model", EMBEDDING_MODEL], self.env, self._log("embedding-worker"))
        return self.embedding_worker

    def start_gateway(self) -> tuple[Proc, int]:
        port = free_port()
        env = {**self.env, "SLUICE_SERVER__SHUTDOWN_GRACE_S": "30"}
        g = (Proc(["serve", "--no-engine", "--port", str(port)], env, self._log("gateway")), port)
        self.gateways.append(g)
        return g

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for g, p in self.gateways if g.proc.poll() is None]

    def redis_client(self):
        import redis

        return redis.Redis.from_url(self.redis.url, decode_responses=True)

    def live_workers(self) -> list[dict]:
        r = self.redis_client()
        try:
            ids = r.zrange("sluice:workers", 0, -1)
            vals = r.mget([f"sluice:worker:{i}" for i in ids]) if ids else []
            return [json.loads(v) for v in vals if v]
        finally:
            r.close()

    async def wait_ready(self, workers: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                ok = 0
                for url in self.urls:
                    try:
                        async with s.get(url + "/ready") as r:
                            body = await r.json()
                            if r.status == 200 and body["workers"]["alive"] >= workers:
                                ok += 1
                    except (aiohttp.ClientError, KeyError):
                        pass
                if ok == len(self.urls) and ok > 0:
                    return
                for p in [g for g, _ in self.gateways] + self.workers:
                    rc = p.proc.poll()
                    if rc not in (None, 0, -signal.SIGKILL):
                        raise RuntimeError(f"{p.args} exited {rc}:\n{p.log.read_text()[-3000:]}")
                if time.time() > deadline:
                    raise RuntimeError("cluster not ready in time")
                await asyncio.sleep(0.2)

    def stop(self) -> None:
        for p in [g for g, _ in self.gateways] + self.workers + [w for w in [self.embedding_worker] if w]:
            p.signal(signal.SIGKILL)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.redis.stop(kill=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not _have_redis_server():
        pytest.skip("redis-server is not installed")
    c = Cluster(tmp_path_factory.mktemp("dist"))
    c.start_embedding_worker()  # /ready needs every model's workers
    for _ in range(2):
        c.start_worker()
        c.start_gateway()
    asyncio.run(c.wait_ready(workers=2))
    yield c
    c.stop()


def body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


async def ask(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> str:
    async with s.post(url + "/v1/chat/completions", json=body(prompt, max_tokens)) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
        assert data["usage"]["completion_tokens"] <= max_tokens
        return data["choices"][0]["message"]["content"]


async def stream(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                 got_first: asyncio.Event | None = None) -> tuple[str, str | None]:
    text, finish = [], None
    async with s.post(url + "/v1/chat/completions", json=body(prompt, max_tokens, stream=True)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice.get("finish_reason") or finish
            if got_first is not None and "".join(text):
                got_first.set()
    return "".join(text), finish


@pytest.fixture(scope="module")
def reference(cluster) -> dict[tuple[str, int], str]:
    """Each prompt answered alone (no concurrency) with 6, 24 and 48 tokens."""
    async def run():
        out = {}
        async with aiohttp.ClientSession() as s:
            for n in (6, 24, 48):
                answers = await asyncio.gather(*(ask(s, cluster.urls[0], p, n) for p in PROMPTS))
                out.update({(p, n): a for p, a in zip(PROMPTS, answers)})
        return out
    return asyncio.run(run())


async def test_200_concurrent_across_two_gateways_and_two_workers(cluster, reference):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        urls = cluster.urls
        jobs = [(PROMPTS[i % len(PROMPTS)], urls[i % 2]) for i in range(200)]
        answers = await asyncio.gather(*(ask(s, url, p, 6) for p, url in jobs))
    wrong = [(p, a) for (p, _), a in zip(jobs, answers) if a != reference[(p, 6)]]
    assert not wrong, wrong[:5]
    served = {w["worker_id"] for w in cluster.live_workers()}
    assert len(served) == 2


async def test_embeddings_go_through_their_own_queue_to_their_worker(cluster):
    """/v1/embeddings on either gateway is served by the embedding worker (its model's queue, not the chat
    workers'), with the vectors the engine gives in-process, while chat requests run beside them."""
    from engine import EmbeddingConfig, EmbeddingEngine

    texts = ["a cat on a mat", "the sea at night", "trains leave at noon"]
    async with aiohttp.ClientSession() as s:
        async def embed(url: str) -> tuple[dict, str]:
            async with s.post(url + "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": texts,
                                                           "encoding_format": "float"}) as r:
                assert r.status == 200, await r.text()
                return await r.json(), r.headers["x-sluice-backend"]
        results = await asyncio.gather(*(embed(u) for u in cluster.urls),
                                       *(ask(s, u, PROMPTS[0], 6) for u in cluster.urls))
    reference = EmbeddingEngine(EmbeddingConfig(dtype="float32")).embed(texts).tolist()
    for body_, backend in results[:len(cluster.urls)]:  # type: ignore[misc]
        assert backend == "local" and body_["model"] == EMBEDDING_MODEL
        for got, want in zip(body_["data"], reference):
            cos = sum(a * b for a, b in zip(got["embedding"], want))
            assert cos > 0.999, cos
    r = cluster.redis_client()
    try:  # the embedding worker heartbeats under its model's queue, the chat workers under the deployment's
        assert r.zcard(f"sluice:model:{EMBEDDING_MODEL}:workers") == 1
        assert all(w["model"] == MODEL for w in cluster.live_workers())
    finally:
        r.close()


async def test_worker_sigkill_mid_stream_every_client_completes(cluster, reference):
    firsts = [asyncio.Event() for _ in PROMPTS]
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream(s, cluster.urls[i % 2], p, 48, firsts[i]))
                 for i, p in enumerate(PROMPTS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        # The worker that holds most of the running requests right now (lease owners in Redis).
        rc = cluster.redis_client()
        owners = [rc.hget(k, "owner") for k in rc.keys("sluice:item:*")]
        rc.close()
        owners = [o for o in owners if o]
        assert owners, "every stream finished before the kill: make them longer"
        busiest = max(set(owners), key=owners.count)
        victim = next(w for w in cluster.workers if w.proc.pid == int(busiest.split("-")[-2]))
        victim.signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    for p, (text, finish) in zip(PROMPTS, results):
        assert text == reference[(p, 48)], (p, text)  # no token lost, none repeated
        assert finish in ("length", "stop")
    cluster.workers.remove(victim)
    cluster.start_worker()  # back to two for what follows (checked ready below)


async def test_cancelled_stream_leaves_the_worker(cluster):
    async with aiohttp.ClientSession() as s:
        r = await s.post(cluster.urls[0] + "/v1/chat/completions", json=body(PROMPTS[0], 1000, stream=True))
        assert r.status == 200
        chunks = 0
        async for line in r.content:
            if line.startswith(b"data: "):
                chunks += 1
                if chunks >= 3:
                    break
        r.close()  # the client goes away
    # The worker counts a request out when the engine finishes it, and its lease and item go when that
    # last output is published after: on a loaded machine the count can reach 0 a moment before them.
    rc = cluster.redis_client()

    def left() -> tuple[int, int, int]:
        return (sum(w["in_flight"] for w in cluster.live_workers()), rc.zcard("sluice:leased"),
                len(rc.keys("sluice:item:*")))

    deadline = time.time() + 10
    while time.time() < deadline and left() != (0, 0, 0):
        await asyncio.sleep(0.1)
    assert left() == (0, 0, 0)
    rc.close()


async def test_redis_restart_mid_run_recovers(cluster, reference):
    await cluster.wait_ready(workers=2)
    firsts = [asyncio.Event() for _ in PROMPTS]
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream(s, cluster.urls[i % 2], p, 24, firsts[i]))
                 for i, p in enumerate(PROMPTS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        await asyncio.to_thread(cluster.redis.restart, 1.0)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        # And new requests are served after the restart, without restarting anything else.
        after = await asyncio.gather(*(ask(s, cluster.urls[i % 2], p, 6) for i, p in enumerate(PROMPTS)))
    for p, (text, _finish) in zip(PROMPTS, results):
        assert text == reference[(p, 24)], (p, text)
    assert after == [reference[(p, 6)] for p in PROMPTS]


def _batch_runner_pid(cluster: Cluster, batch_id: str) -> int | None:
    import sqlite3

    with sqlite3.connect(cluster.tmp / "files" / "batches.sqlite3") as db:
        row = db.execute("SELECT runner FROM batches WHERE id = ?", (batch_id,)).fetchone()
    return int(row[0].split("-")[0]) if row and row[0] else None


def _results(cluster: Cluster, batch_id: str) -> int:
    import sqlite3

    with sqlite3.connect(cluster.tmp / "files" / "batches.sqlite3") as db:
        return db.execute("SELECT count(*) FROM results WHERE batch_id = ?", (batch_id,)).fetchone()[0]


async def test_a_batch_survives_sigkill_of_its_gateway_then_of_a_worker(cluster, reference):
    """The Redis path: a greedy chat batch; the gateway running it is SIGKILLed and the other gateway takes
    it over (the batch's lease); then the worker holding most of its lines is SIGKILLed (the queue's lease).
    Every line is answered once, each equal to the same request answered alone."""
    import openai

    await cluster.wait_ready(workers=2)
    n = 32  # 4 at a time (the cluster's [batches] max_in_flight): the batch outlasts both kills
    lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {k: v for k, v in body(PROMPTS[i % len(PROMPTS)], 48).items() if k != "stream"}}
             for i in range(n)]
    c = openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="unused", max_retries=0)
    f = await c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    async def until(cond, what: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while not cond():
            assert time.time() < deadline, what
            await asyncio.sleep(0.05)

    await until(lambda: _results(cluster, batch.id) >= 2, "no line answered")
    pid = _batch_runner_pid(cluster, batch.id)
    victim = next((g, port) for g, port in cluster.gateways if g.proc.pid == pid)
    victim[0].signal(signal.SIGKILL)
    cluster.gateways.remove(victim)
    at_kill = _results(cluster, batch.id)
    assert at_kill < n, "the batch finished before the kill: make it longer"
    await until(lambda: _batch_runner_pid(cluster, batch.id) not in (None, pid) and
                _results(cluster, batch.id) >= at_kill + 2, "the other gateway did not take the batch over")
    rc = cluster.redis_client()
    owners = [o for o in (rc.hget(k, "owner") for k in rc.keys("sluice:item:*")) if o]
    rc.close()
    assert owners and _results(cluster, batch.id) < n, "no line in flight at the worker's kill: make it longer"
    busiest = max(set(owners), key=owners.count)
    worker = next(w for w in cluster.workers if w.proc.pid == int(busiest.split("-")[-2]))
    worker.signal(signal.SIGKILL)
    cluster.workers.remove(worker)

    c = openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="unused", max_retries=0)
    await until(lambda: _results(cluster, batch.id) == n, "lines left unanswered")
    done = batch
    for _ in range(400):
        done = await c.batches.retrieve(batch.id)
        if done.status == "completed":
            break
        await asyncio.sleep(0.05)
    assert done.status == "completed" and done.request_counts.completed == n, done
    out = [json.loads(x) for x in (await c.files.content(done.output_file_id)).text.splitlines()]
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]  # each once, in order
    for o, x in zip(out, lines):
        prompt = x["body"]["messages"][0]["content"]
        assert o["response"]["body"]["choices"][0]["message"]["content"] == reference[(prompt, 48)], o["custom_id"]
    cluster.start_gateway()  # back to two of each for what follows
    cluster.start_worker()


async def test_rolling_restart_under_load_loses_no_request(cluster, reference):
    await cluster.wait_ready(workers=2)
    stop = asyncio.Event()
    accepted: list[tuple[str, str, str | None]] = []  # (prompt, text, finish) of every accepted request
    refused = 0

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        nonlocal refused
        k = i
        while not stop.is_set():
            p = PROMPTS[k % len(PROMPTS)]
            k += 1
            urls = cluster.urls
            url = urls[k % len(urls)]
            try:
                text, finish = await stream(s, url, p, 24)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # never accepted (no connection, or a kept-alive one the stopping gateway closed before the
                # request's body was written): the client (a load balancer) tries again elsewhere
                refused += 1
                await asyncio.sleep(0.1)
                continue
            except AssertionError as e:
                if "503" in str(e) or "shutting" in str(e) or "no_workers" in str(e):
                    refused += 1
                    await asyncio.sleep(0.1)
                    continue
                raise
            accepted.append((p, text, finish))

    async with aiohttp.ClientSession() as s:
        clients = [asyncio.create_task(client(i, s)) for i in range(6)]
        await asyncio.sleep(2)
        # Replacements first (both workers' at once: starting is most of the time), then SIGTERM the old ones
        # one at a time while the rest serve; then the gateways the same way.
        old_workers = list(cluster.workers)
        for _ in old_workers:
            cluster.start_worker()
        await cluster.wait_ready(workers=2 + len(old_workers))
        for old in old_workers:
            old.signal(signal.SIGTERM)
            assert await asyncio.to_thread(old.wait, 60) == 0
            cluster.workers.remove(old)
        old_gateways = [(g, port) for g, port in cluster.gateways if g.proc.poll() is None]
        for _ in old_gateways:
            cluster.start_gateway()
        await cluster.wait_ready(workers=2)
        for old, port in old_gateways:
            old.signal(signal.SIGTERM)
            assert await asyncio.to_thread(old.wait, 60) == 0
            cluster.gateways.remove((old, port))
        await asyncio.sleep(2)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 120)
    assert len(accepted) >= 10
    bad = [(p, t) for p, t, _ in accepted if t != reference[(p, 24)]]
    assert not bad, bad[:3]
