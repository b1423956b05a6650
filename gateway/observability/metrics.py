"""Every Prometheus metric of the gateway, in one registry that `/metrics` serves: HTTP requests,
routing decisions, remote providers, usage by key, latencies and the local engine. Gauges that describe
state (queue depth per tier, the engine's busy ratio) are refreshed by `routing.sampler`.

Metrics labelled by API key never show the key's name by default: the `key` label is the key's short
id (the first 8 hex digits of its hash, as `sluice keys list` shows), or its name only when
`metrics.key_labels = "name"` is configured ("none": one label for every key).

Labelled metrics are `Family`s: their children are kept by label values, because prometheus_client's
`labels()` checks, locks and builds tuples on every call, about ten times per request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from gateway.admission.usage import ANON
from gateway.messages import QueueItem


def hashed_key_label(name: str) -> str:
    """The label of a key name when no key store is at hand: a short hash, not the name."""
    return name if name == ANON else "n" + hashlib.sha256(name.encode("utf-8")).hexdigest()[:7]


def make_key_label(keys: Any, mode: str) -> Callable[[str], str]:
    """`mode` "id": the key's short id from the store; "name": the key's name; "none": "key" for all."""
    if mode == "name":
        return lambda name: name
    if mode == "none":
        return lambda name: name if name == ANON else "key"
    return lambda name: name if name == ANON else keys.label_for(name)


M = TypeVar("M", bound=MetricWrapperBase)
_MAX_CHILDREN = 10_000  # label sets kept per metric (beyond it `labels()` is asked each time)


class Family(Generic[M]):
    """A labelled metric whose children are kept by label values."""

    def __init__(self, metric: M):
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self.metric.labels(*values)
            if len(self._children) < _MAX_CHILDREN:
                self._children[values] = child
        return child


class _KeyLabelled(Family[M]):
    """A metric whose first label is a key name, turned into the configured label on the way in."""

    def __init__(self, metric: M, owner: Metrics):
        super().__init__(metric)
        self._owner = owner

    def labels(self, *values: str) -> M:
        key, *rest = values
        return super().labels(self._owner.key_label(key), *rest)


_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, key_label: Callable[[str], str] | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.key_label: Callable[[str], str] = key_label or hashed_key_label
        self.requests = Family(Counter("sluice_requests_total", "HTTP requests", ["endpoint", "status"],
                                       registry=r))
        self.completion_tokens = Counter("sluice_completion_tokens_total", "Generated tokens", registry=r)
        self.request_seconds = Family(Histogram("sluice_request_seconds", "Request latency", ["endpoint"],
                                                registry=r))
        self.in_flight = Gauge("sluice_in_flight", "Requests inside the engine", registry=r)
        self.queue_time = Family(Histogram("sluice_queue_seconds", "Time a local request waited in the queue",
                                           ["tier"], buckets=_LATENCY_BUCKETS, registry=r))
        self.ttft = Family(Histogram("sluice_ttft_seconds", "Time to first token", ["tier", "backend"],
                                     buckets=_LATENCY_BUCKETS, registry=r))
        self.itl = Family(Histogram("sluice_inter_token_seconds", "Time between streamed text outputs",
                                    ["tier", "backend"], buckets=_ITL_BUCKETS, registry=r))
        self.e2e = Family(Histogram("sluice_e2e_seconds", "End-to-end generation latency", ["tier", "backend"],
                                    buckets=_LATENCY_BUCKETS, registry=r))
        self.queue_depth = Family(Gauge("sluice_queue_depth", "Requests waiting in the local queue", ["tier"],
                                        registry=r))
        self.queue_wait_estimate = Family(Gauge("sluice_queue_wait_estimate_seconds",
                                                "Estimated local queue wait for a new request", ["tier"], registry=r))
        self.busy_ratio = Gauge("sluice_engine_busy_ratio",
                                "Fraction of wall time the engine spent stepping (last sampling window)",
                                registry=r)
        self.busy_seconds = Gauge("sluice_engine_busy_seconds", "Cumulative seconds the engine spent in step()",
                                  registry=r)
        self.decisions = Family(Counter("sluice_route_decisions_total", "Routing decisions",
                                        ["tier", "backend", "reason"], registry=r))
        self.attempts = Family(Counter("sluice_remote_attempts_total", "Calls to remote providers by outcome",
                                       ["provider", "outcome"], registry=r))
        self.attempt_seconds = Family(Histogram("sluice_remote_attempt_seconds", "Remote call time until the "
                                                "answer or first token (or failure)", ["provider"],
                                                buckets=_LATENCY_BUCKETS, registry=r))
        self.breaker = Family(Gauge("sluice_provider_circuit_open", "1 when the provider's circuit is open",
                                    ["provider"], registry=r))
        # Labelled by API key: the label is `key_label(name)` (a short id unless configured otherwise).
        self.rate_limited = _KeyLabelled(Counter(
            "sluice_rate_limited_total", "Requests refused by per-key limits", ["key", "reason"], registry=r), self)
        self.usage_requests = _KeyLabelled(Counter(
            "sluice_usage_requests_total", "Completed requests", ["key", "model", "backend"], registry=r), self)
        self.usage_tokens = _KeyLabelled(Counter(
            "sluice_usage_tokens_total", "Tokens by kind (prompt, cached, completion)",
            ["key", "model", "backend", "kind"], registry=r), self)
        self.usage_cost = _KeyLabelled(Counter(
            "sluice_usage_cost_total", "Cost in the configured currency", ["key", "model", "backend"],
            registry=r), self)

        self.embedding_inputs = Family(Counter("sluice_embedding_inputs_total", "Inputs embedded, by model and "
                                               "backend", ["model", "backend"], registry=r))
        self.embedding_request_inputs = Family(Histogram(
            "sluice_embedding_request_inputs", "Inputs per /v1/embeddings request", ["model"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048), registry=r))
        self.embedding_step_inputs = Family(Gauge(
            "sluice_embedding_step_inputs", "Inputs per embedding engine step (the batch), mean since start",
            ["model"], registry=r))

    def observe_queue_time(self, items: list[QueueItem]) -> None:
        """Called by the embedded worker with each batch it pulls."""
        now = time.time()
        for it in items:
            self.queue_time.labels(it.tier).observe(max(0.0, now - it.enqueued_at))

    def remote_attempt(self, provider: str, outcome: str, seconds: float) -> None:
        self.attempts.labels(provider, outcome).inc()
        self.attempt_seconds.labels(provider).observe(seconds)
