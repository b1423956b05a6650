import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    """One real SmolLM2 engine for the engine tests (loading takes a few seconds)."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(kv_cache_tokens=16384, max_running_requests=32))


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer
