"""Sluice's inference engine: continuous batching over a paged KV cache, driven by a loop.

Public surface, all of it exported here: `LLMEngine` (add_request / step / abort, and what a worker
reports: `stats`, `kv_usage()`, `max_output_tokens()`), `EngineConfig`, the messages of
engine/request.py (`EngineRequest` in, `RequestOutput` out), and `load_frontend` (a model's tokenizer
and limits without its weights). Callers import from `engine` only; every submodule is internal.
"""

from .config import EngineConfig, EngineConfigError
from .engine import EngineStats, LLMEngine
from .frontend import Frontend, load_frontend
from .request import EngineRequest, Guide, RequestOutput, RequestRejected, SamplingParams, TokenLogprob
from .tokenizer import Tokenizer

__all__ = ["EngineConfig", "EngineConfigError", "EngineRequest", "EngineStats", "Frontend", "Guide", "LLMEngine",
           "RequestOutput", "RequestRejected", "SamplingParams", "TokenLogprob", "Tokenizer", "load_frontend"]
