"""A fault-injecting OpenAI-compatible provider on loopback (tests and `bench/remote_overhead.py`).

`POST /v1/chat/completions` and `/v1/completions`, JSON and SSE. The answer is `tokens` words
("w0 w1 ..."; `max_tokens` caps it), usage counts one prompt token per whitespace-separated word of
the prompt, and `cached_tokens` is configurable. Faults are consumed one per request, in order, from
`MockProvider.faults`; when the list is empty `default_fault` applies (None: answer normally):

  ("status", code[, retry_after])  answer `code` with an OpenAI error body (and Retry-After)
  ("hang", seconds)                 sleep before answering (hits the caller's timeout)
  ("drop_before_first",)            stream: send headers and a role-only chunk, then cut the connection
  ("drop_after", k)                 stream: send k content chunks, then cut the connection
  ("reset",)                        close the connection without an answer
  ("html"[, code])                  answer `code` (200) with an HTML error page, as a proxy in front would
  ("bad_json",)                     JSON: a 200 whose body is cut mid-object; stream: a role-only chunk,
                                    then a `data:` line that is not JSON (before any text)

Run standalone: `python -m tests.remote.mock_provider --port 9100 [--tokens 16] [--itl-ms 0]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web


def _words(body: dict[str, Any]) -> int:
    if "messages" in body:
        text = " ".join(m.get("content") or "" if isinstance(m.get("content"), (str, type(None)))
                        else " ".join(p.get("text", "") for p in m["content"]) for m in body["messages"])
    else:
        p = body.get("prompt", "")
        text = p if isinstance(p, str) else " ".join(map(str, p))
    return max(1, len(text.split()))


class MockProvider:
    def __init__(self, name: str = "mock", *, tokens: int = 8, itl_s: float = 0.0, ttft_s: float = 0.0,
                 cached_tokens: int = 0):
        self.name = name
        self.tokens = tokens
        self.itl_s = itl_s
        self.ttft_s = ttft_s
        self.cached_tokens = cached_tokens
        self.faults: list[tuple] = []
        self.default_fault: tuple | None = None
        self.requests: list[dict[str, Any]] = []  # bodies received, with "_auth" and "_t"
        self.count = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.handle)
        self.app.router.add_post("/v1/completions", self.handle)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.record = True

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self, port: int = 0) -> MockProvider:
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def _next_fault(self) -> tuple | None:
        return self.faults.pop(0) if self.faults else self.default_fault

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.count += 1
        if self.record:
            self.requests.append({**body, "_auth": request.headers.get("Authorization"), "_t": time.monotonic()})
        fault = self._next_fault()
        kind = fault[0] if fault else None
        if kind == "status":
            headers = {"Retry-After": str(fault[2])} if len(fault) > 2 and fault[2] is not None else {}
            return web.json_response({"error": {"message": f"{self.name}: injected {fault[1]}",
                                                "type": "server_error" if fault[1] >= 500 else "invalid_request_error",
                                                "param": None, "code": f"injected_{fault[1]}"}},
                                     status=fault[1], headers=headers)
        if kind == "hang":
            await asyncio.sleep(fault[1])
        if kind == "reset":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if kind == "html":
            code = fault[1] if len(fault) > 1 else 200
            return web.Response(status=code, content_type="text/html",
                                text="<html><head><title>502 Bad Gateway</title></head>"
                                     "<body><h1>Bad Gateway</h1><hr>nginx</body></html>")
        chat = request.path.endswith("/chat/completions")
        n_tokens = min(self.tokens, body.get("max_tokens") or body.get("max_completion_tokens") or self.tokens)
        prompt = _words(body)
        usage = {"prompt_tokens": prompt, "completion_tokens": n_tokens, "total_tokens": prompt + n_tokens,
                 "prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, prompt)}}
        rid = f"mock-{self.count}"
        created = int(time.time())
        model = body.get("model", "?")
        pieces = [f"w{i}" if i == 0 else f" w{i}" for i in range(n_tokens)]
        if self.ttft_s:
            await asyncio.sleep(self.ttft_s)
        if not body.get("stream"):
            if kind == "bad_json":
                return web.Response(content_type="application/json", text=f'{{"id": "{rid}", "object": "chat.comp')
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
                          "finish_reason": "length" if n_tokens < self.tokens else "stop"}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": "".join(pieces), "finish_reason": "stop"}
                obj = "text_completion"
            return web.json_response({"id": rid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict | None, text: str | None, finish: str | None) -> bytes:
            if chat:
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
            else:
                c = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}
            return b"data: " + json.dumps(c).encode() + b"\n\n"

        if chat:
            await resp.write(chunk({"role": "assistant", "content": ""}, None, None))
        if kind == "bad_json":
            await resp.write(b"data: {\"id\": \"" + rid.encode() + b"\", \"choices\": [{\"ind\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if kind == "drop_before_first":
            assert request.transport is not None
            request.transport.close()
            return resp
        for i, piece in enumerate(pieces):
            if kind == "drop_after" and i == fault[1]:
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.itl_s and i:
                await asyncio.sleep(self.itl_s)
            await resp.write(chunk({"content": piece}, piece, None))
        await resp.write(chunk({}, "", "stop"))
        if include_usage:
            u = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                 "model": model, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(u).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=9100)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    args = p.parse_args(argv)

    async def run() -> None:
        m = MockProvider(tokens=args.tokens, itl_s=args.itl_ms / 1000, ttft_s=args.ttft_ms / 1000)
        m.record = False
        await m.start(args.port)
        print(f"mock provider on {m.base_url}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
