"""Sluice's inference engine: continuous batching over a paged KV cache, driven by a loop.

Public surface: `LLMEngine` (add_request / step / abort), `EngineConfig`, and the messages in
`engine.request`. Everything else is internal.
"""

from .config import EngineConfig, EngineConfigError
from .engine import LLMEngine
from .request import EngineRequest, RequestOutput, RequestRejected, SamplingParams

__all__ = ["EngineConfig", "EngineConfigError", "EngineRequest", "LLMEngine", "RequestOutput",
           "RequestRejected", "SamplingParams"]
