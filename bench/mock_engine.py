"""A simulated continuous-batching engine behind an OpenAI-compatible API, for measuring routing across
engine replicas on 2 cores: replicas that cost no CPU to run, with the load signals real engines export.

The model of an engine: at most `--max-running` sequences run at once; the rest wait in a FIFO queue (or by
the request's `priority`, lower first, with `--policy priority`, as vLLM's `--scheduling-policy priority`).
Each step takes `decode_ms + per_seq_ms x running` plus, for sequences admitted in it, `prefill_ms_per_token`
for every prompt token the prefix cache does not hold; every running sequence gets one token per step. The
prefix cache keeps the prompts' leading blocks of `--block-chars` characters (LRU, `--cache-blocks`), so a
request sharing a long prefix with recent traffic prefills only the rest.

It exports vLLM's metric names on /metrics: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (running sequences' share of `--max-running`), `vllm:prefix_cache_queries` and
`vllm:prefix_cache_hits` (prompt characters looked up and found), and answers `/v1/chat/completions`
(streamed or not), `/v1/embeddings` (each input one prefill step; its vector a hash of the text, the same
on every replica) and `/v1/models`. `--fail-after N` makes it drop every connection after N requests
(a dead replica). A request with vLLM's `continue_final_message` continues the final assistant message's
" tK" tokens from K+1, as a real engine continues a partial answer (with `llama_continue`, as llama-server
does: any final assistant message, its text streamed back first).

    python -m bench.mock_engine --port 8501 [--max-running 8] [--policy fifo|priority]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web


@dataclass(order=True)
class _Seq:
    key: tuple[int, int]  # (priority, arrival): the waiting queue's order
    prompt_chars: int = field(compare=False)
    cached_chars: int = field(compare=False)
    max_tokens: int = field(compare=False)
    out: asyncio.Queue[str | None] = field(compare=False, default_factory=asyncio.Queue)
    made: int = field(compare=False, default=0)


@dataclass
class EngineModel:
    max_running: int = 8
    decode_ms: float = 10.0
    per_seq_ms: float = 1.0
    prefill_ms_per_token: float = 0.5
    chars_per_token: float = 4.0
    policy: str = "fifo"
    block_chars: int = 64
    cache_blocks: int = 4096


class MockEngine:
    """The engine loop and its counters; `submit` queues a sequence and returns its token queue."""

    def __init__(self, model: EngineModel):
        self.m = model
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.cache: OrderedDict[bytes, None] = OrderedDict()
        self.arrivals = itertools.count()
        self.wake = asyncio.Event()
        self.queries = self.hits = 0  # prompt characters looked up / found in the prefix cache
        self.requests = 0

    def _cached(self, prompt: str) -> int:
        """Characters of the prompt's leading whole blocks already cached; caches the prompt's blocks."""
        n, h, cached, hit = self.m.block_chars, hashlib.sha256(), 0, True
        for i in range(0, len(prompt) - n + 1, n):
            h.update(prompt[i:i + n].encode())
            k = h.digest()
            if hit and k in self.cache:
                cached += n
                self.cache.move_to_end(k)
            else:
                hit = False
                self.cache[k] = None
                if len(self.cache) > self.m.cache_blocks:
                    self.cache.popitem(last=False)
        self.queries += len(prompt)
        self.hits += cached
        return cached

    def submit(self, prompt: str, max_tokens: int, priority: int = 0, made: int = 0) -> _Seq:
        """`made`: tokens of the answer already produced elsewhere (a continued answer numbers on from them)."""
        self.requests += 1
        prio = priority if self.m.policy == "priority" else 0
        seq = _Seq((prio, next(self.arrivals)), len(prompt), self._cached(prompt), made + max_tokens, made=made)
        heapq.heappush(self.waiting, seq)
        self.wake.set()
        return seq

    async def run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            admitted = []
            while self.waiting and len(self.running) < self.m.max_running:
                seq = heapq.heappop(self.waiting)
                self.running.append(seq)
                admitted.append(seq)
            prefill = sum(max(0, s.prompt_chars - s.cached_chars) for s in admitted) / self.m.chars_per_token
            step = self.m.decode_ms + self.m.per_seq_ms * len(self.running) + self.m.prefill_ms_per_token * prefill
            await asyncio.sleep(step / 1000)
            for seq in list(self.running):
                seq.made += 1
                seq.out.put_nowait(f" t{seq.made}")
                if seq.made >= seq.max_tokens:
                    seq.out.put_nowait(None)
                    self.running.remove(seq)

    def cancel(self, seq: _Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            heapq.heapify(self.waiting)

    def metrics(self, model_name: str) -> str:
        label = f'{{model_name="{model_name}"}}'
        return "".join(f"{name}{label} {value}\n" for name, value in (
            ("vllm:num_requests_running", len(self.running)), ("vllm:num_requests_waiting", len(self.waiting)),
            ("vllm:kv_cache_usage_perc", len(self.running) / self.m.max_running),
            ("vllm:prefix_cache_queries_total", self.queries), ("vllm:prefix_cache_hits_total", self.hits)))


ENGINE = web.AppKey("engine", MockEngine)
SETTINGS = web.AppKey("settings", dict)  # model (served name), tokens (default completion), fail_after, cut_after


def _prompt(body: dict) -> str:
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in body.get("messages") or [])


async def chat(request: web.Request) -> web.StreamResponse:
    eng = request.app[ENGINE]
    fail_after = request.app[SETTINGS]["fail_after"]
    if fail_after is not None and eng.requests >= fail_after:
        assert request.transport is not None
        request.transport.close()  # a dead replica: the connection drops
        raise web.HTTPServiceUnavailable()
    body = await request.json()
    prompt = _prompt(body)
    made = 0
    msgs = body.get("messages") or []
    settings = request.app[SETTINGS]
    echo = ""
    last_assistant = bool(msgs) and msgs[-1].get("role") == "assistant"
    if last_assistant and (body.get("continue_final_message") or settings.get("llama_continue")):
        made = str(msgs[-1].get("content") or "").count(" t")  # the partial answer's tokens: go on from there
        if settings.get("llama_continue"):  # llama-server streams the continued message whole, given part first
            echo = str(msgs[-1].get("content") or "")
    seq = eng.submit(prompt, int(body.get("max_tokens") or request.app[SETTINGS]["tokens"]),
                     int(body.get("priority") or 0), made)
    cut_after = request.app[SETTINGS].get("cut_after")
    model, rid, created = body.get("model", "mock"), f"chatcmpl-mock{seq.key[1]}", int(time.time())
    usage = {"prompt_tokens": int(len(prompt) / eng.m.chars_per_token), "completion_tokens": seq.max_tokens - made,
             "total_tokens": int(len(prompt) / eng.m.chars_per_token) + seq.max_tokens - made}
    try:
        if not body.get("stream"):
            parts = []
            while (piece := await seq.out.get()) is not None:
                parts.append(piece)
            return web.json_response({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                                                   "finish_reason": "length"}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return b"data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                           "model": model, "choices": [{"index": 0, "delta": delta,
                                                                        "finish_reason": finish}]}).encode() + b"\n\n"
        await resp.write(chunk({"role": "assistant", "content": ""}))
        if echo:
            await resp.write(chunk({"content": echo}))
        sent = 0
        while (piece := await seq.out.get()) is not None:
            await resp.write(chunk({"content": piece}))
            sent += 1
            if cut_after is not None and sent >= cut_after:  # the replica dies mid-stream
                assert request.transport is not None
                request.transport.abort()
                return resp
        await resp.write(chunk({}, "length"))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        eng.cancel(seq)


def mock_vector(text: str, dims: int = 8) -> list[float]:
    """The mock's embedding of `text`: the same on every replica, different for different texts."""
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 255 - 0.5, 6) for b in digest[:dims]]


async def embeddings(request: web.Request) -> web.Response:
    eng = request.app[ENGINE]
    fail_after = request.app[SETTINGS]["fail_after"]
    if fail_after is not None and eng.requests >= fail_after:
        assert request.transport is not None
        request.transport.close()
        raise web.HTTPServiceUnavailable()
    body = await request.json()
    inputs = body.get("input")
    texts = [inputs] if isinstance(inputs, str) else [str(t) for t in inputs or []]
    seqs = [eng.submit(t, 1, int(body.get("priority") or 0)) for t in texts]
    try:
        for seq in seqs:
            while await seq.out.get() is not None:
                pass
    finally:
        for seq in seqs:
            eng.cancel(seq)
    tokens = sum(int(len(t) / eng.m.chars_per_token) for t in texts)
    return web.json_response({"object": "list", "model": body.get("model", "mock"),
                              "data": [{"object": "embedding", "index": i, "embedding": mock_vector(t)}
                                       for i, t in enumerate(texts)],
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": request.app[SETTINGS]["model"], "object": "model",
                                                          "owned_by": "mock"}]})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[ENGINE].metrics(request.app[SETTINGS]["model"]), content_type="text/plain")


def make_app(model: EngineModel, *, model_name: str = "SmolLM2-135M-Instruct", tokens: int = 16,
             fail_after: int | None = None, cut_after: int | None = None,
             llama_continue: bool = False) -> web.Application:
    """`cut_after`: every stream's connection is dropped after that many tokens (a replica dying mid-stream).
    `llama_continue`: continue a final assistant message as llama-server does (without being asked, and
    streaming the given part back before the new text)."""
    app = web.Application()
    app[ENGINE] = MockEngine(model)
    app[SETTINGS] = {"model": model_name, "tokens": tokens, "fail_after": fail_after, "cut_after": cut_after,
                     "llama_continue": llama_continue}

    async def loop(app: web.Application):
        task = asyncio.create_task(app[ENGINE].run())
        yield
        task.cancel()
    app.cleanup_ctx.append(loop)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--decode-ms", type=float, default=10.0)
    ap.add_argument("--per-seq-ms", type=float, default=1.0)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.5)
    ap.add_argument("--policy", choices=("fifo", "priority"), default="fifo")
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens when a request sets no max_tokens")
    ap.add_argument("--fail-after", type=int, help="drop every connection after this many requests")
    ap.add_argument("--block-chars", type=int, default=64, help="the prefix cache's block, in prompt characters")
    ap.add_argument("--cache-blocks", type=int, default=4096, help="prefix cache size, in blocks (LRU)")
    args = ap.parse_args(argv)
    model = EngineModel(max_running=args.max_running, decode_ms=args.decode_ms, per_seq_ms=args.per_seq_ms,
                        prefill_ms_per_token=args.prefill_ms_per_token, policy=args.policy,
                        block_chars=args.block_chars, cache_blocks=args.cache_blocks)
    web.run_app(make_app(model, model_name=args.model, tokens=args.tokens, fail_after=args.fail_after),
                host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
