"""A replica's load, read from the Prometheus text its `/metrics` serves.

Each engine kind names the same three signals differently (summed over label sets, e.g. vLLM's one
series per `model_name`):

    kind           running                        waiting                       KV cache in use (0..1)
    vllm           vllm:num_requests_running      vllm:num_requests_waiting     vllm:kv_cache_usage_perc
                                                                                (vllm:gpu_cache_usage_perc before v0.10)
    sglang         sglang:num_running_reqs        sglang:num_queue_reqs         sglang:token_usage
    llama-server   llamacpp:requests_processing   llamacpp:requests_deferred    llamacpp:kv_cache_usage_ratio
    sluice         sluice_in_flight               sluice_queue_depth (tiers)    -

`openai` replicas export nothing known: their load is Sluice's own in-flight count alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",), ("sglang:token_usage",)),
    "llama-server": (("llamacpp:requests_processing",), ("llamacpp:requests_deferred",),
                     ("llamacpp:kv_cache_usage_ratio",)),
    "sluice": (("sluice_in_flight",), ("sluice_queue_depth",), ()),
}


@dataclass(frozen=True)
class ReplicaLoad:
    running: float
    waiting: float
    kv_usage: float | None  # the KV cache's used share, 0..1; None when the engine does not say


class MetricsMissing(ValueError):
    """The text lacks the kind's running or waiting series: the replica's load is unknown."""


def parse_load(kind: str, text: str) -> ReplicaLoad:
    """The load in `text` (Prometheus exposition format) for an engine of `kind`; raises
    MetricsMissing when the running or waiting series is absent, ValueError on text that does not parse."""
    running_names, waiting_names, kv_names = NAMES[kind]
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            sums[s.name] = sums.get(s.name, 0.0) + float(s.value)

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    running, waiting = first(running_names), first(waiting_names)
    if running is None or waiting is None:
        missing = running_names[0] if running is None else waiting_names[0]
        raise MetricsMissing(f"no `{missing}` in the replica's metrics (is it a {kind} server?)")
    return ReplicaLoad(running, waiting, first(kv_names))
