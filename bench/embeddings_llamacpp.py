"""Helpers of bench/embeddings.py's HTTP comparison: the GGUF conversion, llama.cpp's `llama-server
--embeddings`, a `sluice serve` with the embedding model alone, and a client that sends a corpus to an
OpenAI-compatible POST /v1/embeddings the same way to either (requests of n inputs, k in flight)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import psutil

from bench.server import ROOT, free_port, managed_server, sluice_server_process

LLAMA_SERVER = ROOT / "bench" / ".llama-server" / "build" / "bin" / "llama-server"
LLAMA_CPP = ROOT / "bench" / ".llama-server" / "src" / "vendor" / "llama.cpp"
MODEL = "all-MiniLM-L6-v2"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def convert_gguf(model_dir: Path, outtype: str, out_dir: Path, src: Path = LLAMA_CPP) -> tuple[Path, float]:
    """The sentence-transformers folder converted by the vendored llama.cpp's convert_hf_to_gguf.py
    (its own gguf-py): (the .gguf, seconds taken)."""
    out = out_dir / f"{MODEL}-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out),
                           "--outtype", outtype], cwd=src, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return out, time.perf_counter() - t


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, slots: int, ubatch: int,
                 omp_wait_policy: str | None = None) -> Iterator[tuple[str, int]]:
    """`llama-server --embeddings --pooling mean` on a free port: yields (base URL, pid).

    MiniLM's attention is not causal, so every input llama-server puts in a forward must fit one
    physical batch: -b = -ub. Each slot holds one input (512 tokens of context each, the model's
    maximum), and the inputs of the slots that are ready share a forward. omp_wait_policy None:
    llama.cpp's own OpenMP default (what a user who starts llama-server gets)."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--alias", MODEL, "--embeddings", "--pooling", "mean",
           "-t", str(threads), "-np", str(slots), "-c", str(slots * 512), "-b", str(ubatch), "-ub", str(ubatch),
           "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    with managed_server(cmd, f"http://127.0.0.1:{port}/health", env) as proc:
        yield f"http://127.0.0.1:{port}/v1", proc.pid


@contextlib.contextmanager
def sluice_embedding_server(dtype: str, max_batch_tokens: int) -> Iterator[tuple[str, int]]:
    """`sluice serve` (bench/server.py) with all-MiniLM-L6-v2 alone, at the in-process engine's dtype and
    token budget (the chat model of the default configuration would only take memory): (base URL, pid)."""
    models = [{"id": MODEL, "kind": "embedding", "engine": {"dtype": dtype, "max_batch_tokens": max_batch_tokens}}]
    with sluice_server_process({"SLUICE_MODELS": json.dumps(models)}) as (url, proc):
        yield url, proc.pid


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants, all their threads."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan")
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


@dataclass
class HttpResult:
    seconds: float
    server_cpu_seconds: float
    vectors: list[list[float]]
    prompt_tokens: int


class EmbeddingsClient:
    """Sends texts to one server's POST /v1/embeddings in requests of `request_size` inputs, `concurrency`
    of them in flight (each sender takes the next request when its own is answered), over keep-alive
    connections; `encoding_format` float, the vectors parsed as a client would."""

    def __init__(self, loop: asyncio.AbstractEventLoop, url: str, pid: int, request_size: int, concurrency: int):
        self.loop, self.url, self.pid = loop, url + "/embeddings", pid
        self.request_size, self.concurrency = request_size, concurrency
        self.session = loop.run_until_complete(self._session())

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.concurrency),
                                     timeout=aiohttp.ClientTimeout(total=600))

    async def _post(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        body = orjson.dumps({"model": MODEL, "input": inputs, "encoding_format": "float"})
        async with self.session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {r.status}: {raw[:500]!r}")
        out = orjson.loads(raw)
        vectors: list[list[float]] = [[] for _ in inputs]
        for item in out["data"]:
            vectors[item["index"]] = item["embedding"]
        if any(not v for v in vectors):
            raise RuntimeError(f"{self.url}: {sum(not v for v in vectors)} of {len(inputs)} vectors missing")
        return vectors, int(out.get("usage", {}).get("prompt_tokens", 0))

    async def _run(self, texts: list[str]) -> tuple[list[list[float]], int]:
        chunks = [texts[i:i + self.request_size] for i in range(0, len(texts), self.request_size)]
        results: list[tuple[list[list[float]], int] | None] = [None] * len(chunks)
        todo = iter(range(len(chunks)))

        async def sender() -> None:
            for i in todo:
                results[i] = await self._post(chunks[i])

        await asyncio.gather(*(sender() for _ in range(self.concurrency)))
        return [v for r in results for v in r[0]], sum(r[1] for r in results)  # type: ignore[index]

    def run(self, texts: list[str]) -> HttpResult:
        cpu = tree_cpu_seconds(self.pid)
        t = time.perf_counter()
        vectors, tokens = self.loop.run_until_complete(self._run(texts))
        seconds = time.perf_counter() - t
        return HttpResult(seconds, tree_cpu_seconds(self.pid) - cpu, vectors, tokens)

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())


def temp_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="sluice-bench-gguf-")
