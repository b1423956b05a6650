"""`sluice bench` against the fault-injecting mock provider (tests/fixtures/mock_provider.py): every figure
is checked against a hand count, from the mock's own log of what it received and answered, or from
the raw per-request results of `--json`."""

from __future__ import annotations

import io
import itertools
import json
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from gateway.cli import main as sluice_main
from loadgen.cli import amain
from loadgen.report import COMPARED
from loadgen.stats import num
from tests.fixtures.mock_provider import MockProvider, _words

KEYS = {"pro": "sk-bench-pro", "standard": "sk-bench-standard"}


class Mock:
    """The mock provider, answering `tokens` tokens `itl_s` apart, and stamping each chat response with
    the next `x-sluice-backend` value of `backends` (None: no header). `sent` is what it stamped."""

    def __init__(self, tokens: int = 8, itl_s: float = 0.001, backends: list[str | None] | None = None):
        self.m = MockProvider("bench", tokens=tokens, itl_s=itl_s)
        self.sent: list[str] = []
        cycle = itertools.cycle(backends or [None])

        async def stamp(request, response) -> None:
            if request.path.endswith("/chat/completions"):
                b = next(cycle)
                self.sent.append(b or "unknown")
                if b:
                    response.headers["x-sluice-backend"] = b

        self.m.app.on_response_prepare.append(stamp)

    @property
    def log(self) -> list[dict]:
        return self.m.requests


@pytest.fixture
async def mock():
    made: list[Mock] = []

    async def start(**kw) -> Mock:
        m = Mock(**kw)
        await m.m.start()
        made.append(m)
        return m

    yield start
    for m in made:
        await m.m.stop()


async def bench(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = await amain(["--no-progress", "--warmup", "0", *argv], console=Console(file=out, width=250),
                     err_console=Console(file=io.StringIO(), width=250))
    return rc, out.getvalue()


def _tier_of(auth: str) -> str:
    return {f"Bearer {v}": k for k, v in KEYS.items()}[auth]


async def test_twenty_requests_at_concurrency_4_match_the_mocks_log(mock, tmp_path):
    m = await mock(tokens=8, backends=["local", "local", "remote:a", None])
    out = tmp_path / "run.json"
    rc, text = await bench("--base-url", m.m.base_url, "--model", "m", "--concurrency", "4", "--requests", "20",
                           "--input-len", "uniform:3:40", "--output-len", "uniform:2:12",
                           "--tier-mix", "pro=0.3,standard=0.7", "--key", f"pro={KEYS['pro']}",
                           "--key", f"standard={KEYS['standard']}", "--price", "m=1:2", "--json", str(out))
    assert rc == 0
    doc = json.loads(out.read_text())
    (level,) = doc["levels"]
    s, raw = level["summary"], level["requests"]
    assert level["level"]["concurrency"] == 4 and len(raw) == 20

    # requests, errors, output tokens: the mock's own log (it answers min(tokens, max_tokens) tokens)
    assert len(m.log) == s["requests"] == s["ok"] == 20 and s["errors"] == 0 and s["errors_by_kind"] == {}
    expected_out = sum(min(8, body["max_tokens"]) for body in m.log)
    assert s["output_tokens"] == expected_out == sum(r["output_tokens"] for r in raw)
    assert all(body["stream"] and body["stream_options"] == {"include_usage": True} for body in m.log)
    assert all(r["output_tokens_from"] == "usage" and r["text_chunks"] == r["output_tokens"] for r in raw)
    assert all(len(r["itl_ms"]) == r["output_tokens"] - 1 for r in raw)  # one token per chunk, one gap each
    assert sorted(r["prompt_tokens"] for r in raw) == sorted(_words(body) for body in m.log)
    assert all(r["prompt_tokens"] == r["prompt_words"] for r in raw)  # the mock counts words: exact

    # tiers: the keys the mock saw; backends: the headers it sent
    seen_tiers = Counter(_tier_of(body["_auth"]) for body in m.log)
    assert {t: g["requests"] for t, g in s["by_tier"].items()} == dict(seen_tiers)
    assert set(seen_tiers) == {"pro", "standard"}
    assert {b: g["requests"] for b, g in s["by_backend"].items()} == dict(Counter(m.sent))
    assert Counter(r["backend"] for r in raw) == Counter(m.sent) and "unknown" in m.sent
    assert sum(g["output_tokens"] for g in s["by_backend"].values()) == expected_out

    # rates and percentiles from the raw results
    assert s["request_rate"] == pytest.approx(20 / s["duration_s"], rel=1e-4)
    assert s["output_throughput"] == pytest.approx(expected_out / s["duration_s"], rel=1e-4)
    assert s["ttft_ms"]["p90"] == pytest.approx(np.percentile([r["ttft_ms"] for r in raw], 90), abs=1e-3)
    assert s["itl_ms"]["p50"] == pytest.approx(np.percentile([x for r in raw for x in r["itl_ms"]], 50), abs=1e-3)
    assert s["e2e_ms"]["p99"] == pytest.approx(np.percentile([r["e2e_ms"] for r in raw], 99), abs=1e-3)
    assert all(r["e2e_ms"] >= r["ttft_ms"] + sum(r["itl_ms"]) - 0.01 for r in raw)

    # cost: $1 / $2 per million prompt / output tokens, from the mock's usage
    expected_cost = sum(_words(b) * 1 + min(8, b["max_tokens"]) * 2 for b in m.log) / 1e6
    assert s["cost"]["total"] == pytest.approx(expected_cost) and s["cost"]["unpriced"] == 0
    assert doc["config"]["tiers_with_keys"] == ["pro", "standard"] and KEYS["pro"] not in out.read_text()
    assert "20 / 20" in text and "tier pro" in text and "backend remote:a" in text


async def test_injected_faults_are_counted_by_kind_and_never_retried(mock, tmp_path):
    m = await mock(tokens=6, backends=["remote:a"])
    faults = [("status", 500), None, ("status", 503), None, ("status", 500), ("status", 429, 1), None,
              ("html", 502), ("status", 500), None, None, ("html",)]
    m.m.faults = list(faults)
    out = tmp_path / "faults.json"
    rc, text = await bench("--base-url", m.m.base_url, "--model", "m", "--concurrency", "4", "--requests", "16",
                           "--output-len", "10", "--json", str(out))
    assert rc == 0
    s = json.loads(out.read_text())["levels"][0]["summary"]
    assert len(m.log) == 16 == s["requests"]  # max_retries=0: one call per request
    assert s["errors_by_kind"] == {"http_500": 3, "http_503": 1, "http_429": 1, "http_502": 1, "not_sse": 1}
    assert s["errors"] == 7 and s["ok"] == 9 and s["output_tokens"] == 9 * 6
    assert s["error_rate"] == pytest.approx(7 / 16)
    assert s["by_backend"]["remote:a"]["errors"] == 7  # error answers carry the header too
    assert "http_500: 3" in text


async def test_goodput_counts_only_requests_meeting_the_slo(mock, tmp_path):
    m = await mock(tokens=5, itl_s=0.002)
    m.m.faults = [None, ("hang", 0.8), None, None, ("hang", 0.8), None, None, None, None, ("hang", 0.8)]
    out = tmp_path / "slo.json"
    rc, _ = await bench("--base-url", m.m.base_url, "--model", "m", "--concurrency", "4", "--requests", "12",
                        "--output-len", "5", "--slo-ttft-ms", "400", "--slo-itl-ms", "1000", "--json", str(out))
    assert rc == 0
    level = json.loads(out.read_text())["levels"][0]
    s, raw = level["summary"], level["requests"]
    by_hand = [r for r in raw if r["ok"] and r["ttft_ms"] <= 400 and sum(r["itl_ms"]) / len(r["itl_ms"]) <= 1000]
    assert s["goodput"]["met"] == len(by_hand) == 12 - 3  # the three hung requests miss the TTFT SLO
    assert s["goodput"]["rate"] == pytest.approx(len(by_hand) / s["duration_s"], rel=1e-4)
    assert s["ok"] == 12 and s["ttft_ms"]["max"] >= 800

    # an ITL SLO below the mock's 2 ms gaps: nobody meets it (by hand from the same kind of raw data)
    m.m.faults = []
    rc, _ = await bench("--base-url", m.m.base_url, "--model", "m", "--requests", "4", "--output-len", "5",
                        "--slo-ttft-ms", "250", "--slo-itl-ms", "1", "--json", str(out))
    level = json.loads(out.read_text())["levels"][0]
    by_hand = [r for r in level["requests"] if r["ok"] and r["ttft_ms"] <= 250
               and sum(r["itl_ms"]) / len(r["itl_ms"]) <= 1]
    assert level["summary"]["goodput"]["met"] == len(by_hand) == 0


async def test_sweep_json_compare_and_plot(mock, tmp_path):
    fast = await mock(tokens=6, itl_s=0.001, backends=["local", "remote:a", "local"])
    slow = await mock(tokens=6, itl_s=0.006, backends=["local", "remote:a", "local"])
    a, b, png = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "sweep.png"
    common = ["--model", "m", "--concurrency", "1,3", "--requests", "9", "--output-len", "6",
              "--tier-mix", "pro=1,standard=2", "--key", f"pro={KEYS['pro']}", "--key", f"standard={KEYS['standard']}",
              "--slo-ttft-ms", "500", "--price-backend", "remote:a=1:2", "--price-backend", "local=0:0"]
    rc, text = await bench("--base-url", fast.m.base_url, *common, "--json", str(a), "--plot", str(png))
    assert rc == 0 and "sweep" in text and "concurrency 3" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    rc, _ = await bench("--base-url", slow.m.base_url, *common, "--json", str(b))
    assert rc == 0
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    assert [lv["level"]["label"] for lv in da["levels"]] == ["concurrency 1", "concurrency 3"]
    assert len(fast.log) == len(slow.log) == 18
    prompts = [b["messages"][0]["content"] for b in fast.log]
    assert len(set(prompts)) == 18  # a level never repeats the last one's prompts (a prefix cache would hit)
    assert prompts == [b["messages"][0]["content"] for b in slow.log]  # same seed, same requests
    for doc in (da, db):
        for lv in doc["levels"]:
            s = lv["summary"]
            remote = [r for r in lv["requests"] if r["backend"] == "remote:a"]
            assert s["cost"]["total"] == pytest.approx(sum(r["prompt_tokens"] + 2 * r["output_tokens"]
                                                           for r in remote) / 1e6)
            assert s["by_backend"]["local"]["cost"]["total"] == 0

    rc, table = await bench("--compare", str(a), str(b))
    assert rc == 0
    for lv_a, lv_b in zip(da["levels"], db["levels"]):
        for label, path in COMPARED:
            va, vb = num(lv_a["summary"], *path), num(lv_b["summary"], *path)
            if va and vb is not None:
                assert f"{vb / va:.3f}" in table, (label, va, vb)
    itl_ratio = db["levels"][0]["summary"]["itl_ms"]["p50"] / da["levels"][0]["summary"]["itl_ms"]["p50"]
    assert itl_ratio > 2  # 6 ms against 1 ms gaps


async def test_rate_and_duration_bound_the_run(mock, tmp_path):
    m = await mock(tokens=3)
    out = tmp_path / "rate.json"
    rc, text = await bench("--base-url", m.m.base_url, "--model", "m", "--rate", "50", "--requests", "15",
                           "--output-len", "3", "--json", str(out))
    assert rc == 0 and "rate 50/s" in text
    raw = json.loads(out.read_text())["levels"][0]["requests"]
    assert len(raw) == len(m.log) == 15 and all(r["ok"] for r in raw)
    gaps = np.diff(sorted(r["start_s"] for r in raw))
    assert 0.005 < gaps.mean() < 0.08  # Poisson arrivals at 50/s: a mean gap of 20 ms

    m.log.clear()
    rc, _ = await bench("--base-url", m.m.base_url, "--model", "m", "--concurrency", "2", "--duration", "0.4",
                        "--output-len", "3", "--json", str(out))
    level = json.loads(out.read_text())["levels"][0]
    raw = level["requests"]
    assert rc == 0 and len(raw) == len(m.log) == level["summary"]["requests"] > 2
    assert all(r["start_s"] < 0.4 + 0.02 for r in raw)  # none started after the duration (to the check)


async def test_jsonl_workload_and_default_model(mock, tmp_path):
    m = await mock(tokens=8)
    data = tmp_path / "recorded.jsonl"
    data.write_text("\n".join(json.dumps({"model": "rec", "messages": [{"role": "user", "content": "a b c d"}],
                                          "max_tokens": n, "temperature": 0}) for n in (1, 3, 5)))
    rc, _ = await bench("--base-url", m.m.base_url, "--dataset", str(data), "--requests", "5",
                        "--concurrency", "1,2", "--json", str(tmp_path / "j.json"))
    assert rc == 0
    assert [b["max_tokens"] for b in m.log[:5]] == [1, 3, 5, 1, 3]  # file order, cycled (concurrency 1)
    assert sorted(b["max_tokens"] for b in m.log[5:]) == [1, 1, 3, 3, 5]  # each level from the first line
    assert all(b["model"] == "rec" and b["temperature"] == 0 for b in m.log)
    levels = json.loads((tmp_path / "j.json").read_text())["levels"]
    assert [lv["summary"]["output_tokens"] for lv in levels] == [13, 13]

    # the mock has no GET /models: without --model a synthetic run says so (usage error)
    rc, _ = await bench("--base-url", m.m.base_url, "--requests", "1")
    assert rc == 2


async def test_warm_up_checks_each_key_and_is_not_counted(mock, tmp_path):
    m = await mock(tokens=2)
    out = tmp_path / "w.json"
    rc = await amain(["--no-progress", "--base-url", m.m.base_url, "--model", "m", "--requests", "3",
                      "--warmup", "1", "--key", f"pro={KEYS['pro']}", "--key", f"standard={KEYS['standard']}",
                      "--json", str(out)], console=Console(file=io.StringIO()), err_console=Console(file=io.StringIO()))
    assert rc == 0 and len(m.log) == 3 + 2  # one warm-up per tier
    assert json.loads(out.read_text())["levels"][0]["summary"]["requests"] == 3
    m.m.faults = [("status", 401)]
    err = io.StringIO()
    rc = await amain(["--no-progress", "--base-url", m.m.base_url, "--model", "m", "--requests", "3"],
                     console=Console(file=io.StringIO()), err_console=Console(file=err, width=250))
    assert rc == 1 and "http_401" in err.getvalue()


def test_sluice_bench_wiring(capsys):
    assert sluice_main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "engine_batching" in listed and "gateway_load" in listed
    assert sluice_main(["bench", "script", "no_such_script"]) == 2
    with pytest.raises(SystemExit) as e:
        sluice_main(["bench", "--help"])
    assert e.value.code == 0 and "--concurrency" in capsys.readouterr().out
    assert sluice_main(["bench", "--rate", "1", "--concurrency", "2"]) == 2  # its own usage errors
