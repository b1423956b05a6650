import dataclasses
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


@pytest.fixture
def configured(engine):
    """Run the shared engine under other scheduling settings and a smaller KV pool, then restore its
    settings with an empty prefix cache."""
    saved = (engine.config, engine.block_manager, engine.scheduler)

    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

    def apply(num_blocks: int | None = None, **changes):
        engine.config = dataclasses.replace(saved[0], **changes)
        engine.block_manager = BlockManager(num_blocks or engine.runner.num_blocks, engine.config.block_size,
                                            engine.config.enable_prefix_caching)
        engine.scheduler = Scheduler(engine.config, engine.block_manager)
        return engine

    yield apply
    # A fresh block manager, not the saved one: the other pool reused the same KV slots, so the saved
    # one's prefix-cache entries would now point at overwritten K/V.
    engine.config = saved[0]
    engine.block_manager = BlockManager(saved[1].num_blocks, saved[0].block_size, saved[0].enable_prefix_caching)
    engine.scheduler = Scheduler(engine.config, engine.block_manager)


@pytest.fixture(scope="session")
def embedding_engine():
    """One real all-MiniLM-L6-v2 encoder engine (loads in about a second), in the dtype this machine
    gets by default (bf16 where the CPU multiplies it natively)."""
    from engine import EmbeddingEngine

    return EmbeddingEngine()


@pytest.fixture(scope="session")
def minilm_reference():
    """sentence-transformers' own pipeline on the same all-MiniLM-L6-v2 folder (the reference extra)."""
    st = pytest.importorskip("sentence_transformers")
    from engine.embedding.loader import default_model_path

    return st.SentenceTransformer(str(default_model_path()), device="cpu")
