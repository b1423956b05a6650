"""One tenant must not slow or break the others: background streams' token rate while one adversarial
request at a time runs against a fresh `sluice serve` (default configuration).

Four greedy background streams run for the whole bench. Each case sends one request (a prompt at the
context limit, a 1.5 MB schema, 8,000 properties, a 60-deep nested object, and schemas that compile
but cannot produce an output) and measures, over the request's window: the background streams' tok/s
against their rate in the seconds before it (same run, so the ratio holds on a shared machine), the
longest gap between background tokens, and the request's status and time. Goals: tok/s ratio >= 0.8,
no gap over 1 s, every bad schema a 400 within 2 s.

    python -m bench.isolation [--url http://127.0.0.1:8000/v1] [--cases long_prompt,big_schema,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from bench.server import sluice_server_process

MODEL = "SmolLM2-135M-Instruct"
STREAMS = 4
STREAM_TOKENS = 1500  # each background request's length (greedy, ignore_eos)
RUN = random.randrange(10**6)  # in prompts, so that a server already running serves no case from its prefix cache


def _chat(schema: dict | None = None, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 16,
            "temperature": 0, **extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return body


def _properties(n: int, description: int = 30) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 5, "description": "d" * description}
                                             for i in range(n)}}


def _nested(depth: int) -> dict:
    d: dict = {"type": "string", "maxLength": 8}
    for _ in range(depth):
        d = {"type": "object", "properties": {"a": d}, "required": ["a"], "additionalProperties": False}
    return d


@dataclass
class Case:
    name: str
    path: str
    body: Callable[[], dict]
    expect: int  # the status the request must get
    max_s: float | None = None  # for refusals: within this many seconds


CASES = [
    Case("long_prompt_8191", "/completions", lambda: {
        "model": MODEL, "prompt": [random.Random(RUN).randrange(1000, 40000) for _ in range(8191)], "max_tokens": 1},
        200),
    Case("tools_80", "/chat/completions", lambda: _chat(tools=[
        {"type": "function", "function": {"name": f"tool_{i}", "description": f"Looks things up in catalogue {RUN}.",
                                          "parameters": {"type": "object", "properties": {
                                              "query": {"type": "string", "description": "what to look up"},
                                              "limit": {"type": "integer"}}, "required": ["query"]}}}
        for i in range(80)]), 200),
    Case("schema_1.5MB_16000_props", "/chat/completions", lambda: _chat(_properties(16000)), 400, 2.0),
    Case("schema_8000_props", "/chat/completions", lambda: _chat(_properties(8000)), 400, 2.0),
    Case("schema_60_deep", "/chat/completions", lambda: _chat(_nested(60), max_tokens=400), 200),
    Case("schema_self_ref", "/chat/completions", lambda: _chat(
        {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}), 400, 2.0),
    Case("schema_ref_loop", "/chat/completions", lambda: _chat(
        {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
         "$ref": "#/$defs/a"}), 400, 2.0),
    Case("schema_pattern_x1000", "/chat/completions", lambda: _chat(
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(x{1000}){1000}$"}},
         "required": ["s"]}), 400, 2.0),
    Case("tool_params_self_ref", "/chat/completions", lambda: _chat(tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}}}]), 400, 2.0),
    Case("stream_schema_self_ref", "/chat/completions", lambda: _chat(
        {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}, stream=True), 400, 2.0),
]


@dataclass
class Background:
    """Token arrival times of the background streams (one list per stream)."""

    stamps: list[list[float]] = field(default_factory=lambda: [[] for _ in range(STREAMS)])
    errors: list[str] = field(default_factory=list)
    sent: list[list[float]] = field(default_factory=lambda: [[] for _ in range(STREAMS)])  # each request's start

    async def stream(self, s: aiohttp.ClientSession, url: str, i: int, stop: asyncio.Event) -> None:
        """Stream i's first request is i/STREAMS of the others' length, so the streams restart out of phase:
        a decode's cost grows with its context, and streams that all restart together make the total rate
        swing by a third over each cycle (a few seconds' baseline then lands anywhere on that swing)."""
        first = True
        while not stop.is_set():
            n = max(STREAM_TOKENS * i // STREAMS, 16) if first else STREAM_TOKENS
            first = False
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count slowly from 1 to 500, story {i}."}],
                    "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
            self.sent[i].append(time.perf_counter())
            async with s.post(url + "/chat/completions", json=body) as r:
                async for raw in r.content:
                    if not raw.startswith(b"data:"):
                        continue
                    if b'"error"' in raw:
                        self.errors.append(raw[:200].decode(errors="replace"))
                    self.stamps[i].append(time.perf_counter())
                    if stop.is_set():
                        return

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """(tok/s per stream inside [t0, t1], the longest gap between tokens overlapping it)."""
        rate, gap, _ = self.window_at(t0, t1)
        return rate, gap

    def window_at(self, t0: float, t1: float) -> tuple[float, float, str]:
        """window(), and where its longest gap lies: seconds after t0, and whether a stream's next request
        began inside it (then the gap holds that request's time to first token)."""
        count, gap, where = 0, 0.0, ""
        for st in self.stamps:
            inside = [x for x in st if t0 <= x <= t1]
            count += len(inside)
            before = [x for x in st if x < t0]
            after = [x for x in st if x > t1]
            pts = before[-1:] + inside + after[:1]
            if not pts:
                gap = max(gap, t1 - t0)
                continue
            edges = ([t0] if not before else []) + pts + ([t1] if not after else [])
            for a, b in zip(edges, edges[1:]):
                if b - a > gap:
                    restart = any(a < x < b for x in self.sent[self.stamps.index(st)])
                    gap, where = b - a, f"at +{a - t0:.1f}s{' (new request)' if restart else ''}"
        return count / max(1e-9, t1 - t0) / STREAMS, gap, where


async def run_case(s: aiohttp.ClientSession, url: str, bg: Background, case: Case, settle: float) -> dict:
    await asyncio.sleep(settle)
    base_t0 = time.perf_counter() - settle
    body = json.dumps(case.body())
    t0, started = time.perf_counter(), time.strftime("%H:%M:%S")
    async with s.post(url + case.path, data=body, headers={"Content-Type": "application/json"},
                      timeout=aiohttp.ClientTimeout(total=600)) as r:
        status = r.status
        text = await r.text()
    done = time.perf_counter()
    await asyncio.sleep(max(0.0, t0 + 1.0 - done))  # rates over a second at least (a refusal is quicker)
    t1 = time.perf_counter()
    if case.path.endswith("completions") and status == 200 and '"error"' in text[:2000] and "data:" in text:
        status = 400 if '"invalid_grammar"' in text else 500  # a stream that ended with an error event
    base, _ = bg.window(base_t0, t0)
    during, gap, where = bg.window_at(t0, t1)
    code = ""
    if status >= 400:
        try:
            code = json.loads(text.split("data: ", 1)[-1].split("\n", 1)[0] if text.startswith("data:") else text)[
                "error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
    ok = status == case.expect and (case.max_s is None or done - t0 <= case.max_s) and gap <= 1.0 and \
        during >= 0.8 * base
    return {"case": case.name, "status": status, "code": code, "secs": done - t0, "bg_base": base, "bg_during": during,
            "ratio": during / base if base else float("nan"), "max_gap": gap, "gap_at": where, "started": started, "ok": ok}


async def bench(url: str, cases: list[Case], settle: float) -> list[dict]:
    bg = Background()
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        tasks = [asyncio.create_task(bg.stream(s, url, i, stop)) for i in range(STREAMS)]
        # Every stream past its first request: until then all four decode at small contexts together (each
        # starts at context 0), and a baseline taken there reads ~1.3x the steady rate.
        while any(len(sent) < 2 for sent in bg.sent) and not all(t.done() for t in tasks):
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        rows = []
        for case in cases:
            rows.append(await run_case(s, url, bg, case, settle))
            r = rows[-1]
            print(f"  {r['started']} {r['case']:28s} {r['status']} {r['code'] or '':18s} {r['secs']:7.2f}s  bg {r['bg_base']:6.1f} -> "
                  f"{r['bg_during']:6.1f} tok/s ({r['ratio']:.2f}x)  max gap {r['max_gap']:.2f}s {r['gap_at']}  "
                  f"{'ok' if r['ok'] else 'MISS'}", flush=True)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if bg.errors:
        print("background stream errors:", bg.errors[:3])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an already running server's /v1 URL (default: start a fresh sluice serve)")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--settle", type=float, default=8.0, help="seconds of baseline before each case")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.cases or c.name in args.cases.split(",")]
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags")[0].strip())
    if args.url:
        rows = asyncio.run(bench(args.url, cases, args.settle))
    else:
        with sluice_server_process() as (url, _proc):
            rows = asyncio.run(bench(url, cases, args.settle))
    print(f"\n{sum(r['ok'] for r in rows)}/{len(rows)} cases within the goals (bg tok/s >= 0.8x, no gap over 1 s, "
          "refusals 400 within 2 s)")


if __name__ == "__main__":
    main()
