"""Figures from a level's results: rates, percentiles, errors by kind, goodput under an SLO, cost.

Conventions (the same for the whole run, each tier and each backend):
* `request_rate` and `output_throughput` count successful requests (and their output tokens) over the
  level's duration (first send to last answer); errors are counted apart, by kind;
* latency percentiles (numpy's linear interpolation) are over successful requests; ITL pools every
  gap of every successful request; TPOT is a request's (e2e - TTFT) / (output tokens - 1);
* goodput: successful requests with TTFT <= `--slo-ttft-ms` and, when `--slo-itl-ms` is given, a mean
  inter-token latency <= it (a request with one text chunk has no gap and meets it), per second of
  the level; a successful request with no text at all meets the TTFT SLO when its e2e does;
* cost: per request from its usage (`prompt_tokens`, `completion_tokens`) and the price of its
  backend (`--price-backend`), else of its model (`--price`), in dollars per million tokens; a request
  without usage is priced on its prompt's word count and its counted chunks; a failed one without
  usage costs nothing; with no price for it, its cost is None and it is counted as unpriced.

Embeddings (`endpoint="embeddings"`) have no stream, so no TTFT, ITL, TPOT, output tokens or goodput:
a group has `request_rate`, `inputs` and `input_rate` (the inputs of successful requests per second),
`prompt_tokens` and `prompt_throughput` (from each successful request's `usage.prompt_tokens`, else
its word count: `prompt_tokens_unreported` says how many had no usage), the end-to-end latency
`e2e_ms`, errors by kind and cost; the tier and backend groups add `share`, their fraction of the
level's requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from loadgen.client import RequestResult

Price = tuple[float, float]  # dollars per million (input, output) tokens


class PriceError(ValueError):
    pass


def parse_price(item: str) -> tuple[str, Price]:
    """`NAME=IN:OUT` (NAME may itself contain ':' and '=', e.g. `remote:holysheep=0.15:0.6`)."""
    name, sep, value = item.rpartition("=")
    parts = value.split(":")
    try:
        if not sep or not name or len(parts) != 2:
            raise ValueError
        price = (float(parts[0]), float(parts[1]))
        if min(price) < 0:
            raise ValueError
    except ValueError:
        raise PriceError(f"bad price {item!r}: NAME=IN:OUT, dollars per million tokens, e.g. "
                         "gpt-4o-mini=0.15:0.6") from None
    return name, price


@dataclass
class Prices:
    by_model: dict[str, Price] = field(default_factory=dict)
    by_backend: dict[str, Price] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_model or self.by_backend)

    def price(self, r: RequestResult) -> Price | None:
        return self.by_backend.get(r.backend) or self.by_model.get(r.model)

    def cost(self, r: RequestResult) -> float | None:
        price = self.price(r)
        if price is None:
            return None
        if r.prompt_tokens is None and not r.ok:
            return 0.0
        prompt = r.prompt_tokens if r.prompt_tokens is not None else r.prompt_words
        return (prompt * price[0] + r.output_tokens * price[1]) / 1e6

    def apply(self, results: Iterable[RequestResult]) -> None:
        for r in results:
            r.cost = self.cost(r)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def __bool__(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def meets(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None:
            first = r.ttft_ms if r.ttft_ms is not None else r.e2e_ms
            if first > self.ttft_ms:
                return False
        if self.itl_ms is not None and r.itl_ms and sum(r.itl_ms) / len(r.itl_ms) > self.itl_ms:
            return False
        return True

    def to_json(self) -> dict[str, object]:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3), "max": round(float(a.max()), 3)}


def _cost(results: list[RequestResult]) -> dict[str, object] | None:
    costs = [r.cost for r in results if r.cost is not None]
    if not costs:
        return None
    return {"total": round(sum(costs), 10), "priced": len(costs), "unpriced": len(results) - len(costs),
            "per_1k_requests": round(sum(costs) / len(costs) * 1000, 10)}


def _errors(results: list[RequestResult], ok: list[RequestResult]) -> dict[str, object]:
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "error_rate": round((len(results) - len(ok)) / len(results), 6) if results else 0.0,
            "errors_by_kind": dict(sorted(Counter(r.error or "?" for r in results if not r.ok).items()))}


def _embeddings_group(results: list[RequestResult], duration_s: float) -> dict[str, object]:
    ok = [r for r in results if r.ok]
    inputs = sum(r.inputs or 0 for r in ok)
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_words for r in ok)
    return {
        **_errors(results, ok),
        "request_rate": round(len(ok) / duration_s, 6),
        "inputs": inputs,
        "input_rate": round(inputs / duration_s, 6),
        "prompt_tokens": prompt,
        "prompt_tokens_unreported": sum(1 for r in ok if r.prompt_tokens is None),
        "prompt_throughput": round(prompt / duration_s, 6),
        "e2e_ms": percentiles([r.e2e_ms for r in ok]),
        "cost": _cost(results),
    }


def _group(results: list[RequestResult], duration_s: float, slo: Slo) -> dict[str, object]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1) for r in ok
             if r.ttft_ms is not None and r.output_tokens > 1]
    group: dict[str, object] = {
        **_errors(results, ok),
        "request_rate": round(len(ok) / duration_s, 6),
        "output_tokens": out_tokens,
        "output_throughput": round(out_tokens / duration_s, 6),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),  # prompt tokens the server's prefix cache served
        "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl_ms]),
        "e2e_ms": percentiles([r.e2e_ms for r in ok]),
        "tpot_ms": percentiles(tpots),
        "goodput": None,
        "cost": _cost(results),
    }
    if slo:
        met = sum(1 for r in results if slo.meets(r))
        group["goodput"] = {"met": met, "rate": round(met / duration_s, 6),
                            "fraction": round(met / len(results), 6) if results else 0.0}
    return group


def summarise(results: list[RequestResult], duration_s: float, slo: Slo,
              endpoint: str = "chat") -> dict[str, object]:
    """The level's figures: the whole level, then `by_tier` and `by_backend` (the same fields each);
    `endpoint` ("chat" or "embeddings") says which figures (the module's docstring)."""
    def group(rs: list[RequestResult]) -> dict[str, object]:
        return _embeddings_group(rs, duration_s) if endpoint == "embeddings" else _group(rs, duration_s, slo)

    summary: dict[str, object] = {"endpoint": endpoint, "duration_s": round(duration_s, 6), **group(results)}
    for name, attr in (("by_tier", "tier"), ("by_backend", "backend")):
        keys = sorted({getattr(r, attr) for r in results})
        groups: dict[str, object] = {}
        for k in keys:
            members = [r for r in results if getattr(r, attr) == k]
            groups[k] = g = group(members)
            if endpoint == "embeddings":
                g["share"] = round(len(members) / len(results), 6)
        summary[name] = groups
    return summary


def num(d: object, *path: str) -> float | None:
    """The number at `path` in nested JSON-like dicts, or None (missing, null, not a number)."""
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def sub(d: object, *path: str) -> dict[str, object]:
    """The dict at `path`, or {}."""
    for p in path:
        if not isinstance(d, dict):
            return {}
        d = d.get(p)
    return d if isinstance(d, dict) else {}
