"""What the operator's dashboard shows: the JSON of `GET /dashboard/data` and the files of the page
(`observability/static/`: no build step, no CDN, hand-drawn SVG charts) that refreshes from it. The
routes are http/dashboard.py's; both are admin-only once keys exist (`admission/auth.py` ADMIN_PATHS),
like /metrics.

The JSON is read from the same Prometheus registry that /metrics serves, so every raw figure on the page
equals the metric of the same name at that moment; rates (requests/s, tokens/s, spend/s) are computed here
from the counters sampled on each refresh, over the last `RATE_WINDOW_S` (the window actually used is in
the answer as `rate_window_s`). Quantiles are estimated from the histograms' cumulative buckets as
Prometheus's `histogram_quantile` does (linear within a bucket).

Tokens by tier: the token counters are labelled by key, so a key's tokens count for the key's current
tier (anonymous requests: `auth.anonymous_tier`; with `metrics.key_labels = "none"` the tier is "unknown").

KV usage (`sluice_engine_kv_usage_ratio`, registered here on the metrics registry): the share of the
engines' KV blocks held by running sequences, as the workers report it (`WorkerStats.kv_usage`: the
embedded engine's, or the mean over the `sluice worker`s behind the Redis queue).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from prometheus_client import Gauge

from gateway.admission.keys import KeyStore
from gateway.admission.usage import ANON
from gateway.messages import LOCAL, WorkerStats
from gateway.observability.metrics import Metrics
from gateway.settings import ProviderSettings, Settings

RATE_WINDOW_S = 10.0
_HISTORY_S = 60.0
_STATIC = ("index.html", "dashboard.js", "dashboard.css")
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class _Worker(Protocol):
    def stats(self) -> WorkerStats: ...


class _Provider(Protocol):
    @property
    def settings(self) -> ProviderSettings: ...


class _Providers(Protocol):
    def status(self) -> dict[str, dict[str, Any]]: ...

    def chain(self, model: str) -> Sequence[_Provider]: ...


class GatewayView(Protocol):
    """What the dashboard reads of a running gateway (`gateway.state.GatewayState` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def keys(self) -> KeyStore: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def model_name(self) -> str | None: ...

    @property
    def local_worker(self) -> _Worker | None: ...

    @property
    def remote(self) -> _Providers | None: ...

    def worker_stats(self) -> list[WorkerStats]: ...

    def model_views(self) -> list[ModelView]: ...


@dataclass(frozen=True)
class ModelView:
    """One served model as the dashboard shows it (`GatewayState.model_views`)."""

    id: str
    kind: str  # chat | embedding
    ready: bool
    workers: list[WorkerStats]


def _snapshot(state: GatewayView) -> Sample:
    """Every sample of the registry: (name, sorted labels) -> value."""
    out: Sample = {}
    for family in state.metrics.registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _select(snap: Sample, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(labels), v) for (n, labels), v in snap.items() if n == name]


def _sum_by(snap: Sample, name: str, by: tuple[str, ...], key_map: Any = None) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for labels, v in _select(snap, name):
        if key_map is not None:
            labels = {**labels, "tier": key_map(labels.get("key", ""))}
        k = tuple(labels.get(b, "") for b in by)
        out[k] = out.get(k, 0.0) + v
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's estimate from cumulative (upper bound, count) buckets; None without observations."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # the highest finite bound, as Prometheus answers
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _quantiles(snap: Sample, name: str) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for labels, v in _select(snap, name + "_bucket"):
        groups.setdefault((labels.get("tier", ""), labels.get("backend", "")), []).append(
            (float(labels["le"]), v))
    rows = []
    for (tier, backend), buckets in sorted(groups.items()):
        count = max(c for _, c in buckets)
        if count <= 0:
            continue
        rows.append({"tier": tier, "backend": backend, "count": int(count),
                     "p50_s": histogram_quantile(0.5, buckets), "p99_s": histogram_quantile(0.99, buckets)})
    return rows


class DashboardData:
    """Keeps the counter samples of recent refreshes (for rates) and builds the JSON."""

    def __init__(self, state: GatewayView):
        self.state = state
        self.history: deque[tuple[float, Sample]] = deque()
        self.kv_gauge = Gauge("sluice_engine_kv_usage_ratio",
                              "Share of the engines' KV cache blocks held by running sequences",
                              registry=state.metrics.registry)
        self.kv_gauge.set_function(lambda: self.kv_usage() or 0.0)

    def kv_usage(self) -> float | None:
        reported = [w.kv_usage for w in self.state.worker_stats() if w.kv_usage is not None]
        return sum(reported) / len(reported) if reported else None

    def _tier_of_key(self) -> Any:
        st = self.state
        labels = {st.metrics.key_label(r.name): r.tier for r in st.keys.records}
        labels[ANON] = st.settings.auth.anonymous_tier

        def tier(label: str) -> str:
            return labels.get(label, "unknown")
        return tier

    def _rates(self, now: float, snap: Sample) -> tuple[Sample, float]:
        while self.history and now - self.history[0][0] > _HISTORY_S:
            self.history.popleft()
        base: tuple[float, Sample] | None = None
        for t, s in self.history:  # the newest sample at least RATE_WINDOW_S old, else the oldest
            if now - t >= RATE_WINDOW_S or base is None:
                base = (t, s)
        if not self.history or now - self.history[-1][0] >= 0.5:  # one sample per 0.5 s, however many pages poll
            self.history.append((now, snap))
        if base is None or now - base[0] < 0.2:
            return {}, 0.0
        dt = now - base[0]
        return {k: max(0.0, (v - base[1].get(k, 0.0)) / dt) for k, v in snap.items()}, dt

    async def build(self) -> dict[str, Any]:
        st = self.state
        if st.local_worker is not None:  # as /metrics does
            st.metrics.in_flight.set(st.local_worker.stats().in_flight)
        now = time.monotonic()
        snap = _snapshot(st)
        rates, window = self._rates(now, snap)
        have_rates = window > 0
        tier_of = self._tier_of_key()

        def rate_rows(name: str, by: tuple[str, ...], key_map: Any = None, value: str = "total") -> list[dict]:
            totals = _sum_by(snap, name, by, key_map)
            per_s = _sum_by(rates, name, by, key_map) if have_rates else {}
            return [{**dict(zip(by, k)), value: v, "per_s": per_s.get(k) if have_rates else None}
                    for k, v in sorted(totals.items())]

        tokens = [r for r in rate_rows("sluice_usage_tokens_total", ("tier", "backend", "kind"), tier_of)
                  if r["kind"] in ("prompt", "completion")]
        gauges = {name: {labels.get("tier", ""): v for labels, v in _select(snap, name)}
                  for name in ("sluice_queue_depth", "sluice_queue_wait_estimate_seconds")}
        queue = [{"tier": t, "depth": gauges["sluice_queue_depth"].get(t, 0.0),
                  "wait_estimate_s": (None if gauges["sluice_queue_wait_estimate_seconds"].get(t, 0.0) < 0
                                      else gauges["sluice_queue_wait_estimate_seconds"].get(t, 0.0))}
                 for t in st.settings.tiers]

        def gauge(name: str) -> float | None:
            vals = [v for _, v in _select(snap, name)]
            return vals[0] if vals else None

        workers = []
        for w in st.worker_stats():
            state_word = ("draining" if w.draining else "busy" if w.in_flight >= w.capacity > 0
                          else "serving" if w.in_flight else "idle")
            workers.append({"id": w.worker_id or "embedded", "model": w.model, "state": state_word,
                            "capacity": w.capacity, "in_flight": w.in_flight, "running": w.running,
                            "waiting": w.waiting, "steps": w.steps, "step_errors": w.step_errors})
        providers = []
        attempts = _sum_by(snap, "sluice_remote_attempts_total", ("provider", "outcome"))
        attempt_rates = _sum_by(rates, "sluice_remote_attempts_total", ("provider", "outcome")) if have_rates else {}
        if st.remote is not None:
            for name, status in st.remote.status().items():
                outcomes = {o: int(v) for (p, o), v in attempts.items() if p == name}
                err_rate = sum(v for (p, o), v in attempt_rates.items() if p == name and o != "ok")
                providers.append({"name": name, "circuit": status.get("circuit"), "in_flight": status.get("in_flight"),
                                  "config_error": status.get("error"), "retry_after_s": status.get("retry_after_s"),
                                  "attempts": outcomes, "errors": sum(v for o, v in outcomes.items() if o != "ok"),
                                  "errors_per_s": err_rate if have_rates else None})
        by_model = _sum_by(snap, "sluice_usage_requests_total", ("model",))
        model_rates = _sum_by(rates, "sluice_usage_requests_total", ("model",)) if have_rates else {}
        model_tokens = _sum_by(snap, "sluice_usage_tokens_total", ("model", "kind"))
        inputs = _sum_by(snap, "sluice_embedding_inputs_total", ("model",))
        models = [{"id": m.id, "kind": m.kind, "ready": m.ready, "workers": len(m.workers),
                   "in_flight": sum(w.in_flight for w in m.workers),
                   "requests": by_model.get((m.id,), 0.0),
                   "per_s": model_rates.get((m.id,), 0.0) if have_rates else None,
                   "prompt_tokens": model_tokens.get((m.id, "prompt"), 0.0),
                   "completion_tokens": model_tokens.get((m.id, "completion"), 0.0),
                   "inputs": inputs.get((m.id,), 0.0) if m.kind == "embedding" else None}
                  for m in st.model_views()]
        spend = [{"key": k, "model": m, "cost": v}
                 for (k, m), v in sorted(_sum_by(snap, "sluice_usage_cost_total", ("key", "model")).items())]
        return {
            "generated_at": time.time(),
            "rate_window_s": window if have_rates else None,
            "model": st.model_name,
            "tiers": list(st.settings.tiers),
            "requests": rate_rows("sluice_route_decisions_total", ("tier", "backend")),
            "tokens": tokens,
            "queue": queue,
            "latency": {"ttft": _quantiles(snap, "sluice_ttft_seconds"),
                        "inter_token": _quantiles(snap, "sluice_inter_token_seconds")},
            "engine": {"busy_ratio": gauge("sluice_engine_busy_ratio"), "kv_usage": self.kv_usage(),
                       "in_flight": gauge("sluice_in_flight")},
            "workers": workers,
            "models": models,
            "providers": providers,
            "spend": spend,
            "savings": self._savings(snap),
            "counters": {f"{n}{{{','.join(f'{k}={v}' for k, v in labels)}}}": v for (n, labels), v in snap.items()
                         if n.endswith("_total")},
        }

    def _savings(self, snap: Sample) -> dict[str, Any]:
        """What the tokens cost vs their remote equivalent, as the usage ledger prices it: a local answer
        at the first provider serving that model (by `order`); a remote answer, or a model no provider
        serves, at its own cost (so it saves nothing)."""
        st = self.state
        tokens = _sum_by(snap, "sluice_usage_tokens_total", ("model", "backend", "kind"))
        costs = _sum_by(snap, "sluice_usage_cost_total", ("model", "backend"))
        rows = []
        for model, backend in sorted({(m, b) for m, b, _ in tokens}):
            prompt, cached, completion = (int(tokens.get((model, backend, k), 0)) for k in
                                          ("prompt", "cached", "completion"))
            chain = sorted(st.remote.chain(model), key=lambda p: p.settings.order) if st.remote is not None else []
            actual = costs.get((model, backend), 0.0)
            ref = chain[0].settings if chain and backend == LOCAL else None
            remote_cost = ref.cost(prompt, cached, completion) if ref is not None else actual
            rows.append({"model": model, "backend": backend, "prompt_tokens": prompt, "cached_tokens": cached,
                         "completion_tokens": completion, "cost": actual, "remote_price_cost": remote_cost,
                         "reference_provider": ref.name if ref is not None else None,
                         "saved": round(remote_cost - actual, 12) + 0.0})
        return {"rows": rows, "cost": sum(r["cost"] for r in rows),
                "remote_price_cost": sum(r["remote_price_cost"] for r in rows),
                "saved": sum(r["saved"] for r in rows),
                "local_price": dict(st.settings.routing.local_price)}


def asset(name: str) -> tuple[bytes, str] | None:
    """A file of the page and its content type (None: not one of the page's files)."""
    if name not in _STATIC:
        return None
    body = resources.files("gateway.observability").joinpath("static", name).read_bytes()
    return body, _TYPES[name[name.rfind("."):]]
