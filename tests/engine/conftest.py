import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest


@pytest.fixture(scope="session")
def engine():
    """One real SmolLM2 engine for the engine tests (loading takes a few seconds).

    fp32 weights: these tests check that batching, chunking, preemption and caching do not change
    outputs, so rounding noise must stay far below the near-tie tolerance. The bf16 serving default
    is checked against the reference separately (test_reference.py)."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(kv_cache_tokens=16384, max_running_requests=32, weight_dtype="float32"))


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer
