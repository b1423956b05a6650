"""`sluice bench`'s building blocks without a server: lengths, prompts, the RAG shape, recorded JSONL,
tier mixes and keys, prices, levels and the command line around them."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from loadgen.cli import UsageError, build_parser, levels_from, normalise_base_url, tier_keys
from loadgen.client import RequestResult
from loadgen.report import compare_rows
from loadgen.stats import PriceError, Prices, Slo, parse_price, summarise
from loadgen.workload import (
    WORDS,
    LengthDist,
    Rag,
    Recorded,
    Synthetic,
    SyntheticEmbeddings,
    TierMix,
    WorkloadError,
    load_jsonl,
)


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


def test_length_distributions_parse_sample_and_print():
    rng = random.Random(1)
    assert LengthDist.parse("64").sample(rng) == 64 and str(LengthDist.parse("fixed:64")) == "64"
    u = LengthDist.parse("uniform:10:20")
    draws = [u.sample(rng) for _ in range(2000)]
    assert min(draws) == 10 and max(draws) == 20 and str(u) == "uniform:10:20"
    ln = LengthDist.parse("lognormal:100:0.5")
    draws = sorted(ln.sample(rng) for _ in range(4001))
    assert 90 <= draws[2000] <= 110  # the median
    assert draws[0] >= 1 and draws[-1] <= 1600
    for bad in ("x", "uniform:5", "uniform:9:3", "lognormal:0:1", "fixed:-1", "uniform:1.5:3", "poisson:3"):
        with pytest.raises(WorkloadError):
            LengthDist.parse(bad)


def test_synthetic_prompts_have_the_drawn_word_count_and_repeat_with_the_seed():
    mix = TierMix.parse("pro=1,standard=3")
    w = Synthetic("m", LengthDist.parse("uniform:5:50"), LengthDist.parse("uniform:1:9"), mix, seed=7)
    specs = [w.request(i) for i in range(400)]
    for s in specs:
        text = s.body["messages"][0]["content"]
        assert len(text.split()) == s.prompt_words and 5 <= s.prompt_words <= 50
        assert set(text.split()) <= set(WORDS)
        assert 1 <= s.body["max_tokens"] <= 9 and s.body["model"] == "m"
    assert [s.body for s in specs[:20]] == [w.request(i).body for i in range(20)]  # same seed, same requests
    other = Synthetic("m", LengthDist.parse("uniform:5:50"), LengthDist.parse("uniform:1:9"), mix, seed=8)
    assert other.request(0).body != specs[0].body
    tiers = Counter(s.tier for s in specs)
    assert set(tiers) == {"pro", "standard"} and 60 <= tiers["pro"] <= 140  # about a quarter


def test_embeddings_bodies_carry_n_inputs_of_drawn_lengths_and_repeat_with_the_seed():
    mix = TierMix.parse("pro=1,standard=1")
    w = SyntheticEmbeddings("e", LengthDist.parse("uniform:2:30"), 4, mix, seed=3, extra_body={"dimensions": 8})
    specs = [w.request(i) for i in range(200)]
    for s in specs:
        assert set(s.body) == {"model", "input", "dimensions"} and s.body["model"] == "e"
        texts = s.body["input"]
        assert len(texts) == 4 and all(2 <= len(t.split()) <= 30 and set(t.split()) <= set(WORDS) for t in texts)
        assert s.prompt_words == sum(len(t.split()) for t in texts)
    assert sum(len({len(t.split()) for t in s.body["input"]}) > 1 for s in specs) > 150  # drawn per text
    assert [s.body for s in specs[:10]] == [w.request(i).body for i in range(10)]  # same seed, same requests
    assert SyntheticEmbeddings("e", LengthDist.parse("5"), 1, mix, seed=4).request(0).body["input"] != \
        SyntheticEmbeddings("e", LengthDist.parse("5"), 1, mix, seed=3).request(0).body["input"]
    assert set(Counter(s.tier for s in specs)) == {"pro", "standard"}
    assert w.describe()["inputs_per_request"] == 4 and w.describe()["endpoint"] == "embeddings"
    with pytest.raises(WorkloadError):
        SyntheticEmbeddings("e", LengthDist.parse("5"), 0, mix)


def test_rag_shares_documents_and_varies_questions():
    w = Rag("m", 3, 200, LengthDist.parse("12"), LengthDist.parse("4"), TierMix({"default": 1}), seed=1)
    specs = [w.request(i) for i in range(30)]
    docs = Counter(s.body["messages"][0]["content"] for s in specs)
    assert len(docs) == 3 and all(len(d.split()) == 200 for d in docs)
    questions = {s.body["messages"][1]["content"] for s in specs}
    assert len(questions) == 30 and all(s.prompt_words == 212 for s in specs)


def test_recorded_jsonl_is_sent_in_order_with_overrides(tmp_path):
    path = tmp_path / "reqs.jsonl"
    lines = [{"model": "a", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 5,
              "stream": False, "temperature": 0},
             {"model": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": "four five"}]}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = Recorded(path, TierMix({"default": 1}))
    r0, r1, r2 = (w.request(i) for i in range(3))
    assert r0.body == {k: v for k, v in lines[0].items() if k != "stream"} and r0.prompt_words == 3
    assert r1.body["model"] == "b" and r1.prompt_words == 2 and r2.body == r0.body  # cycled
    w = Recorded(path, TierMix({"default": 1}), model="z", output_len=LengthDist.parse("7"))
    assert w.request(0).body["model"] == "z" and w.request(1).body["max_tokens"] == 7
    (tmp_path / "bad.jsonl").write_text('{"model": "a", "messages": []}\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:1"):
        load_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "nomodel.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(WorkloadError, match="--model"):
        Recorded(tmp_path / "nomodel.jsonl", TierMix({"default": 1}))


def test_tier_mix_and_keys():
    with pytest.raises(WorkloadError):
        TierMix.parse("pro")
    with pytest.raises(WorkloadError):
        TierMix.parse("pro=0")
    mix, keys, default = tier_keys(_args("--tier-mix", "pro=0.3,standard=0.7", "--key", "pro=sk-p"),
                                   {"SLUICE_BENCH_KEY_STANDARD": "sk-s", "OPENAI_API_KEY": "sk-o"})
    assert mix.weights == pytest.approx({"pro": 0.3, "standard": 0.7})
    assert keys == {"pro": "sk-p", "standard": "sk-s"} and default == "sk-o"
    with pytest.raises(UsageError, match="SLUICE_BENCH_KEY_STANDARD"):
        tier_keys(_args("--tier-mix", "pro=1,standard=1", "--key", "pro=sk-p"), {})
    mix, keys, default = tier_keys(_args("--key", "gold=sk-g"), {})
    assert mix.tiers == ["gold"] and default == "none"
    mix, _, _ = tier_keys(_args(), {})
    assert mix.tiers == ["default"]


def test_prices_levels_and_base_urls():
    assert parse_price("remote:holysheep=0.15:0.6") == ("remote:holysheep", (0.15, 0.6))
    for bad in ("m=1", "=1:2", "m=a:b", "m=-1:2"):
        with pytest.raises(PriceError):
            parse_price(bad)
    prices = Prices(by_model={"m": (1.0, 2.0)}, by_backend={"local": (0.0, 0.0)})
    r = RequestResult(index=0, tier="t", model="m", backend="remote:a", ok=True, prompt_tokens=1000,
                      output_tokens=500)
    assert prices.cost(r) == pytest.approx((1000 * 1 + 500 * 2) / 1e6)
    r.backend = "local"
    assert prices.cost(r) == 0.0
    r.model, r.backend = "other", "remote:a"
    assert prices.cost(r) is None
    assert [lv.concurrency for lv in levels_from(_args("--concurrency", "1,4,16"))] == [1, 4, 16]
    rates = levels_from(_args("--rate", "2,inf", "--requests", "5", "--max-concurrency", "3"))
    assert rates[0].rate == 2 and math.isinf(rates[1].rate) and rates[1].max_concurrency == 3
    for bad in (("--rate", "inf", "--duration", "1"), ("--rate", "1", "--concurrency", "2"), ("--concurrency", "0"),
                ("--max-concurrency", "2")):
        with pytest.raises(UsageError):
            levels_from(_args(*bad))
    assert normalise_base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalise_base_url("https://api.example.com/v1/") == "https://api.example.com/v1"
    with pytest.raises(UsageError):
        normalise_base_url("ftp://x")


def _result(i: int, *, ok: bool = True, ttft: float = 10.0, itl: list[float] | None = None, tier: str = "t",
            backend: str = "local", out: int = 4) -> RequestResult:
    itl = [5.0] * (out - 1) if itl is None else itl
    return RequestResult(index=i, tier=tier, model="m", backend=backend, ok=ok, error=None if ok else "http_500",
                         ttft_ms=ttft if ok else None, itl_ms=itl if ok else [],
                         e2e_ms=ttft + sum(itl), output_tokens=out if ok else 0)


def test_summary_goodput_and_groups_by_hand():
    rs = [_result(0, ttft=10), _result(1, ttft=300, tier="u"), _result(2, ttft=20, itl=[50.0, 50.0, 50.0]),
          _result(3, ok=False, backend="remote:a"), _result(4, ttft=100, itl=[], out=1, backend="remote:a")]
    s = summarise(rs, 2.0, Slo(ttft_ms=100, itl_ms=10))
    assert s["requests"] == 5 and s["ok"] == 4 and s["errors_by_kind"] == {"http_500": 1}
    assert s["request_rate"] == 2.0 and s["output_tokens"] == 4 + 4 + 4 + 1
    assert s["goodput"] == {"met": 2, "rate": 1.0, "fraction": 0.4}  # 0 and 4 (no gap): 1 too slow, 2 ITL
    assert s["ttft_ms"]["p50"] == 60.0  # of 10, 20, 100, 300
    assert s["by_tier"]["u"]["requests"] == 1 and s["by_backend"]["remote:a"]["errors"] == 1
    assert summarise(rs, 2.0, Slo())["goodput"] is None


def test_compare_pairs_levels_by_label_and_divides():
    def lv(label: str, rate: float, ttft: float) -> dict:
        return {"level": {"label": label}, "summary": {"request_rate": rate, "ttft_ms": {"p50": ttft}}}

    rows = compare_rows([lv("concurrency 1", 2.0, 10.0), lv("concurrency 4", 4.0, 20.0)],
                        [lv("concurrency 4", 6.0, 10.0)])
    assert [(r[0], r[1], r[4]) for r in rows] == [("concurrency 4", "requests/s", 1.5),
                                                   ("concurrency 4", "TTFT p50 ms", 0.5)]


def test_embeddings_summary_by_hand():
    def r(i: int, *, ok: bool = True, tokens: int | None = 10, words: int = 7, e2e: float = 10.0,
          backend: str = "local") -> RequestResult:
        return RequestResult(index=i, tier="t", model="e", backend=backend, ok=ok, error=None if ok else "http_503",
                             e2e_ms=e2e, prompt_tokens=tokens if ok else None, prompt_words=words, inputs=4)

    rs = [r(0, e2e=10.0), r(1, tokens=None, words=30, e2e=20.0), r(2, ok=False, backend="remote:a"),
          r(3, e2e=40.0, backend="remote:a")]
    s = summarise(rs, 2.0, Slo(), endpoint="embeddings")
    assert s["endpoint"] == "embeddings" and s["requests"] == 4 and s["ok"] == 3
    assert s["inputs"] == 12 and s["input_rate"] == 6.0 and s["request_rate"] == 1.5  # answered ones only
    assert s["prompt_tokens"] == 10 + 30 + 10 and s["prompt_tokens_unreported"] == 1  # no usage: its words
    assert s["prompt_throughput"] == 25.0 and s["errors_by_kind"] == {"http_503": 1}
    assert s["e2e_ms"]["p50"] == 20.0 and "ttft_ms" not in s and "goodput" not in s
    assert s["by_backend"]["remote:a"]["share"] == 0.5 and s["by_backend"]["remote:a"]["inputs"] == 4
    assert s["by_tier"]["t"]["share"] == 1.0
    assert "share" not in summarise(rs, 2.0, Slo())["by_tier"]["t"]  # chat groups unchanged
