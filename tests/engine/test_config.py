"""Limits that cannot be honoured are errors at start, with a message naming what to change."""

import pytest

from engine.config import EngineConfig, EngineConfigError
from engine.engine import validate_limits


def test_defaults_are_valid():
    cfg = EngineConfig()
    cfg.validate_basic()
    assert validate_limits(cfg, max_model_len=8192, capacity_tokens=65536) == 8191


@pytest.mark.parametrize("changes, capacity, needle", [
    ({"req_max_input_len": 8192}, 65536, "req_max_input_len"),
    ({"req_max_input_len": 5000}, 4096, "KV pool"),
    ({"max_running_requests": 300}, 4096, "max_running_requests"),
    ({"max_running_requests": 64, "max_num_batched_tokens": 32, "chunked_prefill_size": 16}, 65536,
     "max_num_batched_tokens"),
    ({"chunked_prefill_size": 4096}, 65536, "chunked_prefill_size"),
    ({"chunked_prefill_size": 0}, 65536, "without chunked prefill"),
])
def test_unhonourable_limits_fail_at_start(changes, capacity, needle):
    with pytest.raises(EngineConfigError, match=needle):
        validate_limits(EngineConfig(**changes), max_model_len=8192, capacity_tokens=capacity)


@pytest.mark.parametrize("changes", [{"max_running_requests": 0}, {"mem_fraction_static": 1.5},
                                     {"weight_dtype": "int3"}, {"block_size": 0}, {"output_layer_bits": 6},
                                     {"max_step_seconds": -1.0}, {"max_step_seconds": float("nan")}])
def test_bad_values_fail_basic_validation(changes):
    with pytest.raises(EngineConfigError):
        EngineConfig(**changes).validate_basic()
