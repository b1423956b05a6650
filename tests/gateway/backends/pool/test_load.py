"""Reading a replica's load from its /metrics text, for each engine kind, from samples in the formats the
engines document (vLLM's and SGLang's per-model series, llama-server's unlabelled ones under --metrics)."""

from __future__ import annotations

import pytest

from gateway.backends.pool.load import MetricsMissing, ReplicaLoad, parse_load

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 123456.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 99.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 99.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5
"""

VLLM_OLD = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""

SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.81
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen/Qwen2.5-7B-Instruct"} 0.5
"""

LLAMA_SERVER = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5120
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 39080
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 46
"""

SLUICE = """# HELP sluice_in_flight Requests inside the engine
# TYPE sluice_in_flight gauge
sluice_in_flight 5.0
# HELP sluice_queue_depth Requests waiting in the local queue
# TYPE sluice_queue_depth gauge
sluice_queue_depth{tier="pro"} 1.0
sluice_queue_depth{tier="standard"} 2.0
# HELP sluice_requests_total HTTP requests
# TYPE sluice_requests_total counter
sluice_requests_total{endpoint="chat",status="200"} 10.0
"""


@pytest.mark.parametrize(("kind", "text", "want"), [
    ("vllm", VLLM, ReplicaLoad(15.0, 4.0, 0.42)),  # summed over the engine's data-parallel ranks
    ("vllm", VLLM_OLD, ReplicaLoad(2.0, 0.0, 0.25)),
    ("sglang", SGLANG, ReplicaLoad(7.0, 2.0, 0.81)),
    ("llama-server", LLAMA_SERVER, ReplicaLoad(4.0, 46.0, None)),
    ("sluice", SLUICE, ReplicaLoad(5.0, 3.0, None)),
])
def test_each_kind_reads_running_waiting_and_kv_usage(kind, text, want):
    assert parse_load(kind, text) == want


def test_another_kinds_metrics_are_refused_by_name():
    with pytest.raises(MetricsMissing, match="vllm:num_requests_running"):
        parse_load("vllm", SGLANG)
    with pytest.raises(MetricsMissing, match="llamacpp:requests_deferred"):
        parse_load("llama-server", "llamacpp:requests_processing 1\n")


def test_text_that_is_not_prometheus_raises_value_error():
    with pytest.raises(ValueError):
        parse_load("vllm", "<html>502 Bad Gateway</html>")
