"""`sluice bench --endpoint embeddings` against a small aiohttp server of this file's own, which answers
OpenAI's CreateEmbeddingResponse (base64 or float, as asked), counts one prompt token per word, stamps
`x-sluice-backend` and logs what it received: every figure is checked against that log or against the
raw per-request results of `--json`."""

from __future__ import annotations

import array
import asyncio
import base64
import io
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from rich.console import Console

from loadgen.cli import amain
from loadgen.client import RequestResult
from loadgen.report import COMPARED_EMBEDDINGS
from loadgen.stats import Slo, num, summarise
from loadgen.workload import WORDS

KEYS = {"pro": "sk-emb-pro", "standard": "sk-emb-standard"}
TIER_OF = {f"Bearer {v}": k for k, v in KEYS.items()}
# An HTTP status to answer with, "short" (a 200 with one embedding fewer than inputs), "html" (a 200 that
# is a web page, as a proxy in front would send), or None (answer).
Fault = int | str | None


class FakeEmbeddings:
    """`GET /v1/models` lists `models`; `POST /v1/embeddings` answers after `delay_s`, stamped with the next
    of `backends` (None: no header). Faults are consumed one per request from `faults`, then
    `default_fault`. `log`: each body received, with its "_auth" header and the "_backend" stamped."""

    def __init__(self, models: tuple[str, ...] = ("emb",), backends: tuple[str | None, ...] = (None,),
                 delay_s: float = 0.0, dims: int = 8):
        self.models, self.delay_s, self.dims = list(models), delay_s, dims
        self.faults: list[Fault] = []
        self.default_fault: Fault = None
        self.log: list[dict[str, Any]] = []
        self._backends = itertools.cycle(backends)
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.list_models)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.server: TestServer | None = None

    async def start(self) -> str:
        self.server = TestServer(self.app, host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}/v1"

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                              "owned_by": "test"} for m in self.models]})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        backend = next(self._backends)
        self.log.append({**body, "_auth": request.headers.get("Authorization"), "_backend": backend or "unknown"})
        fault = self.faults.pop(0) if self.faults else self.default_fault
        headers = {"x-sluice-backend": backend} if backend else {}
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if isinstance(fault, int):
            kind = "invalid_request_error" if fault < 500 else "server_error"
            return web.json_response({"error": {"message": f"injected {fault}", "type": kind, "code": None}},
                                     status=fault, headers=headers)
        if fault == "html":
            return web.Response(text="<html><body>Bad gateway</body></html>", content_type="text/html")
        inputs = body["input"]
        data = []
        for i in range(len(inputs) - (1 if fault == "short" else 0)):
            vector = [float(i + j) / 10 for j in range(self.dims)]
            embedding: object = vector
            if body.get("encoding_format") == "base64":
                embedding = base64.b64encode(array.array("f", vector).tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        tokens = sum(len(text.split()) for text in inputs)
        return web.json_response({"object": "list", "data": data, "model": body["model"],
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)


@pytest.fixture
async def fake() -> AsyncIterator[Callable[..., Awaitable[tuple[FakeEmbeddings, str]]]]:
    made: list[FakeEmbeddings] = []

    async def start(**kw: Any) -> tuple[FakeEmbeddings, str]:
        f = FakeEmbeddings(**kw)
        base = await f.start()
        made.append(f)
        return f, base

    yield start
    for f in made:
        assert f.server is not None
        await f.server.close()


async def bench(*argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `sluice bench --no-progress --endpoint embeddings ARGV`."""
    out, err = io.StringIO(), io.StringIO()
    rc = await amain(["--no-progress", "--no-gateway-usage", "--endpoint", "embeddings", *argv],
                     console=Console(file=out, width=250), err_console=Console(file=err, width=250))
    return rc, out.getvalue(), " ".join(err.getvalue().split())  # stderr unwrapped


def _words(body: dict[str, Any]) -> int:
    return sum(len(text.split()) for text in body["input"])


async def test_inputs_requests_tiers_and_backends_match_the_servers_log(fake, tmp_path):
    f, base = await fake(backends=("local", "local", "remote:a", None), delay_s=0.002)
    out = tmp_path / "emb.json"
    rc, text, err = await bench("--base-url", base, "--model", "emb", "--concurrency", "4", "--requests", "12",
                                "--inputs-per-request", "5", "--input-len", "uniform:3:20", "--warmup", "0",
                                "--tier-mix", "pro=0.3,standard=0.7", "--key", f"pro={KEYS['pro']}",
                                "--key", f"standard={KEYS['standard']}", "--price", "emb=1:0", "--json", str(out))
    assert rc == 0, err
    doc = json.loads(out.read_text())
    (level,) = doc["levels"]
    s, raw = level["summary"], level["requests"]

    # what was sent: 12 bodies of 5 synthetic texts of 3-20 words, through the SDK (base64 asked, decoded)
    assert len(f.log) == 12 == s["requests"] == s["ok"] and s["errors"] == 0 and s["errors_by_kind"] == {}
    for body in f.log:
        assert body["model"] == "emb" and len(body["input"]) == 5 and "messages" not in body
        assert all(3 <= len(t.split()) <= 20 and set(t.split()) <= set(WORDS) for t in body["input"])
        assert body["encoding_format"] == "base64"
    assert s["endpoint"] == "embeddings" and doc["config"]["endpoint"] == "embeddings"
    assert doc["config"]["inputs_per_request"] == 5

    # inputs and prompt tokens: the server's own count; rates over the level's duration
    assert s["inputs"] == 60 == sum(len(b["input"]) for b in f.log) == sum(r["inputs"] for r in raw)
    assert s["input_rate"] == pytest.approx(60 / s["duration_s"], rel=1e-4)
    assert s["request_rate"] == pytest.approx(12 / s["duration_s"], rel=1e-4)
    words = sum(_words(b) for b in f.log)
    assert s["prompt_tokens"] == words and s["prompt_tokens_unreported"] == 0
    assert sorted(r["prompt_tokens"] for r in raw) == sorted(_words(b) for b in f.log)
    assert s["prompt_throughput"] == pytest.approx(words / s["duration_s"], rel=1e-4)
    assert s["e2e_ms"]["p90"] == pytest.approx(np.percentile([r["e2e_ms"] for r in raw], 90), abs=1e-3)
    assert s["e2e_ms"]["p50"] >= 2.0  # the server's 2 ms
    assert s["cost"]["total"] == pytest.approx(words / 1e6)  # $1 per million prompt tokens

    # tiers: the Authorization header the server saw; backends: the header it sent; shares of the 12
    seen_tiers = Counter(TIER_OF[b["_auth"]] for b in f.log)
    assert set(seen_tiers) == {"pro", "standard"}
    assert {t: g["requests"] for t, g in s["by_tier"].items()} == dict(seen_tiers)
    assert {t: g["inputs"] for t, g in s["by_tier"].items()} == {t: 5 * n for t, n in seen_tiers.items()}
    seen_backends = Counter(b["_backend"] for b in f.log)
    assert seen_backends == {"local": 6, "remote:a": 3, "unknown": 3}
    assert {b: g["requests"] for b, g in s["by_backend"].items()} == dict(seen_backends)
    assert {b: g["share"] for b, g in s["by_backend"].items()} == {"local": 0.5, "remote:a": 0.25, "unknown": 0.25}
    assert Counter(r["backend"] for r in raw) == seen_backends

    # no stream: no TTFT / ITL anywhere; the table shows the embeddings columns
    assert "ttft_ms" not in s and "itl_ms" not in s and all(r["ttft_ms"] is None and not r["itl_ms"] for r in raw)
    assert "inputs/s" in text and "prompt tok/s" in text and "latency ms" in text and "TTFT" not in text
    assert "12 / 12" in text and "tier pro" in text and "backend remote:a" in text and "50.0%" in text
    assert KEYS["pro"] not in out.read_text()


async def test_errors_are_counted_by_kind(fake, tmp_path):
    f, base = await fake(backends=("remote:a",))
    f.faults = [400, None, 503, None, "short", 503, None, "html", 400, None]
    out = tmp_path / "errors.json"
    rc, text, err = await bench("--base-url", base, "--model", "emb", "--concurrency", "3", "--requests", "14",
                                "--inputs-per-request", "2", "--warmup", "0", "--json", str(out),
                                "--extra-body", '{"encoding_format": "float"}')
    assert rc == 0, err
    level = json.loads(out.read_text())["levels"][0]
    s, raw = level["summary"], level["requests"]
    assert len(f.log) == 14 == s["requests"]  # never retried
    assert all(b["encoding_format"] == "float" for b in f.log)
    assert s["errors_by_kind"] == {"http_400": 2, "http_503": 2, "bad_embeddings": 1, "not_json": 1}
    assert s["errors"] == 6 and s["ok"] == 8 and s["error_rate"] == pytest.approx(6 / 14)
    assert s["inputs"] == 8 * 2  # only answered requests count
    assert [r["error_detail"] for r in raw if r["error"] == "bad_embeddings"] == ["1 embeddings for 2 inputs"]
    assert s["by_backend"]["remote:a"]["errors"] == 5  # error answers carry the header (not the HTML page)
    assert "http_400: 2" in text and "http_503: 2" in text


async def test_a_run_where_every_request_failed_exits_1(fake, tmp_path):
    f, base = await fake()
    f.default_fault = 503
    out = tmp_path / "fail.json"
    rc, text, err = await bench("--base-url", base, "--model", "emb", "--requests", "3", "--warmup", "0",
                                "--json", str(out))
    assert rc == 1, err
    assert "every request failed (0/3 succeeded; http_503: 3)" in err
    assert json.loads(out.read_text())["levels"][0]["summary"]["ok"] == 0 and "0 / 3" in text  # still reported

    f.default_fault = 400  # the warm-up (one per tier) stops the run before any level
    f.log.clear()
    rc, _, err = await bench("--base-url", base, "--model", "emb", "--requests", "3")
    assert rc == 1 and "warm-up request (tier default) failed: http_400" in err and len(f.log) == 1


async def test_model_is_required_when_the_server_lists_several(fake):
    f, base = await fake(models=("chat-model", "emb-small"))
    rc, _, err = await bench("--base-url", base, "--requests", "2", "--warmup", "0")
    assert rc == 2, err
    assert "--endpoint embeddings needs --model" in err and "chat-model, emb-small" in err
    assert not f.log  # nothing sent

    f.models = ["only-one"]  # a single listed model is the one
    rc, _, err = await bench("--base-url", base, "--requests", "2", "--warmup", "0")
    assert rc == 0, err
    assert [b["model"] for b in f.log] == ["only-one", "only-one"] and all(len(b["input"]) == 1 for b in f.log)


@pytest.mark.parametrize("argv", [
    ("--output-len", "5"),
    ("--workload", "rag"),
    ("--slo-ttft-ms", "100"),
    ("--inputs-per-request", "0"),
])
async def test_options_that_do_not_apply_are_usage_errors(fake, argv):
    f, base = await fake()
    rc, _, err = await bench("--base-url", base, "--model", "emb", "--requests", "1", *argv)
    assert rc == 2, err
    assert argv[0] in err and not f.log


async def test_inputs_per_request_without_embeddings_is_a_usage_error(fake):
    f, base = await fake()
    err = io.StringIO()
    rc = await amain(["--no-progress", "--base-url", base, "--model", "emb", "--inputs-per-request", "4"],
                     console=Console(file=io.StringIO()), err_console=Console(file=err, width=250))
    assert rc == 2 and "--inputs-per-request goes with --endpoint embeddings" in err.getvalue()
    assert not f.log


def _flat(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict):
        return {prefix: d}
    return {k: v for key, value in d.items() for k, v in _flat(value, f"{prefix}/{key}").items()}


async def test_json_round_trip_compare_and_plot(fake, tmp_path):
    fast, fast_base = await fake(backends=("local", "remote:a"))
    slow, slow_base = await fake(backends=("local", "remote:a"), delay_s=0.03)
    a, b, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "emb.png"
    common = ["--model", "emb", "--concurrency", "1,2", "--requests", "6", "--inputs-per-request", "3",
              "--input-len", "8", "--warmup", "0", "--key", f"pro={KEYS['pro']}",
              "--key", f"standard={KEYS['standard']}"]
    rc, text, err = await bench("--base-url", fast_base, *common, "--json", str(a), "--plot", str(png))
    assert rc == 0, err
    assert "sweep" in text and "concurrency 2" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = await bench("--base-url", slow_base, *common, "--json", str(b))
    assert rc == 0, err
    assert [x["input"] for x in fast.log] == [x["input"] for x in slow.log]  # same seed, same requests

    # round trip: each level's summary is what its raw results, read back from the file, summarise to
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    for doc in (da, db):
        assert [lv["level"]["label"] for lv in doc["levels"]] == ["concurrency 1", "concurrency 2"]
        for lv in doc["levels"]:
            s = lv["summary"]
            again = summarise([RequestResult(**r) for r in lv["requests"]], s["duration_s"], Slo(),
                              endpoint="embeddings")
            fs, fa = _flat(s), _flat(again)
            assert fs.keys() == fa.keys()
            for k, v in fs.items():
                assert fa[k] == (pytest.approx(v, rel=1e-4) if isinstance(v, float) else v), k
            assert s["inputs"] == 18 and s["prompt_tokens"] == 18 * 8

    rc, table, err = await bench("--compare", str(a), str(b))
    assert rc == 0, err
    assert "inputs/s" in table and "latency p99 ms" in table and "TTFT" not in table
    for lv_a, lv_b in zip(da["levels"], db["levels"]):
        for label, path in COMPARED_EMBEDDINGS:
            va, vb = num(lv_a["summary"], *path), num(lv_b["summary"], *path)
            if va and vb is not None:
                assert f"{vb / va:.3f}" in table, (label, va, vb)
    latency = [doc["levels"][0]["summary"]["e2e_ms"]["p50"] for doc in (da, db)]
    assert latency[1] / latency[0] > 2 and latency[1] >= 30  # 30 ms against no delay

    # a chat run's file beside an embeddings run's: not comparable
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"levels": [{"level": {"label": "concurrency 1"},
                                            "summary": {"request_rate": 1.0, "ttft_ms": {"p50": 5.0}}}]}))
    rc, _, err = await bench("--compare", str(a), str(chat))
    assert rc == 2 and "--endpoint embeddings" in err and "--endpoint chat" in err
