"""What a worker needs from an engine, as a Protocol: `engine.LLMEngine` satisfies it, and so does the
tests' fake engine, which keeps the fake honest."""

from __future__ import annotations

from typing import Any, Protocol

from engine import EngineRequest, RequestOutput


class ModelFrontend(Protocol):
    """What the HTTP layer needs of the model: an engine, or a `Frontend` when engines run elsewhere."""

    model_name: str
    max_model_len: int
    tokenizer: Any  # engine.tokenizer.Tokenizer, or a test's stand-in with encode/apply_chat_template
    generation_defaults: dict[str, float]


class Engine(ModelFrontend, Protocol):
    config: Any  # the engine's config: only max_running_requests is read

    def add_request(self, req: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...
