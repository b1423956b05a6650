"""Sluice's inference engine: continuous batching over a paged KV cache, driven by a loop.

Public surface, all of it exported here: `LLMEngine` (add_request / step / abort, and what a worker
reports: `stats`, `kv_usage()`, `max_output_tokens()`), `EngineConfig`, the messages of
engine/request.py (`EngineRequest` in, `RequestOutput` out), and `load_frontend` (a model's tokenizer
and limits without its weights). Beside it, the encoder engine of engine/embedding/: `EmbeddingEngine`
(the same loop API; sentence embeddings from a BERT-family model), `EmbeddingConfig`, and its messages
(`EmbeddingRequest` in, `EmbeddingOutput` out). Callers import from `engine` only; every submodule is
internal.

The names load on first use (PEP 562), so importing one light submodule (the tokenizer, which the
request-preparation helper process unpickles) does not import torch and the model code with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "EngineConfig": ".config", "EngineConfigError": ".config",
    "EmbeddingConfig": ".embedding.config", "EmbeddingEngine": ".embedding.engine",
    "EmbeddingStats": ".embedding.engine", "EmbeddingFrontend": ".embedding.frontend",
    "load_embedding_frontend": ".embedding.frontend", "EmbeddingOutput": ".embedding.request",
    "EmbeddingRequest": ".embedding.request",
    "EngineStats": ".engine", "LLMEngine": ".engine",
    "Frontend": ".frontend", "load_frontend": ".frontend",
    "EngineRequest": ".request", "Guide": ".request", "RequestOutput": ".request", "RequestRejected": ".request",
    "SamplingParams": ".request", "TokenLogprob": ".request",
    "Tokenizer": ".tokenizer",
}

if TYPE_CHECKING:
    from .config import EngineConfig, EngineConfigError
    from .embedding.config import EmbeddingConfig
    from .embedding.engine import EmbeddingEngine, EmbeddingStats
    from .embedding.frontend import EmbeddingFrontend, load_embedding_frontend
    from .embedding.request import EmbeddingOutput, EmbeddingRequest
    from .engine import EngineStats, LLMEngine
    from .frontend import Frontend, load_frontend
    from .request import EngineRequest, Guide, RequestOutput, RequestRejected, SamplingParams, TokenLogprob
    from .tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


__all__ = ["EngineConfig", "EngineConfigError", "EngineRequest", "EngineStats", "Frontend", "Guide", "LLMEngine",
           "RequestOutput", "RequestRejected", "SamplingParams", "TokenLogprob", "Tokenizer", "load_frontend",
           "EmbeddingConfig", "EmbeddingEngine", "EmbeddingFrontend", "EmbeddingOutput", "EmbeddingRequest",
           "EmbeddingStats", "load_embedding_frontend"]
