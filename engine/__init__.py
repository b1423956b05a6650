"""Sluice's inference engine: continuous batching over a paged KV cache, driven by a loop.

Public surface, all of it exported here: `LLMEngine` (add_request / step / abort, and what a worker
reports: `stats`, `kv_usage()`, `max_output_tokens()`), `EngineConfig`, the messages of
engine/request.py (`EngineRequest` in, `RequestOutput` out), and `load_frontend` (a model's tokenizer
and limits without its weights). Beside it, the encoder engine of engine/embedding/: `EmbeddingEngine`
(the same loop API; sentence embeddings from a BERT-family model), `EmbeddingConfig`, and its messages
(`EmbeddingRequest` in, `EmbeddingOutput` out). Callers import from `engine` only; every submodule is
internal.
"""

from .config import EngineConfig, EngineConfigError
from .embedding import (
    EmbeddingConfig,
    EmbeddingEngine,
    EmbeddingFrontend,
    EmbeddingOutput,
    EmbeddingRequest,
    EmbeddingStats,
    load_embedding_frontend,
)
from .engine import EngineStats, LLMEngine
from .frontend import Frontend, load_frontend
from .request import EngineRequest, Guide, RequestOutput, RequestRejected, SamplingParams, TokenLogprob
from .tokenizer import Tokenizer

__all__ = ["EngineConfig", "EngineConfigError", "EngineRequest", "EngineStats", "Frontend", "Guide", "LLMEngine",
           "RequestOutput", "RequestRejected", "SamplingParams", "TokenLogprob", "Tokenizer", "load_frontend",
           "EmbeddingConfig", "EmbeddingEngine", "EmbeddingFrontend", "EmbeddingOutput", "EmbeddingRequest",
           "EmbeddingStats", "load_embedding_frontend"]
