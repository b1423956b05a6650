"""Prometheus metrics of routing, remote providers, usage and the local engine (issue 5).

They register into the gateway's registry (`GatewayState.registry`), next to the request counters
that `app.py` already exports, so `/metrics` serves them all. Gauges that describe the local side
(queue depth per tier, the engine's busy ratio) are refreshed by a sampler task once a second.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.queue_time = Histogram("sluice_queue_seconds", "Time a local request waited in the queue",
                                    ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("sluice_ttft_seconds", "Time to first token", ["tier", "backend"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sluice_inter_token_seconds", "Time between streamed text outputs",
                             ["tier", "backend"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("sluice_e2e_seconds", "End-to-end generation latency", ["tier", "backend"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("sluice_queue_depth", "Requests waiting in the local queue", ["tier"],
                                 registry=r)
        self.queue_wait_estimate = Gauge("sluice_queue_wait_estimate_seconds",
                                         "Estimated local queue wait for a new request", ["tier"], registry=r)
        self.busy_ratio = Gauge("sluice_engine_busy_ratio",
                                "Fraction of wall time the engine spent stepping (last sampling window)",
                                registry=r)
        self.busy_seconds = Gauge("sluice_engine_busy_seconds", "Cumulative seconds the engine spent in step()",
                                  registry=r)
        self.decisions = Counter("sluice_route_decisions_total", "Routing decisions",
                                 ["tier", "backend", "reason"], registry=r)
        self.attempts = Counter("sluice_remote_attempts_total", "Calls to remote providers by outcome",
                                ["provider", "outcome"], registry=r)
        self.attempt_seconds = Histogram("sluice_remote_attempt_seconds", "Remote call time until the answer "
                                         "or first token (or failure)", ["provider"], buckets=_LATENCY_BUCKETS,
                                         registry=r)
        self.breaker = Gauge("sluice_provider_circuit_open", "1 when the provider's circuit is open",
                             ["provider"], registry=r)
        self.rate_limited = Counter("sluice_rate_limited_total", "Requests refused by per-key limits",
                                    ["key", "reason"], registry=r)
        self.usage_requests = Counter("sluice_usage_requests_total", "Completed requests",
                                      ["key", "model", "backend"], registry=r)
        self.usage_tokens = Counter("sluice_usage_tokens_total", "Tokens by kind (prompt, cached, completion)",
                                    ["key", "model", "backend", "kind"], registry=r)
        self.usage_cost = Counter("sluice_usage_cost_total", "Cost in the configured currency",
                                  ["key", "model", "backend"], registry=r)

    def remote_attempt(self, provider: str, outcome: str, seconds: float) -> None:
        self.attempts.labels(provider, outcome).inc()
        self.attempt_seconds.labels(provider).observe(seconds)
