"""What a worker needs from an engine, as Protocols: `engine.LLMEngine` satisfies `Engine` (and so does
the tests' fake engine, which keeps the fake honest), `engine.EmbeddingEngine` its loop part,
`StepEngine`. Everything the gateway reads of an engine is declared here, so what it reports
(`WorkerStats`) is the same for an embedded engine and a remote worker's."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from engine import EngineRequest, RequestOutput


class ModelFrontend(Protocol):
    """What the HTTP layer needs of the model: an engine, or `engine.Frontend` when engines run elsewhere."""

    model_name: str
    max_model_len: int
    # engine.Tokenizer, or a test's stand-in: encode, decode, apply_chat_template, token_pieces
    tokenizer: Any
    generation_defaults: dict[str, float]

    def max_output_tokens(self, prompt_len: int) -> int:
        """The largest max_tokens the engine takes with a prompt this long (it refuses a larger one)."""
        ...


class EngineCounters(Protocol):
    """The engine's counters a worker reports (`engine.EngineStats`)."""

    @property
    def busy_seconds(self) -> float: ...


@runtime_checkable
class StepEngine(Protocol):
    """What `EngineWorker` drives: the loop API and the counters it reports. `LLMEngine` and
    `EmbeddingEngine` both satisfy it (a request and its outputs are the engine's own kinds)."""

    model_name: str
    config: Any  # the engine's config: only max_running_requests is read

    @property
    def stats(self) -> EngineCounters: ...

    def kv_usage(self) -> float:
        """The share of the KV pool's blocks that running sequences hold."""
        ...

    def add_request(self, req: Any) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


@runtime_checkable  # the tests check that their fake engine has every member
class Engine(ModelFrontend, StepEngine, Protocol):
    """A chat engine: the model's frontend and the loop (`engine.LLMEngine`)."""

    def add_request(self, req: EngineRequest) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens admitted and not yet computed (the router's time-to-first-token estimate)."""
        ...


class EmbeddingModel(Protocol):
    """What the HTTP layer needs of an embedding model: `engine.EmbeddingEngine`, or
    `engine.EmbeddingFrontend` when engines run elsewhere."""

    model_name: str
    max_input_tokens: int
    dimensions: int
    supports_dimensions: bool

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]: ...
