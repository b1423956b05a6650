import dataclasses
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest


@pytest.fixture(scope="session")
def engine():
    """One real SmolLM2 engine for the engine tests, on the path that serves by default: the native CPU
    step over the file's 4-bit blocks, with its int16 matmuls at every step size (wide_min_rows=0), so a
    token row is computed the same whatever else is in its step and batching, chunking, preemption and
    caching cannot change outputs. Where the native step cannot run (no C compiler), the torch path
    with fp32 weights, whose rounding noise stays far below the near-tie tolerance of these tests."""
    import kernels.cpu as cpu_kernels
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(kv_cache_tokens=16384, max_running_requests=32, wide_min_rows=0,
                                  weight_dtype="auto" if cpu_kernels.available() else "float32"))


@pytest.fixture(scope="session")
def torch_engine():
    """The torch path with fp32 weights (what a model the native step does not read runs on a CPU, e.g. a
    Hugging Face folder): its matmuls pick their blocking from the step's rows, so the invariance tests
    check it separately, with fp32 keeping rounding noise far below their near-tie tolerance."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(kv_cache_tokens=8192, max_running_requests=8, native_cpu_step=False,
                                  weight_dtype="float32"))


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


def _reconfigurable(engine):
    """Run `engine` under other scheduling settings and a smaller KV pool, then restore its settings with an
    empty prefix cache."""
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


@pytest.fixture
def configured(engine):
    """The shared engine (the native step) under other settings (`_reconfigurable`)."""
    yield from _reconfigurable(engine)


@pytest.fixture
def torch_configured(torch_engine):
    """The torch-path engine under other settings (`_reconfigurable`)."""
    yield from _reconfigurable(torch_engine)


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
